"""Evaluation workloads for comparing KV-cache policies, built offline and deterministically.

Six workloads stress different ways a smaller cache can fail:

* ``passkey``: one key hidden at a chosen depth of a haystack (``confkv.bench.passkey``), over a grid of lengths
  and depths; the classic test that evicted context is really gone.
* ``passkey-varied``: pass keys whose length and depth are drawn per item from ranges, so the question comes after
  a different number of tokens in every item (a grid puts it at the same few positions).
* ``multikey``: several key-value records scattered through real prose, one of them asked for; the model cannot
  know during prefill which record will matter, so a cache that keeps "the" important block is not enough.
* ``prose``: real documentation text for teacher-forced perplexity and KL against the full cache.
* ``longgen``: chat requests for long answers (stories, reports, explanations, tutorials), where the cache grows
  during decoding rather than prefill.
* ``chat``: multi-turn conversations whose last turn refers back to facts given in the first one.

Nothing is downloaded: the text is CPython's own ``pydoc_data`` topics (``confkv.bench.corpus``) and the
templates, scenarios and names in ``data/`` (``confkv.bench.workloads.data``). Every random choice comes from
``random.Random`` seeded by a SHA-256 of a string naming the workload, split, seed and item (Python's ``hash()`` is
salted per process), so a seed gives the same items on every machine with the same Python and tokenizer.

The builders live in ``retrieval`` (passkey, multikey) and ``conversation`` (prose, longgen, chat); ``items``
holds what they share.

How train and heldout are kept apart (a policy tuned on ``train`` must never have seen a ``heldout`` item):

* passkey, passkey-varied, multikey: the random streams are seeded with the split's name, and the numbers asked for are
  disjoint by parity: train keys and values are even, heldout ones odd. Multikey's key names use disjoint noun
  lists, and its filler and passkey's ``prose`` filler come from disjoint documentation topics
  (``corpus.split_passage``).
* prose: passages come from disjoint sets of documentation topics (``corpus.topic_splits``; topics that quote
  each other are kept in the same split).
* longgen: each kind of request has its own templates and topics; train uses the even-numbered ones of both,
  heldout the odd-numbered ones, so the splits share neither a template nor a topic.
* chat: the scenarios (the facts given and the question that refers back to them) and the small-talk
  question-answer pairs between them are split the same way, by even and odd position; so are the lead-ins and
  replies of long chats, whose pasted passages come from the split's own documentation topics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confkv.bench.workloads import conversation, retrieval
from confkv.bench.workloads.conversation import longgen_prompts
from confkv.bench.workloads.items import RETRIEVAL_MAX_TOKENS, SPLITS, WorkloadItem, render_chat
from confkv.bench.workloads.retrieval import PASSKEY_FILLERS

__all__ = [
    "PASSKEY_FILLERS",
    "RETRIEVAL_MAX_TOKENS",
    "SPLITS",
    "WORKLOADS",
    "WorkloadItem",
    "longgen_prompts",
    "make_workload",
    "render_chat",
]

WORKLOADS: tuple[str, ...] = ("passkey", "passkey-varied", "multikey", "prose", "longgen", "chat")

_DEFAULTS: dict[str, dict[str, Any]] = {
    "passkey": {"lengths": (1000, 2000), "depths": (0.1, 0.5, 0.9), "filler": "repeat"},
    "passkey-varied": {"length_range": (1000, 2000), "depth_range": (0.1, 0.9), "filler": "repeat"},
    "multikey": {"length": 1500, "num_pairs": 8},
    "prose": {"length": 1024, "context": 0},
    "longgen": {"max_tokens": 512},
    "chat": {"turns": 3, "max_tokens": 128, "length": 0},
}
_BUILDERS: dict[str, Callable[..., list[WorkloadItem]]] = {
    "passkey": retrieval.passkey,
    "passkey-varied": retrieval.passkey_varied,
    "multikey": retrieval.multikey,
    "prose": conversation.prose,
    "longgen": conversation.longgen,
    "chat": conversation.chat,
}


def make_workload(
    name: str, tokenizer: Any, split: str = "heldout", n: int = 4, seed: int = 0, **sizes: Any
) -> list[WorkloadItem]:
    """``n`` items of workload ``name`` (passkey: ``n`` repetitions of its length x depth grid).

    ``sizes`` overrides the workload's defaults (``_DEFAULTS``); a keyword the workload does not take is an error
    rather than silently ignored, since a misspelt size would otherwise benchmark the wrong thing.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: choose from {', '.join(SPLITS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer (got {n!r})")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer (got {seed!r})")
    unknown = sorted(set(sizes) - set(_DEFAULTS[name]))
    if unknown:
        allowed = ", ".join(_DEFAULTS[name])
        raise ValueError(f"unknown size keyword(s) for workload {name!r}: {', '.join(unknown)} (allowed: {allowed})")
    builder: Callable[..., list[WorkloadItem]] = _BUILDERS[name]
    return builder(tokenizer, split, n, seed, **{**_DEFAULTS[name], **sizes})
