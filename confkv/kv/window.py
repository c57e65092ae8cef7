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

The copies live in one arena per K and V, ``[layers, blocks * block_size, kv_heads, head_dim]``, so that a forward
pass moves them with one index operation per layer rather than one per block; the arena is always exactly as large
as the blocks it holds (a block that leaves makes room for one that joins in the same call; otherwise the arena is
rebuilt to size), so ``used_bytes`` is the device memory it holds, which the pool counts against its budget.
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

    # ----------------------------------------------------------------------------------------------- the rule
    def first_block(self, num_tokens: int) -> int:
        """The oldest logical block holding one of the last ``tokens`` of ``num_tokens``: block ``i`` covers positions
        ``[i * bs, (i + 1) * bs)`` and is in the window while fewer than ``tokens`` tokens follow its end."""
        return max(0, (num_tokens - self.tokens) // self.block_size)

    @property
    def max_blocks(self) -> int:
        """The most blocks one sequence's window spans: ``tokens`` consecutive positions over whole blocks."""
        return -(-(self.tokens - 1) // self.block_size) + 1

    # ------------------------------------------------------------------------------------------------- bytes
    @property
    def num_blocks(self) -> int:
        return len(self._where)

    @property
    def used_bytes(self) -> int:
        """Device bytes the arena holds (exactly its blocks' copies)."""
        return len(self._where) * self.block_bytes

    def has(self, block: int) -> bool:
        return block in self._where

    # ----------------------------------------------------------------------------------------------- changes
    def update(self, join: list[int], leave: list[int]) -> None:
        """Blocks ``leave`` give up their copies and blocks ``join`` (just handed out: nothing written yet) get zeroed
        ones; a joining block reuses a leaving one's room, and the arena is rebuilt only when its size changes."""
        holes = [a for a in (self._drop(b) for b in leave) if a is not None]
        join = list(dict.fromkeys(b for b in join if b not in self._where))
        for b in join[: len(holes)]:
            a = holes.pop()
            self._set(b, a)
            rows = slice(a * self.block_size, (a + 1) * self.block_size)
            self.k[:, rows] = 0
            self.v[:, rows] = 0
        rest = [b for b in join if b not in self._where]
        if holes or rest:
            self._rebuild(rest)

    def forget(self, blocks: list[int]) -> None:
        """Blocks freed by the pool or overwritten (recall, restore): their copies go."""
        if any(b in self._where for b in blocks):
            holes = [a for a in (self._drop(b) for b in blocks) if a is not None]
            if holes:
                self._rebuild([])

    def _set(self, block: int, arena: int) -> None:
        self._where[block] = arena
        self.index[block] = arena

    def _drop(self, block: int) -> int | None:
        arena = self._where.pop(block, None)
        if arena is not None:
            self.index[block] = -1
        return arena

    def _rebuild(self, new: list[int]) -> None:
        """Arena of exactly the blocks held plus ``new`` (zeroed), in that order; the holes closed."""
        bs = self.block_size
        kept = sorted(self._where, key=self._where.__getitem__)
        old = torch.tensor([self._where[b] for b in kept], dtype=torch.long, device=self.device)
        rows = (old[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1)
        layers, _, kvh, dim = self.k.shape
        size = (len(kept) + len(new)) * bs
        k = torch.zeros((layers, size, kvh, dim), dtype=self.k.dtype, device=self.device)
        v = torch.zeros_like(k)
        k[:, : rows.numel()] = self.k.index_select(1, rows)
        v[:, : rows.numel()] = self.v.index_select(1, rows)
        self.k, self.v = k, v
        for a, b in enumerate([*kept, *new]):
            self._set(b, a)

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
        self.k[layer].view(-1, width).index_copy_(0, rows, k.index_select(0, hit).reshape(-1, width).to(self.k.dtype))
        self.v[layer].view(-1, width).index_copy_(0, rows, v.index_select(0, hit).reshape(-1, width).to(self.v.dtype))

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
