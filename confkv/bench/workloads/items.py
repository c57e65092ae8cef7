"""What every workload builder shares: the item type, seeded draws, tokenizing, the split rule and size checks."""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confkv.bench.corpus import split_passage, split_text

SPLITS: tuple[str, ...] = ("train", "heldout")
RETRIEVAL_MAX_TOKENS = 8  # "The pass key is" is followed by the number at once: a few tokens say whether it is right


@dataclass(frozen=True)
class WorkloadItem:
    """One request of a workload, already tokenized, so every policy is given exactly the same ids."""

    workload: str
    item_id: str
    split: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    answer: str | None = None
    score_from: int | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def correct(self, text: str) -> bool | None:
        """Whether ``text`` contains the answer; ``None`` for items that have none (prose, longgen, chat).

        A numeric answer must not be part of a longer number, so "123456" does not count as finding "23456".
        """
        if self.answer is None:
            return None
        if self.answer.isdigit():
            return re.search(rf"(?<!\d){re.escape(self.answer)}(?!\d)", text) is not None
        return self.answer in text


def seed_of(*parts: object) -> int:
    """A 64-bit seed from a description of the draw: stable across processes, unlike ``hash()``."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big")


def rng_of(*parts: object) -> random.Random:
    return random.Random(seed_of(*parts))


def item_id(name: str, split: str, i: int) -> str:
    return f"{name}-{split}-{i:04d}"


def encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in tokenizer(text)["input_ids"])


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[int, ...]:
    """The chat template's ids; transformers returns a list or (newer versions) a BatchEncoding."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        out = out[0]
    return tuple(int(t) for t in out)


def split_parity(split: str) -> int:
    """Train numbers are even, heldout numbers odd: the splits can never ask for the same key."""
    return SPLITS.index(split)


def of_split(pool: Sequence[Any], split: str) -> list[Any]:
    """The even-positioned entries of ``pool`` for train, the odd-positioned ones for heldout."""
    return list(pool[split_parity(split) :: 2])


def check_int(workload: str, key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{workload} {key} must be an integer in [{lo}, {hi}] (got {value!r})")
    return value


def prose_ids(tokenizer: Any, num_tokens: int, seed: int, split: str) -> tuple[int, ...]:
    """At least ``num_tokens`` tokens of ``split``'s documentation (cut to exactly that many)."""
    if num_tokens <= 0:
        return ()
    chars = 6 * num_tokens + 200  # above any real tokenizer's characters per token, so one try is the rule
    limit = len(split_text(split))
    while True:
        if chars >= limit:
            raise ValueError(f"{num_tokens} tokens of prose is more than the {split} documentation holds")
        ids = encode(tokenizer, split_passage(chars, seed, split))
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
        chars *= 2
