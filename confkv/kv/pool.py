"""The device KV pool: one preallocation, fixed-size blocks, a free list.

Allocating once answers the fragmentation the requirement warns about, and a block freed by one sequence is
usable by any other at once: memory a confident sequence gives up becomes room for more concurrent requests.

Layout: per layer, keys and values live in ``[num_blocks * block_size, kv_heads, head_dim]`` so that a token's
*slot* (``block * block_size + offset``) indexes every layer the same way and attention can gather a sequence's
resident tokens with one index tensor. Keys are stored after RoPE.

With a quantised ``kv_cache_dtype`` each ``[slot, kv_head]`` row holds the codec's bytes (data and the row's own
scale, ``confkv/kv/quant.py``; int4 and fp8 keys: that and a share of the block's per-channel grid or mean,
``confkv/kv/block_keys.py``) instead of ``head_dim`` floats, so the same bytes buy more slots. ``store`` quantises
as tokens are written; ``dequant_k`` (whole blocks), ``keys_at`` and ``dequant`` (values) are what attention and the
scorers read through. Blocks leave the pool (to the host tier, to a session record) as those bytes, so the lower
tiers hold the compact form too (or, with ``host_kv_dtype``, a more compact one the cache manager converts to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from confkv.errors import ConfkvError
from confkv.kv.block_keys import BlockKeyCodec
from confkv.kv.kv_format import KVFormat
from confkv.kv.quant import KVCodec
from confkv.kv.window import FloatWindow


@dataclass
class _KeyWrite:
    """What one forward pass's write of ``slots`` does to block-coded key blocks, the same in every layer."""

    slots: torch.Tensor
    blocks: torch.Tensor  # [nb] the blocks touched
    rows: torch.Tensor  # [len(slots)] each slot's row in ``values`` viewed as [nb * bs, kvh, D]
    filled: torch.Tensor  # [nb] rows written in each block after the write
    full_at: torch.Tensor  # positions among ``blocks`` of the blocks full after the write, on the pool's device
    values: torch.Tensor  # [layers, nb, bs, kvh, D] the blocks' exact keys
    full: list[int]  # blocks the write fills
    open: list[int]  # blocks still open after it
    layer: int = -1  # the last layer written


