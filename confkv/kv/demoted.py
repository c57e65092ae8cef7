"""Demoted blocks: what an evicting policy's budget leaves out, kept on the device at low precision and attended to.

Under a policy with ``demote_dtype`` (``int4`` or ``int2``; MiKV, "No Token Left Behind", 2024) an evicted block
still goes to the host tier at the pool's precision, so that a recall brings it back exact, and a copy quantised
to ``demote_dtype`` (``confkv/kv/quant.py``, per token and KV head) stays here, on the device, where attention reads
it beside the resident blocks. The budget (set by confidence) thus decides which blocks keep the pool's precision,
not which are attended to. A recall drops the copy (the block is back at full precision); so does the end of the
sequence. Copies are not dropped when the host tier drops the full-precision block: they are then all that is left.

The copies live outside the preallocated pool, one small tensor per block (``int4``: 36 bytes a row at head_dim 64
against the pool's 256 in float32); ``used_bytes`` counts them, the engine reports them beside the pool's bytes, and
the pool counts them against its budget (``BlockPool.count_outside``), so admission and preemption see them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.kv.quant import DEMOTE_CODECS, KVCodec

BlockKey = tuple[int, int]  # (sequence id, logical block index)


@dataclass
class DemotedKeys:
    """A sequence's demoted blocks stacked for attention: rows ``[layers, tokens, kv_heads, row]`` and positions."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor  # [tokens] true positions


class DemotedTier:
    """Low-precision device copies of evicted blocks, by sequence, with byte accounting."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._blocks: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._codecs: dict[str, KVCodec] = {name: cls() for name, cls in DEMOTE_CODECS.items()}
        self._seq_codec: dict[int, str] = {}
        self.used_bytes = 0
        self.peak_bytes = 0
        self.demoted_blocks = 0

    def codec(self, seq_id: int) -> KVCodec:
        return self._codecs[self._seq_codec[seq_id]]

    def codec_named(self, dtype: str) -> KVCodec:
        return self._codecs[dtype]

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
        old = self._seq_codec.setdefault(seq_id, dtype)
        if old != dtype:
            self._recode(seq_id, self._codecs[old], self._codecs[dtype])
            self._seq_codec[seq_id] = dtype
        codec = self._codecs[dtype]
        kq, vq = codec.encode(k.to(self.device)), codec.encode(v.to(self.device))
        blocks = self._blocks.setdefault(seq_id, {})
        for j, idx in enumerate(indices):
            self._drop(seq_id, idx)
            blocks[idx] = (kq[:, j].clone(), vq[:, j].clone())
            self.used_bytes += blocks[idx][0].nbytes + blocks[idx][1].nbytes
        self.demoted_blocks += len(indices)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def _recode(self, seq_id: int, old: KVCodec, new: KVCodec) -> None:
        blocks = self._blocks.get(seq_id, {})
        for idx, (k, v) in list(blocks.items()):
            values = (old.decode(k, torch.float32), old.decode(v, torch.float32))
            self.used_bytes -= k.nbytes + v.nbytes
            blocks[idx] = (new.encode(values[0]), new.encode(values[1]))
            self.used_bytes += blocks[idx][0].nbytes + blocks[idx][1].nbytes

    def drop(self, seq_id: int, indices: list[int]) -> None:
        """Forget these blocks' copies (recalled to the device, or cut from the sequence)."""
        for idx in indices:
            self._drop(seq_id, idx)

    def drop_from(self, seq_id: int, first: int) -> None:
        self.drop(seq_id, [i for i in self.indices_of(seq_id) if i >= first])

    def drop_sequence(self, seq_id: int) -> None:
        self.drop(seq_id, self.indices_of(seq_id))
        self._seq_codec.pop(seq_id, None)

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
