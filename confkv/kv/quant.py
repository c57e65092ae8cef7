"""Quantised KV rows: each token's key (or value) vector of one KV head, packed with its own scale into bytes.

Scales are computed when a token is written (per token and KV head, as vLLM's int8/fp8 per-token modes and KIVI's
values do), so no calibration file is needed and a token's row never changes once its block is full (int4 and fp8
keys are re-encoded while their block fills): a block moves between the device pool, the host tier and a session
record as the same bytes. A row is ``[data | scale (| zero point)]``:

=======  ===========================================  ==============================  =====================
dtype    data                                         scale bytes                     bytes (head_dim 64)
=======  ===========================================  ==============================  =====================
int8     ``round(x / s)`` in -127..127, one a byte     ``s = absmax / 127``, float16   66 (fp32: 256)
fp8      ``x / s`` as ``float8_e4m3fn``               ``s >= absmax / 448``, float16  V 66, K 70 (block 16)
int4     ``round((x - m) / s)`` in 0..15, two a byte  ``s = (max - m) / 15``, ``m``   V 40, K 57 (block 16)
int2     ``round((x - m) / s)`` in 0..3, four a byte  ``s = (max - m) / 3``, ``m``    V 32, K 32 (demoted only)
=======  ===========================================  ==============================  =====================

The pool's int4 is KIVI's layout: values per token in groups of 32 channels (``GroupedCodec``, a grid per group),
keys per channel within a block (``ChannelKeyCodec``, a grid per channel over the block's tokens, spread over its
rows; a quarter of the block's channels, those of most energy, at 8 bits). The pool's fp8 keys are their block's
mean per channel (e4m3, spread the same way) plus an fp8 row of what is left, its scale searched once the block is
full (``Fp8KeyCodec``); its values are ``Fp8Codec`` rows. The two key codecs, coded a block at a time, are in
``confkv/kv/block_keys.py``. Demoted blocks (``confkv/kv/demoted.py``) use KIVI's int4 layout (every key channel at
4 bits) at int4 and at int2 (``bits=2``: four levels, KIVI's 2-bit layout, values in groups of 16); int2 is never
the pool's own dtype.

int4 is asymmetric (a zero point ``m``, the minimum): at 16 levels a symmetric grid wastes one level and, on a row
whose values lean to one side, half of the others. Scales are kept in float16, rounded before the data are
quantised against them, so that what is stored is exactly what is decoded. A row of zeros (a block handed out by the
pool, not yet written) decodes to zeros in every format; a non-finite input gives a non-finite scale and so decodes
non-finite, which the engine's checks catch as they would in a float pool.
"""

from __future__ import annotations

from typing import ClassVar, get_args

import torch

from confkv.config import KVCacheDtype

#: The ``kv_cache_dtype`` values (vLLM's spelling): ``auto`` stores K and V in the model's dtype.
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)

_SCALE = torch.float16
_TINY = torch.finfo(torch.float32).tiny


def _f16(x: torch.Tensor) -> torch.Tensor:
    """``[..., 1]`` float -> its float16 bytes ``[..., 2]``."""
    return x.to(_SCALE).contiguous().view(torch.uint8)