class BlockPool:
    """Preallocated KV blocks for all layers, a free list, and a per-slot attention-mass buffer for importance."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
        float_window: int = 0,
    ) -> None:
        """``dtype``: the model's (what attention computes in); ``kv_cache_dtype``: how K and V are stored;
        ``float_window``: tokens of each sequence also kept in ``dtype`` beside a quantised pool (``window``)."""
        if num_blocks < 1:
            raise ConfkvError("the KV pool holds no block: raise kv_cache_memory")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks
        #: The dtype attention computes in and ``dequant`` returns.
        self.compute_dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        try:
            #: How K and V are stored (``confkv/kv/quant.py``); int4 and fp8 keys are coded a block at a time
            #: (``confkv/kv/block_keys.py``).
            self.fmt = KVFormat(kv_cache_dtype, head_dim, block_size, dtype)
        except ValueError as err:
            raise ConfkvError(str(err)) from None
        #: The per-token codec of values (and of int8's keys); ``None`` at ``auto``.
        self.codec: KVCodec | None = self.fmt.v_codec
        #: The dtype of ``k`` and ``v`` themselves: bytes for a quantised pool.
        self.dtype = self.fmt.storage_dtype
        #: Last dimension of ``k`` and ``v``: ``head_dim`` values, or a quantised row's bytes (keys' and values' rows
        #: differ in width at int4).
        self.k_row, self.v_row = self.fmt.k_row, self.fmt.v_row
        #: Float copies of the keys of open blocks (written in part) under block-coded keys, with the rows filled:
        #: each write re-encodes the block (its channel grid or mean) from these exact values (no error compounds).
        self._open: dict[int, tuple[torch.Tensor, int]] = {}
        #: The forward pass's key write, planned at its first layer (block-coded keys only).
        self._key_write: _KeyWrite | None = None
        self.device = torch.device(device)
        self._block_bytes = block_size * self.fmt.bytes_per_token(num_layers, num_kv_heads)
        #: Byte counts of device memory kept outside the preallocation on its budget (``count_outside``).
        self._outside: list[Callable[[], int]] = []
        slots = num_blocks * block_size
        # torch.empty: pages are committed as blocks are first handed out. ``allocate`` zeroes every block it hands
        # out, because decode attention reads whole blocks, masked tails included (0 x NaN is NaN), and both
        # uninitialised memory and a block freed by a request that failed on non-finite values may hold NaN.
        try:
            self.k = torch.empty((num_layers, slots, num_kv_heads, self.k_row), dtype=self.dtype, device=self.device)
            self.v = torch.empty((num_layers, slots, num_kv_heads, self.v_row), dtype=self.dtype, device=self.device)
        except RuntimeError as err:  # torch.OutOfMemoryError included
            raise ConfkvError(
                f"cannot allocate a KV pool of {self.total_bytes / 2**30:.1f} GiB on {self.device} "
                f"({str(err).splitlines()[0]}); lower kv_cache_memory"
            ) from None
        #: Attention mass each slot has received (summed over heads and layers); block importance for eviction.
        self.score = torch.zeros(slots, dtype=torch.float32, device=self.device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        #: Exact K and V of the blocks holding each sequence's last ``float_window`` tokens (``confkv/kv/window.py``);
        #: ``None`` at ``auto`` (every row is exact already) or without a window.
        self.window: FloatWindow | None = None
        if float_window > 0 and self.fmt.quantised:
            self.window = FloatWindow(float_window, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, block_size=block_size, num_blocks=num_blocks, dtype=dtype,
                                      device=self.device)  # fmt: skip

    @staticmethod
    def geometry(model_config: Any) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)`` of a Hugging Face decoder config."""
        mc = model_config
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
        return mc.num_hidden_layers, kv_heads, head_dim

    @staticmethod
    def bytes_per_block_for(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> int:
        """K and V bytes of one block: ``dtype`` is the model's, ``kv_cache_dtype`` how the pool stores them."""
        try:
            fmt = KVFormat(kv_cache_dtype, head_dim, block_size, dtype)
        except ValueError as err:
            raise ConfkvError(str(err)) from None
        return block_size * fmt.bytes_per_token(num_layers, num_kv_heads)

    @property
    def bytes_per_block(self) -> int:
        return self._block_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def open_copy_bytes(self) -> int:
        """Bytes of one open block's float copy of its keys (block-coded keys only; 0 otherwise)."""
        if not isinstance(self.fmt.k_codec, BlockKeyCodec):
            return 0
        return self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * 4

    def has_open_copy(self, block: int) -> bool:
        """Whether an open block keeps a float copy of its keys now (block-coded keys only)."""
        return block in self._open

    def count_outside(self, source: Callable[[], int]) -> None:
        """Count bytes that live outside the preallocation but share its budget (the demoted copies) as used."""
        self._outside.append(source)

    @property
    def outside_bytes(self) -> int:
        """Device bytes kept beside the pool on its budget: open blocks' float copies, the float window's copies and
        what ``count_outside`` names."""
        window = self.window.used_bytes if self.window is not None else 0
        return len(self._open) * self.open_copy_bytes + window + sum(source() for source in self._outside)

    @property
    def outside_blocks(self) -> int:
        """``outside_bytes`` in whole blocks: blocks of the pool those bytes keep from being handed out."""
        return -(-self.outside_bytes // self._block_bytes)

    @property
    def num_free(self) -> int:
        """Blocks that may be handed out: the free list less the blocks' worth of bytes kept outside the pool, so
        that admission, preemption and recall count those bytes as they count blocks."""
        return max(0, len(self._free) - self.outside_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.bytes_per_block

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def kv_format(self) -> str:
        """What a block's stored rows are, as session records name it: the model's dtype as torch spells it
        (``"float32"``) or ``"kv-int8"``, ``"kv-fp8m"``, ``"kv-int4o"``; rows of one format mean nothing in another."""
        return self.fmt.record_dtype

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds when full (what its bytes buy at this ``kv_cache_dtype``)."""
        return self.num_blocks * self.block_size

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new keys and values ``[tokens, kv_heads, head_dim]`` into their slots, quantised if the pool is."""
        self.v[layer].index_copy_(0, slots, self.fmt.encode_v(v))
        if isinstance(self.fmt.k_codec, BlockKeyCodec):
            self._store_channel_keys(layer, slots, k)
        else:
            self.k[layer].index_copy_(0, slots, self.fmt.encode_k(k))

    def _store_channel_keys(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Block-coded keys: every block a write touches is re-encoded whole, its grid or mean taken over its filled
        rows, from exact values: a block open (written in part) keeps a float copy of its keys (``_open``), a block
        written whole (a prefill chunk's) needs none. A block that left the device open and came back (recall,
        session resume) restarts its copy from its decoded rows: only then does the grid of a block's earlier tokens
        change by their own rounding.

        A forward pass writes the same slots in every layer, so what does not depend on the layer (which blocks,
        their rows, their exact keys in every layer) is worked out once, at its first layer (``_KeyWrite``); each
        layer then writes its keys into that float copy and re-encodes the touched blocks."""
        plan = self._key_write
        if plan is None or plan.slots is not slots or layer <= plan.layer:
            plan = self._key_write = self._plan_key_write(slots)
        plan.layer = layer
        values = plan.values[layer]  # [nb, bs, kvh, D]; the open blocks' copies are views of it
        values.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, plan.rows, k.float())
        by_block = self.k[layer].view(self.num_blocks, self.block_size, self.num_kv_heads, self.k_row)
        by_block.index_copy_(0, plan.blocks, self.fmt.k_codec.encode(values, plan.filled, plan.full_at))
        if layer == self.num_layers - 1 and plan.full:  # every layer has written them: a full block's rows are final
            for b in plan.full:
                self._open.pop(b, None)
            for b in plan.open:  # a copy of its own, not a view that keeps the whole write's keys alive
                self._open[b] = (self._open[b][0].clone(), self._open[b][1])

    def _plan_key_write(self, slots: torch.Tensor) -> _KeyWrite:
        """The blocks ``slots`` touch, their exact keys in every layer (the open copy, else the decoded rows; zeros
        for a block written whole) and their filled rows after the write; ``_open`` takes views of those keys."""
        bs = self.block_size
        blocks, where, counts = torch.unique(slots // bs, return_inverse=True, return_counts=True)
        ids = blocks.tolist()
        last = torch.zeros(len(ids), dtype=torch.long, device=slots.device).scatter_reduce_(
            0, where, slots % bs + 1, reduce="amax"
        )
        shape = (self.num_layers, len(ids), bs, self.num_kv_heads, self.head_dim)
        values = torch.zeros(shape, dtype=torch.float32, device=self.device)
        stale = [j for j, (b, c) in enumerate(zip(ids, counts.tolist(), strict=True)) if b not in self._open and c < bs]
        if stale:  # blocks with rows written before and no exact copy: their decoded rows
            idx = torch.tensor(stale, dtype=torch.long, device=self.device)
            by_block = self.k.view(self.num_layers, self.num_blocks, bs, self.num_kv_heads, self.k_row)
            values[:, idx] = self.fmt.decode_k(by_block[:, blocks[idx]], torch.float32)
        filled, full, still_open = [], [], []
        for j, (b, n) in enumerate(zip(ids, last.tolist(), strict=True)):
            if b in self._open:
                values[:, j] = self._open[b][0]
                n = max(n, self._open[b][1])
            filled.append(n)
            if n < bs or b in self._open:  # open blocks, and full ones until their last layer is written
                self._open[b] = (values[:, j], n)
            (full if n == bs else still_open).append(b)
        rows = where * bs + slots % bs
        full_at = torch.tensor([j for j, n in enumerate(filled) if n == bs], dtype=torch.long, device=self.device)
        return _KeyWrite(
            slots, blocks, rows, torch.tensor(filled, device=self.device), full_at, values, full, still_open
        )

    def gather_blocks(self, which: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Whole blocks ``[len(blocks), block_size * kv_heads * row]`` of one layer's ``which`` (``k[layer]`` or
        ``v[layer]``), one contiguous copy a block. A quantised block's bytes are moved as 8-byte words where they
        divide into them: ``index_select`` copies rows of bytes more slowly than rows of 8-byte words (0.033 against
        0.022 ms for 272 blocks of 3,168 bytes, an int8 decode step's gather of one layer's keys, on 2 threads)."""
        rows = which.view(self.num_blocks, -1)
        if rows.dtype == torch.uint8 and rows.shape[1] % 8 == 0 and rows.storage_offset() % 8 == 0:
            return rows.view(torch.int64).index_select(0, blocks).view(torch.uint8)
        return rows.index_select(0, blocks)

    def dequant_k(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored key rows of whole blocks ``[..., block_size, kv_heads, row]`` (from the pool, the host tier or a
        session record) as keys ``[..., block_size, kv_heads, head_dim]`` in the compute dtype."""
        return self.fmt.decode_k(rows)

    def dequant(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored value rows ``[..., row]`` as ``[..., head_dim]`` values in the compute dtype; the rows themselves
        for an ``auto`` pool."""
        return self.fmt.decode_v(rows)

    def keys_at(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Keys ``[len(slots), kv_heads, head_dim]`` of some slots of one layer, in the compute dtype (block-coded
        keys are decoded by whole blocks)."""
        if not isinstance(self.fmt.k_codec, BlockKeyCodec):
            return self.fmt.decode_k(self.k[layer][slots])
        bs = self.block_size
        blocks, where = torch.unique(slots // bs, return_inverse=True)
        by_block = self.k[layer].view(self.num_blocks, bs, self.num_kv_heads, self.k_row)
        keys = self.fmt.decode_k(by_block[blocks])
        return keys.reshape(-1, self.num_kv_heads, self.head_dim)[where * bs + slots % bs]

    def allocate(self, n: int, zero: bool = True) -> list[int]:
        """``n`` free blocks; ``zero=False`` for a caller that writes every slot of them at once (a recall)."""
        if n > len(self._free):  # the free list itself: callers check ``num_free``, which counts outside bytes
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self._forget_open(ids)
        if ids and zero:
            slots = self.slots_of(ids)
            self.score[slots] = 0.0
            self.k[:, slots] = 0.0
            self.v[:, slots] = 0.0
        return ids

    def free(self, ids: list[int]) -> None:
        self._forget_open(ids)
        self._free.extend(ids)

    def _forget_open(self, ids: list[int]) -> None:
        """Blocks handed out, freed or overwritten: their float copies (open keys, the window's) go, and no planned
        key write survives."""
        for b in ids:
            self._open.pop(b, None)
        if self.window is not None:
            self.window.forget(ids)
        self._key_write = None

    def forget_from(self, block: int, filled: int) -> None:
        """Rows ``filled`` and on of ``block`` no longer hold tokens (a session cut mid-block): an open block's
        keys are coded over its first ``filled`` rows again from the next write."""
        if block in self._open:
            self._open[block] = (self._open[block][0], filled)
        self._key_write = None

    def slots_of(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """All slots of the given blocks, block by block."""
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        offsets = torch.arange(self.block_size, device=self.device)
        return (ids[:, None] * self.block_size + offsets).reshape(-1)

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values ``[layers, n, block_size, kv_heads, row]`` as stored (quantised rows for a quantised pool)
        and scores ``[n, block_size]``."""
        slots = self.slots_of(block_ids)
        shape = (self.num_layers, len(block_ids), self.block_size, self.num_kv_heads)
        return (
            self.k[:, slots].reshape(*shape, self.k_row),
            self.v[:, slots].reshape(*shape, self.v_row),
            self.score[slots].reshape(len(block_ids), self.block_size),
        )

    def write_blocks(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor, score: torch.Tensor) -> None:
        self._forget_open(block_ids)
        slots = self.slots_of(block_ids)
        flat = (self.num_layers, len(slots), self.num_kv_heads)
        self.k[:, slots] = k.to(self.device, non_blocking=True).reshape(*flat, self.k_row)
        self.v[:, slots] = v.to(self.device, non_blocking=True).reshape(*flat, self.v_row)
        self.score[slots] = score.to(self.device, non_blocking=True).reshape(-1)
