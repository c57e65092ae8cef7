"""Which half of int4 costs what: K and V quantised apart, by fake quantisation in a float (``auto``) pool.

    python benchmarks/int4_ablation.py --modes token,kivi,konly,vonly

The quick suite's held-out prose, scored under ``full`` as ``benchmarks/kv_dtypes.py`` scores it, with the pool's
``store`` wrapped so that what it writes has been through int4 and back (the pool itself stays float, so only the
rounding differs from ``auto``). Modes: ``token``: keys and values per token (the int4 codec's rows: what
``kv_cache_dtype: int4`` did before keys per channel); ``kivi``: values per token, keys per channel over each full
block, an open block's keys left exact until it fills (KIVI's float tail); ``konly``: only the keys, as ``kivi``;
``vonly``: only the values, per token; ``vg32``: only the values, per token in groups of 32 channels;
``kivi_vg32``: ``kivi`` with values in groups of 32. This is a measurement aid, not the engine's path:
``kv_cache_dtype: int4`` itself is measured by ``benchmarks/kv_dtypes.py``.
"""

from __future__ import annotations

import time

import torch
from common import load, parser, report, setup
from kv_dtypes import perplexity

from confkv.bench.evaluator import build_workloads
from confkv.bench.specs import suite_spec
from confkv.kv.pool import BlockPool
from confkv.kv.quant import Int4Codec

_INT4 = Int4Codec()
_STORE = BlockPool.store


def _per_token(x: torch.Tensor) -> torch.Tensor:
    return _INT4.decode(_INT4.encode(x), x.dtype)


def _per_group(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Per token, in groups of ``group`` channels (one grid each)."""
    group = min(group, x.shape[-1])
    return _per_token(x.reshape(*x.shape[:-1], -1, group)).reshape(x.shape)


def _per_channel(x: torch.Tensor) -> torch.Tensor:
    """Keys of one block ``[block_size, kv_heads, D]``: a grid per channel over the block's tokens."""
    lo = x.amin(0, keepdim=True).half().float()
    s = ((x.amax(0, keepdim=True) - lo) / 15).half().float()
    return ((x - lo) / s.clamp_min(torch.finfo(torch.float32).tiny)).round().clamp(0, 15) * s + lo


def fake_store(mode: str):
    def store(pool: BlockPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if mode in ("token", "kivi", "vonly"):
            v = _per_token(v)
        if mode in ("vg32", "kivi_vg32"):
            v = _per_group(v)
        if mode == "token":
            k = _per_token(k)
        _STORE(pool, layer, slots, k, v)
        if mode in ("kivi", "konly", "kivi_vg32"):  # blocks whose last slot was just written: quantise their keys
            bs = pool.block_size
            for b in (slots[(slots % bs) == bs - 1] // bs).tolist():
                rows = slice(b * bs, (b + 1) * bs)
                pool.k[layer, rows] = _per_channel(pool.k[layer, rows].float()).to(pool.k.dtype)

    return store


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--modes", default="token,kivi,konly,vonly")
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    items = build_workloads(loaded.tokenizer, suite_spec(args.model, "quick"), "heldout", 0).prose
    t0 = time.perf_counter()
    base, n, _, _ = perplexity(args, loaded, "auto", items)
    result: dict = {**env, "ppl_tokens": n, "auto_ppl": base}
    try:
        for mode in args.modes.split(","):
            BlockPool.store = fake_store(mode)
            ppl, _, _, _ = perplexity(args, loaded, "auto", items)
            result[f"{mode}_ppl"] = ppl
            result[f"{mode}_ppl_delta_pct"] = 100 * (ppl / base - 1)
    finally:
        BlockPool.store = _STORE
    result["seconds"] = round(time.perf_counter() - t0, 1)
    report(args, result)


if __name__ == "__main__":
    main()
