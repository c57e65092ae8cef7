"""The device KV pool: one preallocation, fixed-size blocks, a free list.

Allocating once answers the fragmentation the requirement warns about, and a block freed by one sequence is
usable by any other at once: memory a confident sequence gives up becomes room for more concurrent requests.

Layout: per layer, keys and values live in ``[num_blocks * block_size, kv_heads, head_dim]`` so that a token's
*slot* (``block * block_size + offset``) indexes every layer the same way and attention can gather a sequence's
resident tokens with one index tensor. Keys are stored after RoPE.

With a quantised ``kv_cache_dtype`` each ``[slot, kv_head]`` row holds the codec's bytes (data and the row's own
scale, ``confkv/kv/quant.py``) instead of ``head_dim`` floats, so the same bytes buy more slots. ``store`` quantises
as tokens are written; ``dequant`` is what attention and the scorers read through. Blocks leave the pool (to the host
tier, to a session record) as those bytes, so the lower tiers hold the compact form too.
"""

from __future__ import annotations

from typing import Any

import torch

from confkv.errors import ConfkvError
from confkv.kv.quant import KVCodec, codec_for


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
    ) -> None:
        """``dtype``: the model's (what attention computes in); ``kv_cache_dtype``: how K and V are stored."""
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
        self.codec: KVCodec | None = codec_for(kv_cache_dtype)
        if self.codec is not None and (head_dim * self.codec.bits) % 8:
            raise ConfkvError(f"kv_cache_dtype {kv_cache_dtype}: head_dim {head_dim} does not pack into whole bytes")
        #: The dtype of ``k`` and ``v`` themselves: bytes for a quantised pool.
        self.dtype = dtype if self.codec is None else torch.uint8
        #: Last dimension of ``k``/``v``: ``head_dim`` values, or a quantised row's bytes.
        self.row = head_dim if self.codec is None else self.codec.row_bytes(head_dim)
        self.device = torch.device(device)
        slots = num_blocks * block_size
        # torch.empty: pages are committed as blocks are first handed out. ``allocate`` zeroes every block it hands
        # out, because decode attention reads whole blocks, masked tails included (0 x NaN is NaN), and both
        # uninitialised memory and a block freed by a request that failed on non-finite values may hold NaN.
        shape = (num_layers, slots, num_kv_heads, self.row)
        try:
            self.k = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.v = torch.empty_like(self.k)
        except RuntimeError as err:  # torch.OutOfMemoryError included
            raise ConfkvError(
                f"cannot allocate a KV pool of {self.total_bytes / 2**30:.1f} GiB on {self.device} "
                f"({str(err).splitlines()[0]}); lower kv_cache_memory"
            ) from None
        #: Attention mass each slot has received (summed over heads and layers); block importance for eviction.
        self.score = torch.zeros(slots, dtype=torch.float32, device=self.device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

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
        codec = codec_for(kv_cache_dtype)
        row = head_dim * torch.empty((), dtype=dtype).element_size() if codec is None else codec.row_bytes(head_dim)
        return 2 * num_layers * block_size * num_kv_heads * row

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_block_for(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.compute_dtype, self.kv_cache_dtype
        )

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

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
        (``"float32"``) or ``"kv-int8"``, ``"kv-fp8"``, ``"kv-int4"``; rows of one format mean nothing in another."""
        return str(self.dtype).removeprefix("torch.") if self.codec is None else f"kv-{self.kv_cache_dtype}"

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds when full (what its bytes buy at this ``kv_cache_dtype``)."""
        return self.num_blocks * self.block_size

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new keys and values ``[tokens, kv_heads, head_dim]`` into their slots, quantised if the pool is."""
        if self.codec is None:
            self.k[layer].index_copy_(0, slots, k.to(self.dtype))
            self.v[layer].index_copy_(0, slots, v.to(self.dtype))
        else:
            self.k[layer].index_copy_(0, slots, self.codec.encode(k))
            self.v[layer].index_copy_(0, slots, self.codec.encode(v))

    def dequant(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[..., row]`` (from the pool, the host tier or a session record) as ``[..., head_dim]``
        values in the compute dtype; the rows themselves for an ``auto`` pool."""
        return rows if self.codec is None else self.codec.decode(rows, self.compute_dtype)

    def allocate(self, n: int, zero: bool = True) -> list[int]:
        """``n`` free blocks; ``zero=False`` for a caller that writes every slot of them at once (a recall)."""
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        if ids and zero:
            slots = self.slots_of(ids)
            self.score[slots] = 0.0
            self.k[:, slots] = 0.0
            self.v[:, slots] = 0.0
        return ids

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)

    def slots_of(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """All slots of the given blocks, block by block."""
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        offsets = torch.arange(self.block_size, device=self.device)
        return (ids[:, None] * self.block_size + offsets).reshape(-1)

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values ``[layers, n, block_size, kv_heads, row]`` as stored (quantised rows for a quantised pool)
        and scores ``[n, block_size]``."""
        slots = self.slots_of(block_ids)
        shape = (self.num_layers, len(block_ids), self.block_size, self.num_kv_heads, self.row)
        return (
            self.k[:, slots].reshape(shape),
            self.v[:, slots].reshape(shape),
            self.score[slots].reshape(len(block_ids), self.block_size),
        )

    def write_blocks(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor, score: torch.Tensor) -> None:
        slots = self.slots_of(block_ids)
        flat = (self.num_layers, len(slots), self.num_kv_heads, self.row)
        self.k[:, slots] = k.to(self.device, non_blocking=True).reshape(flat)
        self.v[:, slots] = v.to(self.device, non_blocking=True).reshape(flat)
        self.score[slots] = score.to(self.device, non_blocking=True).reshape(-1)
