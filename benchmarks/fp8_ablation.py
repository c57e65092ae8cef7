"""Where fp8's perplexity cost comes from: keys or values, the scale or the mantissa. Fake quantisation in a float pool.

    python benchmarks/fp8_ablation.py --modes fp8,fp8_k,fp8_v,m3,m4,m5,int8

Issue 35 asks ``fp8`` to stay within +0.2% of ``auto``'s perplexity; without a float window it measures about +0.4%.
This script asks whether another scale or a rotation could get there, on the quick suite's held-out prose scored
under ``full`` as ``benchmarks/kv_dtypes.py`` scores it, with the pool's ``store`` wrapped so that what it writes has
been rounded and restored (the pool stays float, so only the rounding differs from ``auto``; unlike the engine's fp8
pool, a prompt's first chunk also attends to rounded keys, so the costs here are somewhat larger). Modes:

* ``fp8``: keys and values through ``Fp8Codec`` (e4m3, a scale per token and KV head that maps the row's largest
  magnitude to 448 exactly: the engine's fp8 values, and its keys before they kept their block's mean);
  ``fp8_k`` / ``fp8_v``: only one half (the other exact).
* ``mN``: both rounded to N mantissa bits with an unbounded exponent (round to nearest even): a float format of N
  mantissa bits with no range limits and no scale (``m3`` is e4m3 without its range).
* ``int8``, ``int4``: the engine's per-token codecs (``int4`` here without keys per channel).
* A suffix ``_rot`` rounds the keys in a Hadamard-rotated basis of the head dimension and rotates them back
  (QuaRot's remedy for outlier channels; values as without it).
* ``fp8_kmean`` / ``fp8_kmid``: keys less a per-channel offset over their block's written rows (the mean, as the
  engine's ``Fp8KeyCodec`` now stores fp8 keys, or the midrange; float16), then fp8 per token, the offset added
  back; values fp8. An open block is re-rounded from its exact keys at every write, as the pool re-encodes an open
  block of block-coded keys. The offset is kept in float16 and added back, so only the residual's rounding reaches
  ``q . k`` (SageAttention's smoothing of K, 2024, subtracts one mean over all keys, which softmax does not see;
  here one per block, so a block stays self-contained).
* ``fp8_kmean_sN`` / ``fp8_kmean_wN``: the engine's keys with N scales tried per residual row of a full block
  (``Fp8KeyCodec(search=N)``), the row's squared error plain (``s``) or each channel's weighed by its mean square
  over the block (``w``); ``fp8_kmean_w4`` is the engine's own (``fp8_kmean``), ``fp8_kmean_s1`` its keys before
  the search (the plain scale).
* ``fp8_kmean_gG``: the engine's keys (the block's mean in e4m3) with the mean taken over each run of G rows of a
  block instead of all 16 (4 more bytes a key row for every halving); values fp8.

``--jitter N`` adds N draws of each mode with the store's inputs perturbed (``kv_dtypes.py --jitter``).

``--suite standard`` scores the standard suite's 3,000-token held-out texts instead of the quick suite's (give it
``--kv-cache-memory 1GiB``).

A measurement aid, not the engine's path: ``benchmarks/kv_dtypes.py`` measures ``kv_cache_dtype`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from common import parser
from int4_ablation import block_round, reencoding_store, run_ablation
from kv_dtypes import jitter_args

from confkv.kv.block_keys import Fp8KeyCodec
from confkv.kv.pool import BlockPool
from confkv.kv.quant import Fp8Codec, Int4Codec, Int8Codec, KVCodec

_STORE = BlockPool.store


def mantissa_round(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded to ``bits`` mantissa bits (plus the implicit one), exponent unbounded."""
    m, e = torch.frexp(x.float())  # m in [0.5, 1): its first bit is the implicit one
    step = float(2 ** (bits + 1))
    return torch.ldexp(torch.round(m * step) / step, e).to(x.dtype)


