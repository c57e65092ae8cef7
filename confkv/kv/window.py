"""The float window: exact K and V of each sequence's most recent tokens beside a quantised pool.

Under a quantised ``kv_cache_dtype`` with ``kv_float_window: R`` (Hugging Face's ``QuantizedCache``
``residual_length``, KIVI's full-precision residual), the blocks that hold any of a sequence's last ``R`` tokens also
keep their K and V in the model's dtype here, and attention reads those rows instead of their decoded codes. The
pool's own rows are written as always (codes), so a block that leaves the window, is evicted, recalled or written to
a session record is what it would be without the window: only what attention reads of the newest tokens changes.

A block joins when the cache manager allocates it for a sequence's new tokens (``join``) and leaves once ``R``
tokens follow it (``CacheManager.reserve`` asks ``leaving``) or when the pool frees or overwrites it (``forget``):
an evicted, preempted or parked block loses its copy, and a block coming back (recall, swap-in, session resume)
reads its codes until newer blocks take over the window.

The copies live in one arena per K and V, ``[layers, capacity * block_size, kv_heads, head_dim]``, so that a forward
pass moves them with one index operation per layer rather than one per block. The arena keeps room: a block that
leaves gives its arena block to a list of spare ones and a block that joins takes a spare one, so a decode step
copies nothing. (When the arena was always exactly its blocks, a sequence's oldest window block, which leaves one
step before its next block joins when ``R`` is a multiple of the block size, had the whole arena copied twice every
``block_size`` steps per sequence: about once a step at 8 sequences.)

* Growth: only when a join finds no spare block, by exactly the blocks missing, so the arena is never larger than
  the most blocks it has held at once (at most ``max_blocks`` a sequence then, what reserving admission sets aside
  for each, ``CacheManager.outside_blocks``).
* Shrinking (a copy of the blocks kept): when the spare blocks exceed ``held // min_blocks``. A sequence whose
  window is whole holds ``min_blocks`` (``ceil(R / block_size)``) blocks or one more, so when every one is at its
  low point (the step before its next block joins) that bound is one spare a sequence, what their next joins take;
  what a finished or preempted sequence gives back beyond it is returned to the pool at once (none is kept when no
  block is held). ``trim`` gives back the spare blocks a step's joins do not take when the pool needs the
  bytes (``CacheManager.trim_window``, before a running sequence's step would preempt another).
* Bytes: ``used_bytes`` is the whole arena, spare blocks included (the device memory it holds), which the pool
  counts against its budget (``BlockPool.outside_bytes``). A step's room (``CacheManager.room_needed``) counts only
  the copies the spare blocks cannot take; a spare block is bytes already counted, given up by a block that left,
  so keeping it never takes the pool past its budget.
"""

from __future__ import annotations

import torch


