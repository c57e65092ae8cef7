"""The host tier: blocks evicted from the device, kept in host memory so that they can be recalled.

Blocks are kept as the pool stores them, or, with ``host_kv_dtype``, in a more compact ``KVFormat`` of their own
(the cache manager converts them on the way down and back up).

Bounded by ``host_cache_memory``; past the bound the least recently moved block is dropped for good (its sequence
can no longer recall it). Recall *moves* a block back, so a token lives in exactly one tier at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from confkv.kv.kv_format import KVFormat

BlockKey = tuple[int, int]  # (sequence id, logical block index)


@dataclass
class HostBlock:
    k: torch.Tensor  # [layers, block_size, kv_heads, head_dim], host memory
    v: torch.Tensor
    score: torch.Tensor  # [block_size] attention mass the tokens had received on the device

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class HostTier:
    """An LRU of evicted blocks with byte accounting, indexed by sequence for recall."""

    def __init__(self, capacity_bytes: int, pin_memory: bool = False, fmt: KVFormat | None = None) -> None:
        """``fmt``: how blocks are stored here (``host_kv_dtype``) where that is not the pool's form (``None``)."""
        self.fmt = fmt
        self.capacity_bytes = int(capacity_bytes)
        self.pin_memory = pin_memory
        self._lru: OrderedDict[BlockKey, HostBlock] = OrderedDict()
        self._by_seq: dict[int, set[int]] = {}
        self.used_bytes = 0
        self.peak_bytes = 0
        self.dropped_blocks = 0

    def __len__(self) -> int:
        return len(self._lru)

    def has_blocks(self, seq_id: int) -> bool:
        return seq_id in self._by_seq

    def blocks_of(self, seq_id: int) -> list[int]:
        """Logical indices of the sequence's blocks held here, in position order."""
        return sorted(self._by_seq.get(seq_id, ()))

    def bytes_of(self, seq_id: int) -> int:
        return sum(self._lru[(seq_id, i)].nbytes for i in self._by_seq.get(seq_id, ()))

    def put(
        self, seq_id: int, indices: list[int], k: torch.Tensor, v: torch.Tensor, score: torch.Tensor
    ) -> list[BlockKey]:
        """Store blocks (``k``/``v``: ``[layers, n, block_size, kv_heads, head_dim]``); return what was dropped.

        The returned keys may belong to other sequences: their owners must mark those blocks as gone.
        """
        k, v, score = k.to("cpu"), v.to("cpu"), score.to("cpu")
        if self.pin_memory:
            k, v = k.pin_memory(), v.pin_memory()
        for j, idx in enumerate(indices):
            block = HostBlock(k=k[:, j].clone(), v=v[:, j].clone(), score=score[j].clone())
            key = (seq_id, idx)
            self._lru[key] = block
            self._by_seq.setdefault(seq_id, set()).add(idx)
            self.used_bytes += block.nbytes
        dropped = self._trim()
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return dropped

    def resize(self, capacity_bytes: int) -> list[BlockKey]:
        """A new bound (a policy swap); returns what no longer fits and was dropped, as ``put`` does."""
        self.capacity_bytes = int(capacity_bytes)
        return self._trim()

    def _trim(self) -> list[BlockKey]:
        dropped: list[BlockKey] = []
        while self.used_bytes > self.capacity_bytes and self._lru:
            key, _ = self._pop_lru()
            dropped.append(key)
        self.dropped_blocks += len(dropped)
        return dropped

    def keys_of(self, seq_id: int, indices: list[int]) -> torch.Tensor:
        """Stacked keys ``[layers, n, block_size, kv_heads, head_dim]`` of some of a sequence's blocks."""
        return torch.stack([self._lru[(seq_id, i)].k for i in indices], dim=1)

    def take(self, seq_id: int, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove blocks and return their stacked keys, values and scores (for the move back to the device)."""
        blocks = [self._remove((seq_id, i)) for i in indices]
        return (
            torch.stack([b.k for b in blocks], dim=1),
            torch.stack([b.v for b in blocks], dim=1),
            torch.stack([b.score for b in blocks]),
        )

    def peek(self, seq_id: int, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stacked keys, values and scores of blocks that stay here (a session's write-through copy to the store);
        ``torch.stack`` copies, so the caller owns what it gets."""
        blocks = [self._lru[(seq_id, i)] for i in indices]
        return (
            torch.stack([b.k for b in blocks], dim=1),
            torch.stack([b.v for b in blocks], dim=1),
            torch.stack([b.score for b in blocks]),
        )

    def drop_sequence(self, seq_id: int) -> None:
        for idx in list(self._by_seq.get(seq_id, ())):
            self._remove((seq_id, idx))

    def _pop_lru(self) -> tuple[BlockKey, HostBlock]:
        key = next(iter(self._lru))
        return key, self._remove(key)

    def _remove(self, key: BlockKey) -> HostBlock:
        block = self._lru.pop(key)
        seq_blocks = self._by_seq[key[0]]
        seq_blocks.discard(key[1])
        if not seq_blocks:
            del self._by_seq[key[0]]
        self.used_bytes -= block.nbytes
        return block
