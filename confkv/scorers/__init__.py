"""Ways of ranking the KV blocks a sequence may evict, one class per method (see ``confkv.scorers.base``).

A cache policy is a budget rule (``full``, a fixed size, ``dynamic``, ``learned``) plus one of these scorers;
``window``, ``streaming``, ``h2o`` and ``snapkv`` are presets of the two. Importing this package registers every
built-in scorer in ``confkv.plugins.SCORERS``.
"""

from confkv.plugins import SCORERS
from confkv.scorers import decayed, h2o, keydiff, knorm, recency, snapkv, tova  # noqa: F401  (each registers its scorer)
from confkv.scorers.base import BlockScorer, BlockView, register

__all__ = ["SCORERS", "BlockScorer", "BlockView", "make_scorer", "register"]


def make_scorer(name: str, policy: object) -> BlockScorer:
    return SCORERS.lookup(name)(policy)