def from_f16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` bytes -> ``[..., 1]`` float32 (a copy: a byte slice of a row is not aligned for a view)."""
    return b.contiguous().view(_SCALE).float()


def e4m3_as_half(data: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (any shape) -> float16 values 2^-8 times theirs, contiguous.

    PyTorch converts float8 on the CPU element by element (3.7 ms for 800k values where int8 takes 0.2): the e4m3
    bits moved into float16's place give the value times 2^-8, subnormals included, in a few integer passes.
    e4m3fn's NaN (0x7f) becomes 480: only a NaN input makes one, and its row's scale is NaN too. The byte read as
    int8 widens with its sign bit copied into the high byte; shifted up 7, the sign lands on float16's (bit 15) and
    once more on bit 14, which the mask clears (0xBF80 as an int16)."""
    b = data.view(torch.int8).to(torch.int16, memory_format=torch.contiguous_format)
    b <<= 7
    return b.bitwise_and_(-0x4080).view(torch.float16)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n]`` of two 4-bit codes each (the first in the low bits) -> codes ``[..., 2n]`` as bytes.

    Each byte is widened to 16 bits and its high nibble moved up to the second byte, so that the int16 viewed as two
    bytes is the two codes in order: four passes over whole int16 words, where splitting the nibbles apart and
    interleaving them takes strided byte copies several times as slow on the CPU."""
    w = packed.to(torch.int16, memory_format=torch.contiguous_format)
    w = w.bitwise_or_(w << 4).bitwise_and_(0x0F0F)
    return w.view(torch.uint8)  # little-endian: the low byte (the first code) comes first


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., n]`` (bytes, each below ``2**bits``) -> bytes ``[..., n * bits / 8]``, ``8 // bits`` codes a
    byte, the first in the low bits."""
    per = 8 // bits
    q = q.reshape(*q.shape[:-1], -1, per)
    packed = q[..., 0]
    for j in range(1, per):
        packed = packed | (q[..., j] << (bits * j))
    return packed


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``_pack``: bytes ``[..., n]`` -> codes ``[..., n * 8 / bits]`` as bytes."""
    if bits == 4:
        return _nibbles(packed)
    packed = packed.contiguous()
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(8 // bits)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)


class KVCodec:
    """One quantised KV format: ``encode`` float rows ``[..., head_dim]`` into bytes ``[..., row_bytes]``."""

    name: str
    #: Bits of data per element (what the format costs, scales aside).
    bits: int
    #: Bytes of scale (and zero point) per row.
    extra_bytes: ClassVar[int]

    def row_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8 + self.extra_bytes

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        """The most a round trip may move each element of ``x`` (half a step, plus float16 scale rounding): what the
        tests hold the formats to, per row."""
        raise NotImplementedError


class Int8Codec(KVCodec):
    name = "int8"
    bits = 8
    extra_bytes = 2

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float().abs().amax(-1, keepdim=True) / 127).to(_SCALE).float()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        s = self._scale(x)
        q = (x.float() / s.clamp_min(_TINY)).round_().clamp_(-127, 127).to(torch.int8)
        return torch.cat([q.view(torch.uint8), _f16(s)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = rows.shape[-1] - 2
        # one pass: the multiply reads the int8 codes and writes float32 (type promotion), the same values as
        # converting first and multiplying after, without the converted copy
        return torch.mul(rows[..., :d].view(torch.int8), from_f16(rows[..., d:])).to(dtype)

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        return self._scale(x) * 0.5 + x.float().abs().amax(-1, keepdim=True) * 2**-10


class Fp8Codec(KVCodec):
    """e4m3 (``torch.float8_e4m3fn``, largest finite 448) with a scale per row.

    With ``search`` 1 the scale maps the row's absmax to 448. With ``search`` n it is the one of ``absmax / 448 *
    2**(j/n)``, ``j < n``, that leaves the row's squared rounding error least: a float grid's relative error is the
    same at every magnitude, so a scale only moves the row's elements against the grid's points, and over one octave
    (past it the grid repeats) some position puts the row's few large elements, which carry most of ``q . k``, near
    points. Decoding does not change: the scale is stored as before."""

    name = "fp8"
    bits = 8
    extra_bytes = 2
    _MAX = float(torch.finfo(torch.float8_e4m3fn).max)

    def __init__(self, search: int = 1) -> None:
        self.search = search

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float().abs().amax(-1, keepdim=True) / self._MAX).to(_SCALE).float()

    def _codes(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (x.float() / s.clamp_min(_TINY)).clamp_(-self._MAX, self._MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    def _searched(self, x: torch.Tensor, weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scale of each row under the best of ``search`` scales: every candidate's codes are made once,
        and the chosen one's kept."""
        xf = x.float()
        base = xf.abs().amax(-1, keepdim=True) / self._MAX
        steps = 2.0 ** (torch.arange(self.search, dtype=torch.float32, device=x.device) / self.search)
        s = (base.unsqueeze(0) * steps.view(-1, *[1] * base.dim())).to(_SCALE).float()  # [n, ..., 1]
        codes = self._codes(xf.unsqueeze(0), s)  # [n, ..., D]
        err = (e4m3_as_half(codes).float().mul_(s * 256.0) - xf).square_()
        if weight is not None:
            err.mul_(weight)
        best = err.sum(-1, keepdim=True).argmin(0, keepdim=True)  # [1, ..., 1]
        return codes.gather(0, best.expand_as(codes[:1])).squeeze(0), s.gather(0, best).squeeze(0)

    def encode(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        codes, s = self._searched(x, weight) if self.search > 1 else (self._codes(x, s := self._scale(x)), s)
        return torch.cat([codes, _f16(s)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = rows.shape[-1] - 2
        data, scale = rows[..., :d], from_f16(rows[..., d:])
        if rows.device.type != "cpu":
            return data.view(torch.float8_e4m3fn).float().mul_(scale).to(dtype)
        # float16 times float32 is float32: one pass
        return torch.mul(e4m3_as_half(data), scale * 256.0).to(dtype)

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        # 3 mantissa bits: half a step is 2^-4 of the value; below e4m3's smallest normal (2^-6) the step is 2^-9
        # times the scale, which a search (weighted or not) may take up to its largest candidate
        a = x.float().abs()
        s = self._scale(x) if self.search == 1 else a.amax(-1, keepdim=True) / self._MAX * 2.0 * (1 + 2**-10)
        return a * 2**-4 + s * 2**-10 + a.amax(-1, keepdim=True) * 2**-10


class _AsymmetricCodec(KVCodec):
    """Asymmetric ``bits``-bit: ``2**bits`` levels between the row's minimum and maximum, ``8 // bits`` values a
    byte (the first in the low bits)."""

    extra_bytes = 4

    @property
    def _levels(self) -> int:
        return (1 << self.bits) - 1

    def _grid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        lo = xf.amin(-1, keepdim=True).to(_SCALE).float()
        s = ((xf.amax(-1, keepdim=True) - lo) / self._levels).to(_SCALE).float()
        return s, lo

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        per = 8 // self.bits
        if x.shape[-1] % per:
            raise ValueError(f"{self.name} KV packs {per} values a byte: head_dim {x.shape[-1]} is not a multiple")
        s, lo = self._grid(x)
        q = ((x.float() - lo) / s.clamp_min(_TINY)).round_().clamp_(0, self._levels).to(torch.uint8)
        return torch.cat([_pack(q, self.bits), _f16(s), _f16(lo)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = rows.shape[-1] - 4
        q = _unpack(rows[..., :d], self.bits)
        return torch.mul(q, from_f16(rows[..., d : d + 2])).add_(from_f16(rows[..., d + 2 :])).to(dtype)

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        s, lo = self._grid(x)
        xf = x.float()
        # half a step; the float16 minimum may sit below the true one by its rounding, shifting the top level
        return (
            s * 0.5
            + (xf.amin(-1, keepdim=True) - lo).abs()
            + (self._levels + 1) * s * 2**-10
            + xf.abs().amax(-1, keepdim=True) * 2**-10
        )


class Int4Codec(_AsymmetricCodec):
    name = "int4"
    bits = 4


class Int2Codec(_AsymmetricCodec):
    """Four levels, one grid a row: the rows of ``GroupedCodec(bits=2)``'s groups (demoted copies' int2 values)."""

    name = "int2"
    bits = 2


class GroupedCodec(KVCodec):
    """Values per token in groups of ``group`` channels at ``bits`` (4 or 2), each group its own scale and zero point
    (``Int4Codec`` or ``Int2Codec`` rows of ``group`` values side by side): the pool's int4 values (``bits=4``,
    ``group=32``) and demoted copies' int2 values. One grid per 64-channel row cost +1.04% perplexity on smollm2
    with everything else exact, groups of 32 +0.40% (``benchmarks/int4_ablation.py``), for 4 more bytes a row."""

    GROUP = 32

    def __init__(self, bits: int = 4, group: int = GROUP) -> None:
        rows: dict[int, _AsymmetricCodec] = {4: Int4Codec(), 2: Int2Codec()}
        if bits not in rows:
            raise ValueError(f"values in groups: 4 or 2 bits, not {bits}")
        self.bits = bits
        self.name = f"int{bits}"
        self.group = group
        self._row = rows[bits]

    def _group(self, head_dim: int) -> int:
        return min(self.group, head_dim)

    def row_bytes(self, head_dim: int) -> int:
        g = self._group(head_dim)
        return head_dim // g * self._row.row_bytes(g)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        g = self._group(x.shape[-1])
        if x.shape[-1] % g:
            raise ValueError(f"{self.name} values in groups of {g}: head_dim {x.shape[-1]} is not a multiple")
        return x.reshape(*x.shape[:-1], -1, g)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._row.encode(self._split(x))  # [..., groups, g * bits / 8 + 4]
        return packed.reshape(*x.shape[:-1], -1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # a row of G groups is G * (group * bits / 8 + 4) bytes, unless head_dim is below the group (then one group,
        # narrower than a whole group's bytes)
        per = self._row.row_bytes(self.group)
        groups = rows.shape[-1] // per if rows.shape[-1] % per == 0 else 1
        out = self._row.decode(rows.reshape(*rows.shape[:-1], groups, -1), dtype)
        return out.reshape(*rows.shape[:-1], -1)

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        xs = self._split(x)
        return self._row.max_error(xs).expand(xs.shape).reshape(x.shape)
