"""Natural text that every Python installation carries: the reference documentation in ``pydoc_data``.

About 465,000 characters of English technical prose (the language reference's topics), available offline on
any machine, used as the haystack for retrieval prompts and as the text for perplexity.

Evaluation workloads need a train split (for tuning) that never shows held-out text, so ``split_passage`` draws
only from one split's topics. The topics quote each other ("compound" holds "if" and "while", "specialnames" holds
"customization"), so topics that share a paragraph are grouped first and whole groups go to one split; the groups
are dealt out largest first to whichever split is smaller, which keeps the two near half the text each.
"""

from __future__ import annotations

import functools
import random


@functools.cache
def documentation_text() -> str:
    """Every pydoc topic, in sorted order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def prose_passage(num_chars: int, seed: int) -> str:
    """A passage of about ``num_chars`` characters starting at a paragraph boundary chosen by ``seed``."""
    text = documentation_text()
    rng = random.Random(seed)
    starts = [0] + [i + 2 for i in range(len(text) - 2) if text[i : i + 2] == "\n\n"]
    start = rng.choice([s for s in starts if s + num_chars < len(text)])
    end = text.rfind("\n", start, start + num_chars)
    return text[start : end if end > start else start + num_chars]


SPLITS = ("train", "heldout")
_SHARED_MIN_CHARS = 40  # shorter paragraphs are boilerplate ("Added in version 3.8.") that links unrelated topics


@functools.cache
def topic_splits() -> dict[str, str]:
    """Each pydoc topic's split: topics sharing a paragraph stay together, so no paragraph is in both splits."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    parent = {k: k for k in names}

    def root(k: str) -> str:
        while parent[k] != k:
            k = parent[k]
        return k

    owner: dict[str, str] = {}
    for k in names:
        for para in topics[k].split("\n\n"):
            para = para.strip()
            if len(para) < _SHARED_MIN_CHARS:
                continue
            if para in owner:
                a, b = root(owner[para]), root(k)
                parent[max(a, b)] = min(a, b)
            else:
                owner[para] = k
    groups: dict[str, list[str]] = {}
    for k in names:
        groups.setdefault(root(k), []).append(k)
    sizes = dict.fromkeys(SPLITS, 0)
    assignment: dict[str, str] = {}
    for members in sorted(groups.values(), key=lambda m: (-sum(len(topics[k]) for k in m), m[0])):
        split = min(SPLITS, key=lambda s: sizes[s])
        sizes[split] += sum(len(topics[k]) for k in members)
        assignment.update(dict.fromkeys(members, split))
    return assignment


@functools.cache
def split_text(split: str) -> str:
    """The topics of one split, in sorted order, separated by blank lines."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} (got {split!r})")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k, s in sorted(topic_splits().items()) if s == split)


@functools.cache
def _paragraph_starts(split: str) -> tuple[int, ...]:
    text = split_text(split)
    return (0, *(i + 2 for i in range(len(text) - 2) if text[i : i + 2] == "\n\n"))


def split_passage(num_chars: int, seed: int, split: str) -> str:
    """Like ``prose_passage``, but only from ``split``'s topics, so train and held-out passages never overlap."""
    text = split_text(split)
    candidates = [s for s in _paragraph_starts(split) if s + num_chars < len(text)]
    if not candidates:
        raise ValueError(f"no {split} passage of {num_chars} characters: the split holds {len(text)}")
    start = random.Random(seed).choice(candidates)
    end = text.rfind("\n", start, start + num_chars)
    return text[start : end if end > start else start + num_chars]
