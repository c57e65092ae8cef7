"""What every way of ranking evictable KV blocks shares: the view it scores and the class it subclasses.

A scorer is one small class with one ``score()`` (kvpress's presses are the model). It says what the attention
function must record for it (``prefill_attention``, ``decode_attention``) and, from what was recorded, gives every
evictable block one number: higher means keep. The cache manager evicts the lowest first (the oldest on ties).
Adding a method is one file with one subclass, registered by name with ``@register`` (``confkv.plugins.SCORERS``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from confkv.plugins import SCORERS

if TYPE_CHECKING:
    from confkv.config import CachePolicy
    from confkv.kv.pool import BlockPool

PrefillRecord = Literal["none", "all", "window"]
DecodeRecord = Literal["none", "accumulate", "replace", "decay"]


@dataclass
class BlockView:
    """The evictable blocks of one sequence, in position order, and what is known about them."""

    pool: BlockPool
    logical: list[int]  # logical block indices (position order)
    block_ids: torch.Tensor  # their device block ids, [n]

    @property
    def mass(self) -> torch.Tensor:
        """Attention mass each slot has received as recorded for this scorer, ``[n, block_size]``."""
        return self.pool.score.view(-1, self.pool.block_size)[self.block_ids]

    def keys(self) -> torch.Tensor:
        """The blocks' keys (after RoPE), ``[layers, n, block_size, kv_heads, head_dim]``."""
        pool = self.pool
        slots = pool.slots_of(self.block_ids)
        rows = pool.k[:, slots].reshape(pool.num_layers, len(self.logical), pool.block_size, pool.num_kv_heads, -1)
        return pool.dequant_k(rows)


class BlockScorer(ABC):
    """Ranks a sequence's evictable blocks; see the module docstring."""

    name: ClassVar[str]
    #: Which prefill queries' attention the attention function records: none, a sample of all (accumulated
    #: attention), or a window: the last ``prefill_window`` queries of each prompt chunk, whose vote replaces the
    #: previous chunk's (so the prompt can be trimmed between chunks), then the prompt's last ``prefill_window``.
    prefill_attention: ClassVar[PrefillRecord] = "none"
    #: Whether decode queries' attention is added to what was recorded, replaces it, is added to what was recorded
    #: scaled down by ``decode_decay`` (an exponential moving sum), or is not recorded.
    decode_attention: ClassVar[DecodeRecord] = "none"

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy

    @property
    def prefill_window(self) -> int:
        """How many of the prompt's last queries vote when ``prefill_attention == "window"``."""
        return self.policy.snapkv_window

    @property
    def decode_decay(self) -> float:
        """What a decode query's recording multiplies the mass recorded before it by: 1 accumulates, 0 replaces."""
        return 0.0 if self.decode_attention == "replace" else 1.0

    @abstractmethod
    def score(self, view: BlockView) -> torch.Tensor:
        """One score per block of ``view`` (``[n]``, any float dtype): higher means keep."""


def register(cls: type[BlockScorer]) -> type[BlockScorer]:
    """Class decorator: make a scorer available by its ``name`` (the ``scorer:`` policy key)."""
    return SCORERS.register(cls)
