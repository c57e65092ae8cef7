"""Retrieval workloads: the answer is a number given once in a long prompt, asked for at its end.

* ``passkey``: one key hidden at a chosen depth of a haystack (``confkv.bench.passkey``), over a grid of lengths
  and depths; the classic test that evicted context is really gone.
* ``passkey-varied``: the same prompts with each item's length and depth drawn from ranges, so the question
  arrives after a different number of tokens in every item: a controller cannot tell from the position alone when
  the answer comes (a fixed grid puts it at the same position in every item).
* ``multikey``: several key-value records scattered through real prose, one of them asked for; the model cannot
  know during prefill which record will matter, so a cache that keeps "the" important block is not enough.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from confkv.bench.passkey import PasskeyItem, passkey_item
from confkv.bench.workloads.data import multikey_words
from confkv.bench.workloads.items import (
    RETRIEVAL_MAX_TOKENS,
    WorkloadItem,
    check_int,
    encode,
    item_id,
    of_split,
    prose_ids,
    rng_of,
    seed_of,
    split_parity,
)

PASSKEY_FILLERS: tuple[str, ...] = ("repeat", "prose")
MULTIKEY_INTRO = (
    "Several key-value records are hidden inside a long text that is otherwise irrelevant. "
    "Read it carefully and remember every record.\n"
)
MAX_PAIRS = 64


def passkey(
    tokenizer: Any,
    split: str,
    n: int,
    seed: int,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    filler: str | Sequence[str],
) -> list[WorkloadItem]:
    """A key per cell of fillers x lengths x depths, ``n`` times; the cell (not the item's index) seeds it, so
    adding a depth or a filler to the grid leaves the other cells' keys as they were.

    ``filler`` is one of ``PASSKEY_FILLERS`` or a sequence of them: repeated filler shows whether a policy keeps a
    key that stands out, prose whether it keeps one that reads like the text around it.
    """
    if isinstance(lengths, (int, str)) or not lengths:
        raise ValueError(f"passkey lengths must be a non-empty sequence of integers (got {lengths!r})")
    if isinstance(depths, (int, float, str)) or not depths:
        raise ValueError(f"passkey depths must be a non-empty sequence of numbers in [0, 1] (got {depths!r})")
    lengths = tuple(check_int("passkey", "length", length, 16, 1 << 20) for length in lengths)
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1:
            raise ValueError(f"passkey depths must be numbers in [0, 1] (got {d!r})")
    fillers = (filler,) if isinstance(filler, str) else tuple(filler)
    if not fillers or any(f not in PASSKEY_FILLERS for f in fillers) or len(set(fillers)) != len(fillers):
        raise ValueError(f"passkey filler must be 'repeat', 'prose' or a sequence of both (got {filler!r})")
    parity = split_parity(split)
    items: list[WorkloadItem] = []
    for rep in range(n):
        for kind in fillers:
            # the repeated filler's cells keep the seeds they had before fillers could be combined
            cell_tag: tuple[str, ...] = () if kind == "repeat" else (kind,)
            for length in lengths:
                for depth in depths:
                    item = _item_of_parity(tokenizer, length, depth, kind, split, parity,
                                           ("passkey", split, seed, rep, length, depth, *cell_tag))  # fmt: skip
                    items.append(
                        WorkloadItem(
                            workload="passkey",
                            item_id=item_id("passkey", split, len(items)),
                            split=split,
                            prompt_ids=encode(tokenizer, item.prompt),
                            max_tokens=RETRIEVAL_MAX_TOKENS,
                            answer=item.key,
                            meta={"length": length, "depth": float(depth), "filler": kind, "repeat": rep},
                        )
                    )
    return items


def _item_of_parity(
    tokenizer: Any, length: int, depth: float, filler: str, split: str, parity: int, tag: tuple[Any, ...]
) -> PasskeyItem:
    """A pass-key prompt whose key has the split's ``parity`` (so no key is both a training and a held-out answer):
    ``passkey_item`` draws the key itself, so it is drawn again, seeded by ``tag`` and the attempt, until it has."""
    attempt = 0
    while True:
        item = passkey_item(tokenizer, length, depth, seed_of(*tag, attempt), filler=filler, split=split)
        if int(item.key) % 2 == parity:
            return item
        attempt += 1


def _range(name: str, value: Any, kind: type) -> tuple[Any, Any]:
    """A ``(low, high)`` pair of ``kind`` with ``low <= high``, else a one-line error naming the keyword."""
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Sequence)
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, (kind, int)) for v in value)
        or value[0] > value[1]
    ):
        raise ValueError(f"passkey-varied {name} must be a pair (low, high) with low <= high (got {value!r})")
    return value[0], value[1]


def passkey_varied(
    tokenizer: Any,
    split: str,
    n: int,
    seed: int,
    *,
    length_range: Sequence[int],
    depth_range: Sequence[float],
    filler: str,
) -> list[WorkloadItem]:
    """``n`` pass keys, each with its length drawn uniformly from ``length_range`` (tokens) and its key's depth from
    ``depth_range``, from a stream seeded by the split, the seed and the item's index: a larger ``n`` extends the
    list without changing the items before, and the splits draw from different streams (and keys of different
    parity, as ``passkey``'s)."""
    lo, hi = _range("length_range", length_range, int)
    check_int("passkey-varied", "length", lo, 16, 1 << 20)
    check_int("passkey-varied", "length", hi, 16, 1 << 20)
    dlo, dhi = _range("depth_range", depth_range, float)
    if not 0 <= dlo <= dhi <= 1:
        raise ValueError(f"passkey-varied depth_range must lie in [0, 1] (got {depth_range!r})")
    if filler not in PASSKEY_FILLERS:
        raise ValueError(f"passkey-varied filler must be one of {', '.join(PASSKEY_FILLERS)} (got {filler!r})")
    parity = split_parity(split)
    items: list[WorkloadItem] = []
    for i in range(n):
        rng = rng_of("passkey-varied", split, seed, i)
        length = rng.randint(lo, hi)
        depth = round(rng.uniform(dlo, dhi), 3)
        item = _item_of_parity(tokenizer, length, depth, filler, split, parity, ("passkey-varied", split, seed, i))
        items.append(
            WorkloadItem(
                workload="passkey-varied",
                item_id=item_id("passkey-varied", split, i),
                split=split,
                prompt_ids=encode(tokenizer, item.prompt),
                max_tokens=RETRIEVAL_MAX_TOKENS,
                answer=item.key,
                meta={"length": length, "depth": depth, "filler": filler},
            )
        )
    return items


def _record(key: str, value: int) -> str:
    return f"The value for key {key} is {value}.\n"


def _multikey_question(key: str) -> str:
    return f"\nWhat is the value for key {key}? The value for key {key} is"


def _sentence_line_starts(text: str) -> list[int]:
    """Offsets where a line starts after a finished sentence or paragraph: a record there does not cut a
    sentence in two (the documentation is hard-wrapped, so most line starts are mid-sentence)."""
    return [0] + [m.end() for m in re.finditer(r"(?<=[.:\n]) *\n", text)]


def multikey(tokenizer: Any, split: str, n: int, seed: int, *, length: int, num_pairs: int) -> list[WorkloadItem]:
    """Records inserted between sentences of real prose, so they read as part of the document, not as a list."""
    length = check_int("multikey", "length", length, 16, 1 << 20)
    num_pairs = check_int("multikey", "num_pairs", num_pairs, 1, MAX_PAIRS)
    adjectives, nouns = multikey_words()
    names = [f"{a}-{b}" for a in adjectives for b in of_split(nouns, split)]
    parity = split_parity(split)
    items: list[WorkloadItem] = []
    for i in range(n):
        rng = rng_of("multikey", split, seed, i)
        keys = rng.sample(names, num_pairs)
        values = [2 * v + parity for v in rng.sample(range(5000, 50000), num_pairs)]  # distinct 5-digit numbers
        records = [_record(k, v) for k, v in zip(keys, values, strict=True)]
        target = rng.randrange(num_pairs)
        question = _multikey_question(keys[target])
        fixed = len(encode(tokenizer, MULTIKEY_INTRO + "".join(records) + question))
        if fixed > length:
            raise ValueError(
                f"multikey length {length} is too short for {num_pairs} pairs: they and the question alone take "
                f"{fixed} tokens"
            )
        filler_ids = prose_ids(tokenizer, length - fixed, rng.getrandbits(64), split)
        filler = tokenizer.decode(list(filler_ids)) if filler_ids else ""
        if filler and not filler.endswith("\n"):
            filler = filler[: filler.rfind(" ")] if " " in filler else filler  # no half word before the question
            filler += "\n"
        positions = sorted(rng.choice(_sentence_line_starts(filler)) for _ in range(num_pairs))
        order = list(range(num_pairs))
        rng.shuffle(order)
        parts, last, target_at = [MULTIKEY_INTRO], 0, 0
        offset = len(MULTIKEY_INTRO)
        for pos, k in zip(positions, order, strict=True):
            parts.append(filler[last:pos])
            offset += pos - last
            if k == target:
                target_at = offset
            parts.append(records[k])
            offset += len(records[k])
            last = pos
        parts += [filler[last:], question]
        prompt = "".join(parts)
        items.append(
            WorkloadItem(
                workload="multikey",
                item_id=item_id("multikey", split, i),
                split=split,
                prompt_ids=encode(tokenizer, prompt),
                max_tokens=RETRIEVAL_MAX_TOKENS,
                answer=str(values[target]),
                meta={
                    "length": length,
                    "num_pairs": num_pairs,
                    "key": keys[target],
                    "depth": round(target_at / len(prompt), 3),
                },
            )
        )
    return items
