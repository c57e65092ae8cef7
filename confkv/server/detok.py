"""Incremental detokenisation for streaming: each new token costs a decode of a few tokens, not of the whole output.

The window trick is vLLM's: decode ``ids[prefix:]`` and ``ids[prefix:read]`` and take the difference, so tokenizers
whose pieces depend on their left neighbour (SentencePiece's leading space, byte-level BPE's split UTF-8 characters)
come out as in a full decode; a window that ends in U+FFFD (half a UTF-8 character) is held until the rest arrives.

Stop strings add a second hold-back: text that could be the beginning of a stop string is not sent until the next
tokens show it is not, because the engine cuts the final text at the stop string and a client cannot un-receive
text. So the streamed text is always a prefix of the final text, and equal to it once the final piece is sent.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._stop = [s for s in (stop or []) if s]
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""  # decoded so far (including what is held back for stop strings)
        self.sent = 0  # characters of ``text`` handed out

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that may be sent now (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            self.text += full[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(len(self.text) - self._held_back())

    def _held_back(self) -> int:
        """Characters at the end of ``text`` that may still turn into a stop string (or follow one)."""
        text, held = self.text, 0
        for s in self._stop:
            hit = text.find(s, max(0, self.sent - len(s) + 1))
            if hit >= 0:
                held = max(held, len(text) - hit)
                continue
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    held = max(held, k)
                    break
        return held

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the engine's authoritative, stop-cut text) after what was already sent."""
        sent = self.text[: self.sent]
        if not final_text.startswith(sent):  # cannot happen with the hold-back above; never resend text
            return ""
        rest = final_text[self.sent :]
        self.sent = len(final_text)
        return rest
