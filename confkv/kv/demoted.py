"""Demoted blocks: what an evicting policy's budget leaves out, kept on the device at low precision and attended to.

Under a policy with ``demote_dtype`` (``int4`` or ``int2``; MiKV, "No Token Left Behind", 2024) an evicted block
still goes to the host tier at the pool's precision, so that a recall brings it back exact, and a copy quantised to
``demote_dtype`` stays here, on the device, where attention reads it beside the resident blocks. The budget (set by
confidence) thus decides which blocks keep the pool's precision, not which are attended to. A recall drops the copy
(the block is back at full precision); so does the end of the sequence. Copies are not dropped when the host tier
drops the full-precision block: they are then all that is left.

``int4`` copies are in KIVI's layout (``confkv/kv/block_keys.py``): keys per channel within the block
(``ChannelKeyCodec``; a demoted copy is a whole block, so its grid spans all its tokens) and values per token in
groups of 32 channels (``GroupedCodec``), the pool's int4 layout before it kept a quarter of each block's key
channels at 8 bits (fifteenth session; demotion with those has not been measured). One int4 grid per row for keys
and values alike, the layout used before (2026-12-07, eighth session), costs +16% perplexity on smollm2 with every
token in it against +1.24% for this one (docs/kv-dtypes.md). ``int2`` copies are KIVI's 2-bit layout, the same two
codecs at ``bits=2``: keys per channel within the block, values per token in groups of ``INT2_VALUE_GROUP`` channels
(until the ninth session, 2026-12-07, one int2 grid a row for keys and values alike).

The copies live outside the preallocated pool, one small tensor per block (at head_dim 64 and block 16, a token's K
and V rows in one layer and KV head: ``int4`` 48 + 40 = 88 bytes, ``int2`` 32 + 32 = 64, against 512 in float32;
``token_bytes`` is the rows' own width); ``used_bytes`` counts them, the
engine reports them beside the pool's bytes, and the pool counts them against its budget
(``BlockPool.count_outside``), so admission and preemption see them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.kv.block_keys import ChannelKeyCodec
from confkv.kv.quant import GroupedCodec, KVCodec

BlockKey = tuple[int, int]  # (sequence id, logical block index)

#: The ``demote_dtype`` values that keep a copy (``none`` keeps none).
DEMOTE_DTYPES: tuple[str, ...] = ("int4", "int2")
#: Channels per value group of an ``int2`` copy (a scale and zero point each; the int4 pool's values use 32). 16
#: measured better than 32 for its bytes on 3,000-token prose (+5.14% against +5.48% perplexity, 64 bytes a token's
#: K and V rows against 56; ``benchmarks/demote_bytes.py --int2-value-group``, docs/kv-dtypes.md, ninth session).
INT2_VALUE_GROUP = 16


@dataclass
class DemotedKeys:
    """A sequence's demoted blocks stacked for attention: rows ``[layers, tokens, kv_heads, row]`` (whole blocks in
    order; keys and values may differ in row width) and positions."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor  # [tokens] true positions


