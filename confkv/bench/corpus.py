"""Natural text that every Python installation carries: the reference documentation in ``pydoc_data``.

About 465,000 characters of English technical prose (the language reference's topics), available offline on
any machine, used as the haystack for retrieval prompts and as the text for perplexity.
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