def _codec_round(codec: KVCodec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x), x.dtype)


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order ``n`` (a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def rotated(f):
    """``f`` applied in a Hadamard-rotated basis of the head dimension: an outlier channel's size is spread over
    every channel, so no single coordinate carries most of ``q . k`` (QuaRot, 2024); orthonormal, so exact back."""

    def g(x: torch.Tensor) -> torch.Tensor:
        h = hadamard(x.shape[-1]).to(x.dtype)
        return f(x @ h) @ h.T

    return g


def rounder(mode: str):
    """The function applied to K and V (``None``: left exact) for ``mode``."""
    if mode.startswith("m") and mode[1:].isdigit():
        bits = int(mode[1:])
        f = lambda x: mantissa_round(x, bits)  # noqa: E731
        return f, f
    rot = mode.endswith("_rot")
    base = mode.removesuffix("_rot")
    codecs = {"fp8": Fp8Codec(), "fp8_k": Fp8Codec(), "fp8_v": Fp8Codec(), "int8": Int8Codec(), "int4": Int4Codec()}
    if base not in codecs:
        raise SystemExit(f"unknown mode {mode!r}: fp8, fp8_k, fp8_v, int8, int4 (each optionally _rot) or mN")
    f = lambda x, c=codecs[base]: _codec_round(c, x)  # noqa: E731
    fk = rotated(f) if rot else f
    return (None if base == "fp8_v" else fk), (None if base == "fp8_k" else f)


def offset_store(how: str):
    """Keys less a per-channel offset of their block (``how``: ``mean``, the engine's ``Fp8KeyCodec``, or ``mid``,
    the midrange over the written rows), rounded through fp8 and the offset added back, re-rounded whole at each
    write as the pool does; values through fp8 per token."""
    values = Fp8Codec()

    def mid(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        real = (torch.arange(x.shape[1])[None, :] < n[:, None])[..., None, None]
        hi = x.masked_fill(~real, float("-inf")).amax(1, keepdim=True)
        lo = x.masked_fill(~real, float("inf")).amin(1, keepdim=True)
        off = ((hi + lo) / 2).half().float()
        return _codec_round(values, x - off) + off

    return reencoding_store(block_round(Fp8KeyCodec) if how == "mean" else mid, partial(_codec_round, values))


def group_mean_keys(group: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``round_keys`` for ``reencoding_store``: each run of ``group`` rows of a block (``group`` divides the block)
    through the engine's ``Fp8KeyCodec`` as if it were a block of its own, so the mean is taken over fewer tokens."""
    whole = block_round(Fp8KeyCodec)

    def round_keys(x: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
        nb, bs = x.shape[:2]
        starts = torch.arange(0, bs, group)
        part = (filled[:, None] - starts[None, :]).clamp(0, group).reshape(-1)
        return whole(x.reshape(nb * (bs // group), group, *x.shape[2:]), part).view_as(x)

    return round_keys


def fake_store(mode: str):
    if mode.startswith(("fp8_kmean_s", "fp8_kmean_w")):
        n = int(mode.removeprefix("fp8_kmean_")[1:])
        codec = partial(Fp8KeyCodec, search=n, weighted=mode.startswith("fp8_kmean_w"))
        return reencoding_store(block_round(codec), partial(_codec_round, Fp8Codec()))
    if mode in ("fp8_kmid", "fp8_kmean"):
        return offset_store(mode.removeprefix("fp8_k"))
    if mode.startswith("fp8_kmean_g"):
        keys = group_mean_keys(int(mode.removeprefix("fp8_kmean_g")))
        return reencoding_store(keys, partial(_codec_round, Fp8Codec()))
    round_k, round_v = rounder(mode)

    def store(pool: BlockPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        _STORE(pool, layer, slots, round_k(k) if round_k else k, round_v(v) if round_v else v)

    return store


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--modes", default="fp8,fp8_k,fp8_v,m3,m4,m5,int8")
    p.add_argument("--suite", choices=("quick", "standard"), default="quick", help="whose held-out prose")
    p.add_argument("--kv-cache-memory", default="64MiB", help="each scoring engine's pool (standard suite: 1GiB)")
    jitter_args(p)
    args = p.parse_args()
    run_ablation(args, [(mode, partial(fake_store, mode), False) for mode in filter(None, args.modes.split(","))])


if __name__ == "__main__":
    main()
