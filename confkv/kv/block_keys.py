"""Keys coded a block at a time: a block's statistics per channel (an int grid, or an e4m3 mean) spread over its
rows beside each row's own bytes, so that a block is still its rows and moves between tiers as the same bytes.

The pool's int4 keys and demoted int4/int2 keys are ``ChannelKeyCodec`` (KIVI's keys per channel); its fp8 keys are
``Fp8KeyCodec`` (the block's mean per channel plus fp8 rows of what is left). Both are re-encoded whole from exact
keys while their block fills (``confkv/kv/pool.py``). The row formats they build on are in ``confkv/kv/quant.py``.
"""

from __future__ import annotations

import torch

from confkv.kv.quant import _SCALE, _TINY, Fp8Codec, _pack, _unpack, e4m3_as_half


class BlockKeyCodec:
    """Keys encoded a whole block at a time: besides each row's own bytes, ``block_bytes`` per block and KV head (a
    float16 grid per channel, or an e4m3 mean per channel) spread over the block's ``block_size`` rows in order
    (zeros fill the last rows' share where the block does not divide them), so that a block is still its rows and
    moves between tiers as the same bytes. ``filled`` (the rows written so far) keeps a partly
    written block's empty rows out of the block's statistics: the pool re-encodes an open block from its float copy
    as it fills (``confkv/kv/pool.py``)."""

    name: str
    bits: int

    def __init__(self, head_dim: int, block_size: int, own_bytes: int, block_bytes: int) -> None:
        self.head_dim = head_dim
        self.block_size = block_size
        self._own = own_bytes
        self._block_bytes = block_bytes
        self._share = -(-block_bytes // block_size)  # a block's last rows carry zeros where bs does not divide

    def row_bytes(self, head_dim: int | None = None) -> int:
        return self._own + self._share

    def _real(self, x: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
        """``[..., bs, 1, 1]``: which rows of blocks ``x`` ``[..., bs, kvh, D]`` are written."""
        return (torch.arange(self.block_size, device=x.device) < filled[..., None])[..., None, None]

    def _spread_bytes(self, raw: torch.Tensor) -> torch.Tensor:
        """Each block's bytes ``[..., kvh, block_bytes]`` -> spread over its rows ``[..., bs, kvh, share]``."""
        pad = self.block_size * self._share - raw.shape[-1]
        if pad:
            raw = torch.cat([raw, raw.new_zeros(*raw.shape[:-1], pad)], dim=-1)
        return raw.reshape(*raw.shape[:-1], self.block_size, self._share).transpose(-2, -3)

    def _gather_bytes(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of ``_spread_bytes`` on whole blocks' rows ``[..., bs, kvh, row]``."""
        raw = rows[..., self._own :].transpose(-2, -3).contiguous()  # [..., kvh, bs, share]
        return raw.reshape(*raw.shape[:-2], self.block_size * self._share)[..., : self._block_bytes]

    def encode(
        self, x: torch.Tensor, filled: torch.Tensor | None = None, full: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Blocks of keys ``[..., block_size, kv_heads, head_dim]`` -> rows ``[..., block_size, kv_heads, row]``.
        ``full``: where a caller already knows them, the positions of the full blocks among ``x``'s blocks
        (flattened); a codec that treats full blocks apart would otherwise find them from ``filled``, a host sync on
        CUDA."""
        raise NotImplementedError

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[..., block_size, kv_heads, row]`` (whole blocks) -> keys ``[..., block_size, kv_heads, D]``."""
        raise NotImplementedError


class ChannelKeyCodec(BlockKeyCodec):
    """Keys per channel within a block (KIVI, 2024), at ``bits`` 4 (the pool's int4) or 2 (demoted int2 copies):
    each channel of a block's keys gets its own scale and zero point over the block's tokens, so an outlier channel
    (RoPE'd keys have several) sets only its own range.

    Per-token int4 keys cost +16% perplexity on smollm2 (docs/kv-dtypes.md); the outliers are per channel, so a row's
    one range serves its small channels badly. A block's ``head_dim`` scales and zero points (float16, ``4 *
    head_dim`` bytes) are spread over its ``block_size`` rows, ``4 * head_dim / block_size`` bytes each. At head_dim
    64 and block 16 a key row is 48 bytes at int4 (32 of data), 32 at int2 (16 of data).

    ``outliers`` (int4 only): each block's that many channels of most energy over its written rows (per KV head)
    get 8 bits, 255 levels, instead of 4 (KVQuant's and MiKV's point that a few key channels carry most of ``q .
    k``): their code's high nibble sits among the others' codes, under a stored scale of 16 steps, and its low nibble
    in ``outliers / 2`` bytes after them; the block also stores the channels' indices (a byte each). The pool's int4
    keeps a quarter of the channels (``outliers_for``): on smollm2's 3,000-token texts its keys alone cost +0.19%
    instead of +0.90% (docs/kv-dtypes.md), for 9 more bytes a key row (57 at head_dim 64 and block 16)."""

    @staticmethod
    def outliers_for(head_dim: int) -> int:
        """The channels per block and KV head the pool's int4 keys keep at 8 bits: a quarter (16 at head_dim 64),
        rounded down to an even count; none above head_dim 256, where a channel's index no longer fits a byte."""
        return head_dim // 8 * 2 if head_dim <= 256 else 0

    def __init__(self, head_dim: int, block_size: int, bits: int = 4, outliers: int = 0) -> None:
        if bits not in (4, 2):
            raise ValueError(f"keys per channel: 4 or 2 bits, not {bits}")
        per = 8 // bits
        if head_dim % per or (4 * head_dim) % block_size:
            raise ValueError(
                f"int{bits} keys per channel: head_dim {head_dim} must be a multiple of {per} and 4 x head_dim a "
                f"multiple of the block size {block_size}"
            )
        if outliers and (bits != 4 or outliers % 2 or not 0 < outliers <= head_dim <= 256):
            raise ValueError(
                f"int{bits} keys: {outliers} outlier channels (int4 only, even, at most head_dim, head_dim at most "
                "256: a channel's index is a byte)"
            )
        super().__init__(head_dim, block_size, head_dim * bits // 8 + outliers // 2, 4 * head_dim + outliers)
        self.name = f"int{bits}"
        self.bits = bits
        self.outliers = outliers
        self._levels = (1 << bits) - 1

    def _grid(
        self, x: torch.Tensor, filled: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Scale, zero point ``[..., 1, kvh, D]`` and outlier channels ``[..., 1, kvh, outliers]`` (in no order, or
        None) of blocks ``x`` ``[..., bs, kvh, D]`` over their first ``filled`` rows (``[...]``, or all rows). An
        outlier channel's scale is 16 of its steps."""
        xf = x.float()
        lo_in, hi_in, written = xf, xf, xf
        if filled is not None:
            unwritten = ~self._real(x, filled)
            lo_in = xf.masked_fill(unwritten, float("inf"))
            hi_in = xf.masked_fill(unwritten, float("-inf"))
            written = xf.masked_fill(unwritten, 0.0) if self.outliers else xf
        lo = lo_in.amin(-3, keepdim=True)
        hi = hi_in.amax(-3, keepdim=True)
        empty = lo > hi  # no row yet (inf > -inf): a zero grid
        lo = lo.masked_fill_(empty, 0.0).to(_SCALE).float()
        span = hi.masked_fill_(empty, 0.0).sub_(lo)
        if not self.outliers:
            return span.div_(self._levels).to(_SCALE).float(), lo, None
        energy = (written * written).sum(-3, keepdim=True)
        top = energy.topk(self.outliers, dim=-1, sorted=False).indices
        levels = torch.full_like(span, float(self._levels)).scatter_(-1, top, 255.0 / 16)
        return span.div_(levels).to(_SCALE).float(), lo, top

    def encode(
        self, x: torch.Tensor, filled: torch.Tensor | None = None, full: torch.Tensor | None = None
    ) -> torch.Tensor:
        s, lo, top = self._grid(x, filled)
        block = self._spread_bytes(self._block_raw(s, lo, top))
        if top is None:
            q = ((x.float() - lo) / s.clamp_min(_TINY)).round_().clamp_(0, self._levels).to(torch.uint8)
            return torch.cat([_pack(q, self.bits), block], dim=-1)
        step = s.scatter(-1, top, s.gather(-1, top) / 16)
        levels = torch.full_like(s, float(self._levels)).scatter_(-1, top, 255.0)
        q = ((x.float() - lo) / step.clamp_min(_TINY)).round_().clamp_(min=0).minimum(levels).to(torch.uint8)
        at = top.expand(*q.shape[:-1], -1)
        fine = q.gather(-1, at)
        return torch.cat([_pack(q.scatter(-1, at, fine >> 4), 4), _pack(fine & 15, 4), block], dim=-1)

    def _block_raw(self, s: torch.Tensor, lo: torch.Tensor, top: torch.Tensor | None) -> torch.Tensor:
        """A block's own bytes ``[..., kvh, 4D (+ outliers)]``: float16 scales, zero points (, outlier channels)."""
        halves = torch.cat([s, lo], dim=-1).squeeze(-3).to(_SCALE).contiguous().view(torch.uint8)
        return halves if top is None else torch.cat([halves, top.squeeze(-3).to(torch.uint8)], dim=-1)

    def block_grid(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Whole blocks' rows ``[..., bs, kvh, row]`` -> each block's scale and zero point ``[..., 1, kvh, D]``
        (float32; an outlier channel's scale is 16 of its steps) and outlier channels ``[..., 1, kvh, outliers]``
        (int64, or None)."""
        raw = self._gather_bytes(rows)
        d = self.head_dim
        halves = raw[..., : 4 * d].contiguous().view(_SCALE).float().unsqueeze(-3)
        top = raw[..., 4 * d :].long().unsqueeze(-3) if self.outliers else None
        return halves[..., :d], halves[..., d:], top

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        s, lo, top = self.block_grid(rows)
        data = self.head_dim * self.bits // 8
        out = torch.mul(_unpack(rows[..., :data], self.bits), s)
        if top is not None:
            fine = _unpack(rows[..., data : self._own], 4).float()
            top = top.expand(*out.shape[:-1], -1)
            out.scatter_add_(-1, top, fine * s.expand_as(out).gather(-1, top) / 16)
        return out.add_(lo).to(dtype)

    def max_error(self, x: torch.Tensor, filled: torch.Tensor | None = None) -> torch.Tensor:
        """Half a step of each channel's grid plus float16 rounding of its zero point, for the filled rows (an
        outlier channel's is 8 of its steps: loose, never too tight)."""
        s, lo, _ = self._grid(x, filled)
        xf = x.float()
        real_lo = xf.amin(-3, keepdim=True) if filled is None else lo
        steps = (self._levels + 1) * s * 2**-10
        return s * 0.5 + (real_lo - lo).abs() + steps + xf.abs().amax(-3, keepdim=True) * 2**-10


class Fp8KeyCodec(BlockKeyCodec):
    """The pool's fp8 keys: each block's keys less their mean per channel (over the block's written rows, itself
    stored in e4m3), the rest in e4m3 with a scale per token and KV head (``Fp8Codec``'s rows), the mean added back
    on reading.

    e4m3's 3 mantissa bits cost keys a relative error of up to 2^-4 in every element, and the channels RoPE leaves
    large (its slow pairs) carry most of ``q . k``: plain fp8 keys cost +1.12% perplexity on smollm2's 3,000-token
    texts. Those channels hold nearly the same value across a block's tokens, so what is left after the mean is
    small, and so is its rounding (SageAttention, 2024, smooths K by one mean over the whole context, which softmax
    does not see; a mean per block keeps a block self-contained and follows RoPE's slow drift). The residual is
    taken against the mean as stored, so the mean's own rounding lands in the residual, where e4m3 keeps it to 2^-4
    of its small size: an e4m3 mean (one byte a channel) costs what a float16 one does, within the draws of the
    rounding (docs/kv-dtypes.md), for half its bytes. A key row is ``[D e4m3 codes | float16 scale | ceil(D/bs)
    bytes of the block's means]``: 70 bytes at head_dim 64 and block 16.

    Once a block is full, each residual row's scale is the best of ``SEARCH`` over an octave, each channel's error
    weighed by its mean square over the block (``weighted``), a stand-in for the queries' energy, which no write
    sees: fp8 went from +0.29% to +0.11% on 3,000-token texts (unweighted: no change; docs/kv-dtypes.md).
    """

    #: Scales tried per row of a full block (``Fp8Codec(search=...)``).
    SEARCH = 4

    def __init__(self, head_dim: int, block_size: int, search: int = SEARCH, weighted: bool = True) -> None:
        super().__init__(head_dim, block_size, head_dim + Fp8Codec.extra_bytes, head_dim)
        self.name = "fp8"
        self.bits = 8
        self._rows = Fp8Codec()
        self._final = Fp8Codec(search=search)
        self.weighted = weighted

    def _mean(self, x: torch.Tensor, filled: torch.Tensor | None) -> torch.Tensor:
        """Each block's mean key per channel ``[..., 1, kvh, D]`` over its written rows, as e4m3 bytes."""
        xf = x.float()
        if filled is None:
            mean = xf.mean(-3, keepdim=True)
        else:
            count = filled.clamp_min(1).to(xf.dtype)[..., None, None, None]
            mean = (xf * self._real(x, filled)).sum(-3, keepdim=True).div_(count)
        return mean.clamp_(-Fp8Codec._MAX, Fp8Codec._MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    @staticmethod
    def _from_e4m3(codes: torch.Tensor) -> torch.Tensor:
        return e4m3_as_half(codes).float().mul_(256.0)

    def encode(
        self, x: torch.Tensor, filled: torch.Tensor | None = None, full: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A full block's residual rows get searched scales (``SEARCH``); an open block's, re-encoded at every write
        until it fills, the plain one, so that a decode step does not pay the search on every layer's open block."""
        codes = self._mean(x, filled)
        residual = x.float() - self._from_e4m3(codes)
        if full is None and filled is not None:
            full = (filled.reshape(-1) == self.block_size).nonzero().squeeze(-1)
        if filled is None or len(full) == filled.numel():
            rows = self._final.encode(residual, self._weight(x))
        else:
            rows = self._rows.encode(residual)
            if len(full):
                lead = filled.dim()
                flat, whole = residual.view(-1, *residual.shape[lead:])[full], x.reshape(-1, *x.shape[lead:])[full]
                rows.view(-1, *rows.shape[lead:])[full] = self._final.encode(flat, self._weight(whole))
        return torch.cat([rows, self._spread_bytes(codes.squeeze(-3))], dim=-1)

    def _weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """What a channel's rounding error weighs in the search: its mean square over the block's keys, standing in
        for the queries' energy in that channel, which no write sees."""
        return x.float().square().mean(-3, keepdim=True) if self.weighted else None

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        means = self.block_means(rows).unsqueeze(-3)
        return self._rows.decode(rows[..., : self._own], torch.float32).add_(means).to(dtype)

    def block_means(self, rows: torch.Tensor) -> torch.Tensor:
        """Whole blocks' rows ``[..., bs, kvh, row]`` -> each block's mean key ``[..., kvh, D]`` (float32), what a
        reader that folds the mean into its scores (``q . mean`` once per block) needs."""
        return self._from_e4m3(self._gather_bytes(rows))

    def max_error(self, x: torch.Tensor, filled: torch.Tensor | None = None) -> torch.Tensor:
        """The fp8 rows' bound on the residual against the stored mean (exact as stored), plus float32 rounding."""
        residual = x.float() - self._from_e4m3(self._mean(x, filled))
        return self._final.max_error(residual) + x.float().abs() * 2**-22
