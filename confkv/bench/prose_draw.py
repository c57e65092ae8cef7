"""More held-out prose items than a suite's default, no more alike than the suite's own items are (issue 35).

A comparison on a suite's two or four prose items has no interval worth the name; a paired bootstrap over items
needs more of them. ``draw_prose`` takes them through the suite's own code (``make_workload("prose", ...)`` at the
suite's length, split and seed: item ``i`` is the same text whatever ``n`` is, so the suite's items come first), but
the passages start at random paragraphs of one split (about 232,000 characters), so later draws can repeat much of
an earlier one (on the standard suite's held-out split at 3,000 tokens, item 6 shares 56% of its text with item 3).
An item is kept only when it shares no more with each item kept before it than the suite's own items share with
each other (``max_overlap``); the others are skipped, and too few kept items is an error rather than a silently
smaller or more alike sample.

Overlap is counted in ``NGRAM``-token windows: the share of the smaller item's distinct windows that the other item
also holds (a shared window of 16 tokens is a shared passage, not a common phrase).
"""

from __future__ import annotations

import itertools
from typing import Any

from confkv.bench.specs import SuiteSpec
from confkv.bench.workloads import WorkloadItem, make_workload

NGRAM = 16
#: Candidates drawn per item wanted before giving up: the held-out split holds about eighteen disjoint
#: 3,000-token passages, so a sample this many draws cannot fill is one the split cannot give.
DRAWS_PER_ITEM = 4


def windows(ids: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The distinct ``NGRAM``-token windows of a token sequence."""
    return {tuple(ids[k : k + NGRAM]) for k in range(len(ids) - NGRAM + 1)}


def shared(wa: set[tuple[int, ...]], wb: set[tuple[int, ...]]) -> float:
    """The share of the smaller window set that the other holds too (0: nothing in common, or no windows)."""
    if not wa or not wb:
        return 0.0
    return len(wa & wb) / min(len(wa), len(wb))


def overlap(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    """The share of the smaller sequence's distinct windows that the other holds too (0: nothing in common)."""
    return shared(windows(a), windows(b))


def max_overlap(items: list[WorkloadItem]) -> float:
    """The largest overlap between two of ``items`` (0 for fewer than two)."""
    return max((overlap(a.prompt_ids, b.prompt_ids) for a, b in itertools.combinations(items, 2)), default=0.0)


def draw_prose(
    tokenizer: Any, spec: SuiteSpec, n: int, split: str = "heldout", seed: int = 0
) -> tuple[list[WorkloadItem], float]:
    """``n`` prose items of ``spec``'s length, and the overlap limit they keep to (the suite's own items' largest).

    Up to the suite's own count these are its items, unchanged; beyond it, later draws of the same code that share
    no more than that limit with any item already kept. Raises ``ValueError`` when ``DRAWS_PER_ITEM`` times ``n``
    draws do not give ``n`` such items (the split has too little text at this length)."""
    sizes = {k: v for k, v in spec.prose.items() if k != "n"}
    own = make_workload("prose", tokenizer, split=split, n=spec.prose["n"], seed=seed, **sizes)
    limit = max_overlap(own)
    if n <= len(own):
        return own[:n], limit
    kept, kept_windows = list(own), [windows(it.prompt_ids) for it in own]
    candidates = make_workload("prose", tokenizer, split=split, n=DRAWS_PER_ITEM * n, seed=seed, **sizes)
    for item in candidates[len(own) :]:
        w = windows(item.prompt_ids)
        if all(shared(w, k) <= limit for k in kept_windows):
            kept.append(item)
            kept_windows.append(w)
            if len(kept) == n:
                return kept, limit
    raise ValueError(
        f"the {split} prose gives {len(kept)} items of {sizes.get('length')} tokens sharing at most {limit:.0%} "
        f"of their text (the suite's own items' most) in {len(candidates)} draws, not {n}"
    )