class FloatWindow:
    """Float copies of K and V of the pool blocks in some sequence's window, by pool block id."""

    def __init__(
        self,
        tokens: int,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if tokens < 1:
            raise ValueError("a float window holds at least one token")
        self.tokens = tokens
        self.block_size = block_size
        self.device = device
        self._shape = (num_layers, block_size, num_kv_heads, head_dim)
        el = torch.empty((), dtype=dtype).element_size()
        #: K and V bytes of one block's copy (every layer).
        self.block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * el
        self.k = torch.zeros((num_layers, 0, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        #: Arena block of each pool block, ``-1`` where it has no copy (on the CPU: read when a pass is packed).
        self.index = torch.full((num_blocks,), -1, dtype=torch.long)
        self._where: dict[int, int] = {}
        #: Arena blocks no pool block holds, kept for the next join (last in, first out).
        self._spare: list[int] = []
        #: Times the arena was copied to a new size (growth or shrinking): what the spare blocks save.
        self.resizes = 0

    # ----------------------------------------------------------------------------------------------- the rule
    def first_block(self, num_tokens: int) -> int:
        """The oldest logical block holding one of the last ``tokens`` of ``num_tokens``: block ``i`` covers positions
        ``[i * bs, (i + 1) * bs)`` and is in the window while fewer than ``tokens`` tokens follow its end."""
        return max(0, (num_tokens - self.tokens) // self.block_size)

    @property
    def max_blocks(self) -> int:
        """The most blocks one sequence's window spans: ``tokens`` consecutive positions over whole blocks."""
        return -(-(self.tokens - 1) // self.block_size) + 1

    @property
    def min_blocks(self) -> int:
        """The fewest blocks a whole window (a sequence of at least ``tokens`` tokens) spans."""
        return -(-self.tokens // self.block_size)

    # ------------------------------------------------------------------------------------------------- bytes
    @property
    def num_blocks(self) -> int:
        """Blocks holding a copy now."""
        return len(self._where)

    @property
    def capacity(self) -> int:
        """Arena blocks: those holding a copy and the spare ones."""
        return self.k.shape[1] // self.block_size

    @property
    def spare(self) -> int:
        """Arena blocks a join can take without the arena growing."""
        return len(self._spare)

    @property
    def used_bytes(self) -> int:
        """Device bytes the arena holds: every arena block, spare ones included (``k.nbytes + v.nbytes``)."""
        return self.capacity * self.block_bytes

    def has(self, block: int) -> bool:
        return block in self._where

    # ----------------------------------------------------------------------------------------------- changes
    def update(self, join: list[int], leave: list[int]) -> None:
        """Blocks ``leave`` give up their copies and blocks ``join`` (just handed out: nothing written yet) get zeroed
        ones, in spare arena blocks (a leaving block's among them); the arena grows only by the blocks missing."""
        for b in leave:
            self._drop(b)
        join = [b for b in dict.fromkeys(join) if b not in self._where]
        if len(join) > len(self._spare):
            self._resize(self.capacity + len(join) - len(self._spare))
        bs = self.block_size
        for b in join:
            a = self._spare.pop()
            self._set(b, a)
            self.k[:, a * bs : (a + 1) * bs] = 0
            self.v[:, a * bs : (a + 1) * bs] = 0
        self._bound_spare()

    def forget(self, blocks: list[int]) -> None:
        """Blocks freed by the pool or overwritten (recall, restore): their copies go."""
        if any(b in self._where for b in blocks):
            for b in blocks:
                self._drop(b)
            self._bound_spare()

    def trim(self, keep: int = 0) -> None:
        """Give back the spare arena blocks but ``keep`` of them (the pool needs the bytes)."""
        if len(self._spare) > keep:
            self._resize(len(self._where) + keep)

    def _set(self, block: int, arena: int) -> None:
        self._where[block] = arena
        self.index[block] = arena

    def _drop(self, block: int) -> None:
        arena = self._where.pop(block, None)
        if arena is not None:
            self.index[block] = -1
            self._spare.append(arena)

    def _bound_spare(self) -> None:
        """Shrink the arena to its blocks plus ``held // min_blocks`` spare ones where it keeps more."""
        keep = len(self._where) // self.min_blocks
        if len(self._spare) > keep:
            self._resize(len(self._where) + keep)

    def _resize(self, capacity: int) -> None:
        """An arena of ``capacity`` blocks: a larger one keeps every block where it is (one copy of the old arena,
        the new blocks spare and zeroed); a smaller one moves the held blocks to the front, in arena order."""
        bs, old = self.block_size, self.capacity
        layers, _, kvh, dim = self.k.shape
        k = torch.zeros((layers, capacity * bs, kvh, dim), dtype=self.k.dtype, device=self.device)
        v = torch.zeros_like(k)
        if capacity >= old:
            k[:, : old * bs] = self.k
            v[:, : old * bs] = self.v
            self._spare[:0] = range(capacity - 1, old - 1, -1)  # taken after the old spare ones
        else:
            kept = sorted(self._where, key=self._where.__getitem__)
            if kept:
                at = torch.tensor([self._where[b] for b in kept], dtype=torch.long, device=self.device)
                rows = (at[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1)
                k[:, : rows.numel()] = self.k.index_select(1, rows)
                v[:, : rows.numel()] = self.v.index_select(1, rows)
            for a, b in enumerate(kept):
                self._set(b, a)
            self._spare = list(range(capacity - 1, len(kept) - 1, -1))
        self.k, self.v = k, v
        self.resizes += 1

    # ------------------------------------------------------------------------------------------ reading plans
    def rows_of(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For pool ``slots`` (CPU): which of them have a copy (their indices in ``slots``) and the copy's arena
        rows, both on the device; ``None`` when none has."""
        if not self._where:
            return None
        arena = self.index[slots // self.block_size]
        hit = (arena >= 0).nonzero().squeeze(1)
        if hit.numel() == 0:
            return None
        rows = arena[hit] * self.block_size + slots[hit] % self.block_size
        return hit.to(self.device, non_blocking=True), rows.to(self.device, non_blocking=True)

    def blocks_of(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For pool ``blocks`` (CPU): which of them have a copy (their indices in ``blocks``) and the copies' arena
        blocks, both on the device; ``None`` when none has. Whole blocks move as one contiguous row each."""
        if not self._where:
            return None
        arena = self.index[blocks]
        hit = (arena >= 0).nonzero().squeeze(1)
        if hit.numel() == 0:
            return None
        return hit.to(self.device, non_blocking=True), arena[hit].to(self.device, non_blocking=True)

    def write(self, layer: int, plan: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the exact keys and values ``[tokens, kv_heads, head_dim]`` a pass writes into window blocks (``plan``:
        ``rows_of`` the pass's slots)."""
        hit, rows = plan
        width = k.shape[1] * k.shape[2]
        if hit.numel() < k.shape[0]:  # else every token is in a window block (a decode step's): no selection
            k, v = k.index_select(0, hit), v.index_select(0, hit)
        self.k[layer].view(-1, width).index_copy_(0, rows, k.reshape(-1, width).to(self.k.dtype))
        self.v[layer].view(-1, width).index_copy_(0, rows, v.reshape(-1, width).to(self.v.dtype))

    def read_into(
        self, layer: int, plan: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Overwrite rows of dequantised ``keys``/``values`` with their exact copies: rows ``[n, kv_heads,
        head_dim]`` with ``plan`` from ``rows_of`` (the slots they were gathered from), or whole blocks ``[n,
        block_size, kv_heads, head_dim]`` with ``plan`` from ``blocks_of``. Both are moved as 2-D rows, which
        ``index_select`` copies with one memcpy each rather than element by element."""
        hit, rows = plan
        width = keys[0].numel()
        k2, v2 = keys.view(keys.shape[0], width), values.view(values.shape[0], width)
        k2.index_copy_(0, hit, self.k[layer].view(-1, width).index_select(0, rows).to(keys.dtype))
        v2.index_copy_(0, hit, self.v[layer].view(-1, width).index_select(0, rows).to(values.dtype))