class DemoteFormat:
    """How demoted copies store a block's K and V at one ``demote_dtype``: a codec for keys and one for values.

    Rows come in whole blocks (``put`` demotes blocks), and ``gather`` stacks a sequence's blocks along the token
    axis; ``decode_k`` splits that axis back into blocks where the key codec's grid spans a block."""

    def __init__(self, name: str, head_dim: int, block_size: int) -> None:
        self.name = name
        self.block_size = block_size
        self.k_codec: ChannelKeyCodec
        self.v_codec: KVCodec
        if name == "int4":  # KIVI's layout: the pool's int4 values, its keys without the 8-bit outlier channels
            self.k_codec = ChannelKeyCodec(head_dim, block_size)
            self.v_codec = GroupedCodec()
        elif name == "int2":  # KIVI's 2-bit layout: the same two codecs at two bits
            self.k_codec = ChannelKeyCodec(head_dim, block_size, bits=2)
            self.v_codec = GroupedCodec(bits=2, group=INT2_VALUE_GROUP)
        else:
            raise ValueError(f"unknown demote_dtype {name!r}: choose one of {', '.join(DEMOTE_DTYPES)}")
        self.k_row = self.k_codec.row_bytes(head_dim)
        self.v_row = self.v_codec.row_bytes(head_dim)

    def token_bytes(self, num_layers: int, num_kv_heads: int) -> int:
        """Bytes of one token's demoted K and V rows, every layer and KV head."""
        return num_layers * num_kv_heads * (self.k_row + self.v_row)

    def encode_k(self, x: torch.Tensor) -> torch.Tensor:
        """Keys of whole blocks ``[..., block_size, kv_heads, head_dim]`` -> rows ``[..., block_size, kv_heads,
        k_row]``."""
        return self.k_codec.encode(x)

    def encode_v(self, x: torch.Tensor) -> torch.Tensor:
        return self.v_codec.encode(x)

    def decode_k(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[..., tokens, kv_heads, k_row]`` of whole blocks in order (zero rows of padding decode to zeros)
        -> keys ``[..., tokens, kv_heads, head_dim]``: the key grid spans a block, so the tokens are split back into
        blocks to decode."""
        *lead, tokens, kvh, row = rows.shape
        blocks = rows.reshape(*lead, tokens // self.block_size, self.block_size, kvh, row)
        return self.k_codec.decode(blocks, dtype).reshape(*lead, tokens, kvh, -1)

    def decode_v(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.v_codec.decode(rows, dtype)


class DemotedTier:
    """Low-precision device copies of evicted blocks, by sequence, with byte accounting."""

    def __init__(self, block_size: int, device: torch.device, head_dim: int) -> None:
        self.block_size = block_size
        self.device = device
        self._blocks: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.head_dim = head_dim
        self._formats: dict[str, DemoteFormat] = {}
        self._seq_format: dict[int, str] = {}
        self.used_bytes = 0
        self.peak_bytes = 0
        self.demoted_blocks = 0

    def format(self, seq_id: int) -> DemoteFormat:
        """The format of a sequence's copies (one per sequence: attention reads them in one pass)."""
        return self._formats[self._seq_format[seq_id]]

    def format_named(self, dtype: str) -> DemoteFormat:
        """The format of ``dtype``, made on first use: a geometry int4's per-channel keys cannot lay out (``4 x
        head_dim`` not a multiple of the block size) is refused (``ValueError``) where a policy demotes to it, not
        in every engine."""
        if dtype not in self._formats:
            self._formats[dtype] = DemoteFormat(dtype, self.head_dim, self.block_size)
        return self._formats[dtype]

    def has_blocks(self, seq_id: int) -> bool:
        return bool(self._blocks.get(seq_id))

    def indices_of(self, seq_id: int) -> list[int]:
        return sorted(self._blocks.get(seq_id, ()))

    def bytes_of(self, seq_id: int) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._blocks.get(seq_id, {}).values())

    def put(self, seq_id: int, indices: list[int], k: torch.Tensor, v: torch.Tensor, dtype: str) -> None:
        """Keep blocks (``k``/``v``: values ``[layers, n, block_size, kv_heads, head_dim]``) at ``dtype``. A
        sequence whose policy was swapped for one of another ``demote_dtype`` has its earlier copies re-encoded, so
        that its demoted blocks stay one format (what attention reads in one pass)."""
        old = self._seq_format.setdefault(seq_id, dtype)
        if old != dtype:
            self._recode(seq_id, self.format_named(old), self.format_named(dtype))
            self._seq_format[seq_id] = dtype
        fmt = self.format_named(dtype)
        kq, vq = fmt.encode_k(k.to(self.device)), fmt.encode_v(v.to(self.device))
        blocks = self._blocks.setdefault(seq_id, {})
        for j, idx in enumerate(indices):
            self._drop(seq_id, idx)
            blocks[idx] = (kq[:, j].clone(), vq[:, j].clone())
            self.used_bytes += blocks[idx][0].nbytes + blocks[idx][1].nbytes
        self.demoted_blocks += len(indices)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def _recode(self, seq_id: int, old: DemoteFormat, new: DemoteFormat) -> None:
        blocks = self._blocks.get(seq_id, {})
        for idx, (k, v) in list(blocks.items()):  # k, v: one block's rows [layers, block_size, kv_heads, row]
            values = (old.decode_k(k, torch.float32), old.decode_v(v, torch.float32))
            self.used_bytes -= k.nbytes + v.nbytes
            blocks[idx] = (new.encode_k(values[0]), new.encode_v(values[1]))
            self.used_bytes += blocks[idx][0].nbytes + blocks[idx][1].nbytes

    def drop(self, seq_id: int, indices: list[int]) -> None:
        """Forget these blocks' copies (recalled to the device, or cut from the sequence)."""
        for idx in indices:
            self._drop(seq_id, idx)

    def drop_from(self, seq_id: int, first: int) -> None:
        self.drop(seq_id, [i for i in self.indices_of(seq_id) if i >= first])

    def drop_sequence(self, seq_id: int) -> None:
        self.drop(seq_id, self.indices_of(seq_id))
        self._seq_format.pop(seq_id, None)

    def _drop(self, seq_id: int, idx: int) -> None:
        blocks = self._blocks.get(seq_id)
        if blocks is None or idx not in blocks:
            return
        k, v = blocks.pop(idx)
        self.used_bytes -= k.nbytes + v.nbytes
        if not blocks:
            del self._blocks[seq_id]

    def gather(self, seq_id: int, num_tokens: int) -> DemotedKeys | None:
        """The sequence's demoted blocks among its first ``num_tokens`` tokens, stacked in position order."""
        bs = self.block_size
        idx = [i for i in self.indices_of(seq_id) if i * bs < num_tokens]
        if not idx:
            return None
        blocks = self._blocks[seq_id]
        k = torch.cat([blocks[i][0] for i in idx], dim=1)  # [layers, n * bs, kvh, row]
        v = torch.cat([blocks[i][1] for i in idx], dim=1)
        pos = (torch.tensor(idx, dtype=torch.long)[:, None] * bs + torch.arange(bs)).reshape(-1)
        return DemotedKeys(k, v, pos.to(self.device))
