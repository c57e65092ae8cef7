"""Ways of ranking the KV blocks a sequence may evict, one class per method (see ``confkv.scorers.base``).

A cache policy is a budget rule (``full``, a fixed size, ``dynamic``, ``learned``) plus one of these scorers;
``window``, ``streaming``, ``h2o`` and ``snapkv`` are presets of the two.
"""

from confkv.scorers import decayed, h2o, knorm, recency, snapkv, tova  # noqa: F401  (each registers its scorer)
from confkv.scorers.base import SCORERS, BlockScorer, BlockView, register

SCORER_NAMES: tuple[str, ...] = tuple(SCORERS)

__all__ = ["SCORERS", "SCORER_NAMES", "BlockScorer", "BlockView", "make_scorer", "register"]


def make_scorer(name: str, policy: object) -> BlockScorer:
    try:
        return SCORERS[name](policy)  # type: ignore[arg-type]
    except KeyError:
        raise ValueError(f"unknown scorer {name!r}; choose one of {', '.join(SCORERS)}") from None
