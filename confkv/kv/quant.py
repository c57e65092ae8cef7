"""Quantised KV rows: each token's key (or value) vector of one KV head, packed with its own scale into bytes.

Scales are computed when a token is written (per token and KV head, as vLLM's int8/fp8 per-token modes and KIVI's
values do), so no calibration file is needed and a token's row never changes once written: a block moves between the
device pool, the host tier and a session record as the same bytes. A row is ``[data | scale (| zero point)]``:

=======  =========================================  ==============================  ======================
dtype    data                                       scale bytes                     bytes (head_dim 64)
=======  =========================================  ==============================  ======================
int8     ``round(x / s)`` in -127..127, one a byte   ``s = absmax / 127``, float16   66 (fp32: 256)
fp8      ``x / s`` as ``float8_e4m3fn``             ``s = absmax / 448``, float16   66
int4     ``round((x - m) / s)`` in 0..15, two a byte ``s = (max - m) / 15``, ``m``   36
int2     ``round((x - m) / s)`` in 0..3, four a byte ``s = (max - m) / 3``, ``m``    20 (demoted blocks only)
=======  =========================================  ==============================  ======================

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


def _from_f16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` bytes -> ``[..., 1]`` float32 (a copy: a byte slice of a row is not aligned for a view)."""
    return b.contiguous().view(_SCALE).float()


class KVCodec:
    """One quantised KV format: ``encode`` float rows ``[..., head_dim]`` into bytes ``[..., row_bytes]``."""

    name: ClassVar[str]
    #: Bits of data per element (what the format costs, scales aside).
    bits: ClassVar[int]
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
        return rows[..., :d].view(torch.int8).float().mul_(_from_f16(rows[..., d:])).to(dtype)

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        return self._scale(x) * 0.5 + x.float().abs().amax(-1, keepdim=True) * 2**-10


class Fp8Codec(KVCodec):
    """e4m3 (``torch.float8_e4m3fn``, largest finite 448) with a per-row scale that maps the row's absmax to 448."""

    name = "fp8"
    bits = 8
    extra_bytes = 2
    _MAX = float(torch.finfo(torch.float8_e4m3fn).max)

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float().abs().amax(-1, keepdim=True) / self._MAX).to(_SCALE).float()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        s = self._scale(x)
        q = (x.float() / s.clamp_min(_TINY)).clamp_(-self._MAX, self._MAX).to(torch.float8_e4m3fn)
        return torch.cat([q.view(torch.uint8), _f16(s)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = rows.shape[-1] - 2
        data, scale = rows[..., :d], _from_f16(rows[..., d:])
        if rows.device.type != "cpu":
            return data.view(torch.float8_e4m3fn).float().mul_(scale).to(dtype)
        # PyTorch converts float8 on the CPU element by element (3.7 ms for 800k values where int8 takes 0.2): the
        # e4m3 bits moved into float16's place give the value times 2^-8, subnormals included, in a few integer
        # passes. e4m3fn's NaN (0x7f) becomes 480: only a NaN input makes one, and its row's scale is NaN too.
        b = data.to(torch.int16)
        half = ((b & 0x7F) << 7).bitwise_or_((b & 0x80) << 8).view(torch.float16)
        return half.float().mul_(scale * 256.0).to(dtype)

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        # 3 mantissa bits: half a step is 2^-4 of the value; below e4m3's smallest normal (2^-6) the step is 2^-9
        a = x.float().abs()
        s = self._scale(x)
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
        q = q.reshape(*q.shape[:-1], -1, per)
        packed = q[..., 0]
        for j in range(1, per):
            packed = packed | (q[..., j] << (self.bits * j))
        return torch.cat([packed, _f16(s), _f16(lo)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = rows.shape[-1] - 4
        packed = rows[..., :d].contiguous()
        parts = [packed & self._levels] + [(packed >> (self.bits * j)) & self._levels for j in range(1, 8 // self.bits)]
        q = torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], d * (8 // self.bits))
        return q.float().mul_(_from_f16(rows[..., d : d + 2])).add_(_from_f16(rows[..., d + 2 :])).to(dtype)

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
    """Four levels: only for demoted blocks (``demote_dtype: int2``), never the pool's own dtype."""

    name = "int2"
    bits = 2


_CODECS: dict[str, type[KVCodec]] = {c.name: c for c in (Int8Codec, Fp8Codec, Int4Codec)}
#: Formats a block evicted from the pool may be kept in on the device (``demote_dtype``).
DEMOTE_CODECS: dict[str, type[KVCodec]] = {c.name: c for c in (Int4Codec, Int2Codec)}


def codec_for(kv_cache_dtype: str) -> KVCodec | None:
    """The codec of a ``kv_cache_dtype``; ``None`` for ``auto`` (K and V stored as the model computes them)."""
    if kv_cache_dtype == "auto":
        return None
    try:
        return _CODECS[kv_cache_dtype]()
    except KeyError:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}"
        ) from None
