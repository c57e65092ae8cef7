"""When a generating request stops, and the text it ends with.

A request stops at one of its stop token ids, at an end-of-sequence token (unless ``ignore_eos``), when one of its
stop strings appears in its newest tokens, at ``max_tokens``, or at the model's context. Only the tail of the output
is decoded for the stop-string check, so a long answer does not cost a whole decode per token; the final text is cut
where the earliest stop string starts.
"""

from __future__ import annotations

from typing import Any

from confkv.engine.sequence import Sequence


def stop_reason(seq: Sequence, token: int, eos_token_ids: set[int] | frozenset[int], max_model_len: int,
                tokenizer: Any) -> str | None:  # fmt: skip
    """``"stop"``, ``"length"`` or None (go on) after ``token`` was appended to ``seq``."""
    p = seq.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        return "stop"
    if p.stop and _stop_in_tail(seq, tokenizer):
        return "stop"
    if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= max_model_len:
        return "length"
    return None


def _stop_in_tail(seq: Sequence, tokenizer: Any) -> bool:
    """Whether a stop string ends in the newest tokens: only the tail is decoded, not the whole output."""
    width = max(len(s) for s in seq.params.stop) + 8
    tail = tokenizer.decode(seq.output_token_ids[-width:], skip_special_tokens=True)
    return any(s in tail for s in seq.params.stop)


def output_text(seq: Sequence, tokenizer: Any) -> str:
    """The output decoded, cut where the earliest stop string starts."""
    text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
    return text[: min(hits)] if hits else text
