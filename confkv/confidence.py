"""The model's confidence in its next token, for a whole batch at once.

The requirement's reference code softmaxes, sorts the vocabulary and calls ``.item()`` per sequence: a full sort
and a host synchronisation per sequence per step. Here one ``log_softmax`` and one ``topk(2)`` serve every row, the
results stay on the logits' device, and the engine moves them to the host together with the sampled tokens (one
synchronisation per step). Entropy is in nats, the unit the requirement's threshold (3.5) is written in.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

_FLOAT32_MIN = torch.finfo(torch.float32).min


@dataclass(frozen=True)
class Signals:
    """Per-row confidence signals; each tensor has shape ``[batch]``.

    ``top1_id`` is the greedy token: the ``argmax`` of the logits, as Hugging Face's greedy search takes it (the
    first of tied maxima; ``topk`` leaves the order of ties unspecified, so it could choose another).
    """

    entropy: torch.Tensor
    gap: torch.Tensor
    top1_prob: torch.Tensor
    top1_id: torch.Tensor
    logprobs: torch.Tensor

    def rows(self, index: list[int]) -> Signals:
        """The signals of the rows ``index`` only (rows left out of sampling keep theirs computed once)."""
        return Signals(*(getattr(self, f.name)[index] for f in fields(self)))

    def stacked(self) -> torch.Tensor:
        """``[3, batch]`` float tensor (entropy, gap, top-1 probability), for one device-to-host copy."""
        return torch.stack((self.entropy, self.gap, self.top1_prob))


def confidence_signals(logits: torch.Tensor) -> Signals:
    """Entropy, top-1/top-2 probability gap and top-1 probability of ``softmax(logits)`` for every row.

    ``logits`` is ``[batch, vocab]`` in any float dtype; the computation runs in float32 so that bf16/fp16 models
    give the same signals as fp32 ones.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    # -sum p*log p as one dot product per row (torch.special.entr is a slower elementwise pass); clamping keeps a
    # masked (-inf) logit's term at 0 * finite = 0 instead of NaN.
    entropy = -torch.linalg.vecdot(logprobs.exp(), logprobs.clamp(min=_FLOAT32_MIN))
    top = logprobs.topk(2, dim=-1)
    top_probs = top.values.exp()
    return Signals(
        entropy=entropy,
        gap=top_probs[:, 0] - top_probs[:, 1],
        top1_prob=top_probs[:, 0],
        top1_id=logits.argmax(dim=-1),
        logprobs=logprobs,
    )
