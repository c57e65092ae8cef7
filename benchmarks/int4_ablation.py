"""Which half of int4 costs what: K and V quantised apart, by fake quantisation in a float (``auto``) pool.

    python benchmarks/int4_ablation.py --modes token,kivi,konly,vonly

The quick suite's held-out prose, scored under ``full`` as ``benchmarks/kv_dtypes.py`` scores it, with the pool's
``store`` wrapped so that what it writes has been through int4 and back (the pool itself stays float, so only the
rounding differs from ``auto``). Modes: ``token``: keys and values per token (the int4 codec's rows: what
``kv_cache_dtype: int4`` did before keys per channel); ``kivi``: values per token, keys per channel over each full
block, an open block's keys left exact until it fills (KIVI's float tail); ``konly``: only the keys, as ``kivi``;
``vonly``: only the values, per token; ``vg32``: only the values, per token in groups of 32 channels;
``kivi_vg32``: ``kivi`` with values in groups of 32; ``engine_vgG``: the engine's int4 keys (per channel of a
block, an open block re-encoded from its exact keys at every write, as the pool does) with values per token in
groups of G channels (``engine_vg32`` is ``kv_cache_dtype: int4``; ``engine_vg0`` leaves the values exact;
``--suite standard --kv-cache-memory 1GiB`` for the 3,000-token texts); other int4 keys than the engine's, values
exact unless ``_vgV`` follows: ``engine_kgG`` keys per channel over each G tokens of a block instead of all 16 (no
channel at 8 bits), ``engine_ktK`` the K channels of a block with the most energy at 8 bits (KVQuant's and MiKV's
outlier channels kept finer; the engine keeps a quarter of them, 16 at head_dim 64; ``engine_kt0`` and
``engine_kg16`` are its keys before, every channel at 4 bits). This is a measurement aid, not the engine's
path: ``kv_cache_dtype: int4`` itself is measured by ``benchmarks/kv_dtypes.py``.

``--windows 0,16,32,64``: a float window of the last R tokens (HF ``QuantizedCache``'s and KIVI's residual length):
keys per channel of a block and values per token in groups of 32 (the engine's int4), but a block is rounded only
once R tokens have been written after it, so the open block and the R tokens before it stay exact (R = 0: only the
open block). Each item is scored alone (the window follows one sequence's writes) and the NLL pooled over items.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial

import torch
from common import load, parser, report, setup
from kv_dtypes import draw_summary, jitter_args, jittered, perplexity

from confkv.bench.evaluator import build_workloads
from confkv.bench.specs import suite_spec
from confkv.kv.block_keys import BlockKeyCodec, ChannelKeyCodec
from confkv.kv.kv_format import KVFormat
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
    if mode.startswith("engine_vg"):
        return engine_store(int(mode.removeprefix("engine_vg")))
    if mode.startswith(("engine_kg", "engine_kt")):
        return finer_key_store(mode)

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


def window_store(window: int):
    """Round a block's keys (per channel) and values (groups of 32) once ``window`` tokens follow it; one
    sequence at a time (the pool allocates its blocks in order, so full blocks are rounded oldest first)."""
    full: dict[int, list[int]] = {}

    def store(pool: BlockPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        _STORE(pool, layer, slots, k, v)
        bs = pool.block_size
        queue = full.setdefault(layer, [])
        queue.extend((slots[(slots % bs) == bs - 1] // bs).tolist())
        while len(queue) > window // bs:
            rows = slice(queue[0] * bs, (queue.pop(0) + 1) * bs)
            pool.k[layer, rows] = _per_channel(pool.k[layer, rows].float()).to(pool.k.dtype)
            pool.v[layer, rows] = _per_group(pool.v[layer, rows].float()).to(pool.v.dtype)

    return store


def reencoding_store(round_keys: Callable, round_values: Callable):
    """A store that rounds as the pool does for keys coded a block at a time: it keeps the exact keys of every block
    it wrote, and at each write re-rounds every touched block whole from them (``round_keys(x, filled)``, ``x`` the
    blocks ``[nb, bs, kvh, D]``, ``filled`` their written rows ``[nb]``), so an open block is rounded over its written
    rows and nothing compounds; values through ``round_values`` per token. One engine's pool at a time."""
    shadows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def store(pool: BlockPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        bs = pool.block_size
        if id(pool) not in shadows:
            shadows.clear()  # an older pool's copies are no longer read
            shadows[id(pool)] = (
                torch.zeros(pool.k.shape, dtype=torch.float32),
                torch.zeros((pool.num_layers, pool.num_blocks), dtype=torch.long),
            )
        exact, filled = shadows[id(pool)]
        exact[layer].index_copy_(0, slots, k.float())
        blocks = torch.unique(slots // bs)
        for b in blocks.tolist():
            offsets = slots[slots // bs == b] % bs
            first, last = int(offsets.min()), int(offsets.max()) + 1
            filled[layer, b] = last if first == 0 else max(int(filled[layer, b]), last)
        x = exact[layer].view(pool.num_blocks, bs, *exact.shape[2:])[blocks]  # [nb, bs, kvh, D]
        by_block = pool.k[layer].view(pool.num_blocks, bs, *pool.k.shape[2:])
        by_block.index_copy_(0, blocks, round_keys(x, filled[layer, blocks]).to(pool.k.dtype))
        pool.v[layer].index_copy_(0, slots, round_values(v.float()).to(pool.v.dtype))

    return store


#: A ``round_keys`` for ``reencoding_store``: blocks ``[nb, bs, kvh, D]`` and their filled rows -> rounded keys.
RoundKeys = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def block_round(codec_type: Callable[[int, int], BlockKeyCodec]) -> RoundKeys:
    """``round_keys`` for ``reencoding_store``: blocks through an engine block-key codec (``codec_type(head_dim,
    block_size)``) and back."""

    def round_keys(x: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
        codec = codec_type(x.shape[-1], x.shape[1])
        return codec.decode(codec.encode(x, filled), torch.float32)

    return round_keys


def pool_int4_keys(head_dim: int, block_size: int) -> BlockKeyCodec:
    """The int4 pool's key codec (``KVFormat("int4")``: per channel of a block, a quarter of its channels at 8 bits)."""
    codec = KVFormat("int4", head_dim, block_size, torch.float32).k_codec
    assert isinstance(codec, BlockKeyCodec)
    return codec


def engine_store(group: int):
    """The engine's int4 (keys per channel of a block, re-encoded as it fills) with values in groups of ``group``
    (0: values exact, the keys' share alone)."""
    return reencoding_store(block_round(pool_int4_keys), _round_values(group))


def _round_values(group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Values per token in groups of ``group`` channels, or exact (0)."""
    return partial(_per_group, group=group) if group else (lambda v: v)


def token_group_round(group: int) -> RoundKeys:
    """``round_keys``: the engine's int4 keys per channel, but over each run of ``group`` tokens of a block instead
    of its whole ``block_size`` (a grid per channel and group: ``4 * head_dim / group`` bytes a row)."""

    def round_keys(x: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
        nb, bs, kvh, d = x.shape
        codec = ChannelKeyCodec(d, group)
        starts = torch.arange(0, bs, group, device=x.device)
        sub = (filled[:, None] - starts).clamp(0, group).reshape(-1)
        groups = x.reshape(nb * bs // group, group, kvh, d)
        return codec.decode(codec.encode(groups, sub), torch.float32).reshape(x.shape)

    return round_keys


def outlier_channel_round(top: int) -> RoundKeys:
    """``round_keys``: keys per channel of a block, each block's ``top`` channels (per KV head) of most energy over
    its written rows at 8 bits (``ChannelKeyCodec(outliers=top)``; the pool's int4 takes a quarter of head_dim)."""
    return block_round(lambda head_dim, block_size: ChannelKeyCodec(head_dim, block_size, outliers=top))


def finer_key_store(mode: str):
    """``engine_kgG[_vgV]``: keys per channel over groups of G tokens (``token_group_round``); ``engine_ktK[_vgV]``:
    the K most energetic channels of a block at 8 bits (``outlier_channel_round``); values exact, or per token in
    groups of V channels."""
    keys, _, values = mode.removeprefix("engine_").partition("_vg")
    n = int(keys[2:])
    round_keys = token_group_round(n) if keys.startswith("kg") else outlier_channel_round(n)
    return reencoding_store(round_keys, _round_values(int(values or 0)))


def pooled(args, loaded, items) -> float:
    """Perplexity over all items' tokens, each item scored by its own engine."""
    nll = n = 0.0
    for item in items:
        ppl, count, _, _ = perplexity(args, loaded, "auto", [item])
        nll += math.log(ppl) * count
        n += count
    return math.exp(nll / n)


def run_ablation(args, entries: list[tuple[str, Callable[[], Callable], bool]]) -> None:
    """Perplexity of ``full`` on the quick suite's held-out prose at ``auto``, then once per entry ``(name, make a
    store, pooled)`` with ``BlockPool.store`` replaced by that store (``pooled``: each item by its own engine, for
    stores that follow one sequence); reports ``NAME_ppl`` and ``NAME_ppl_delta_pct``; with ``args.jitter`` N, N
    more draws with the store's inputs perturbed as ``kv_dtypes.py --jitter`` perturbs the pool's
    (``kv_dtypes.draw_summary``). Shared by the fake quantisation scripts (``fp8_ablation.py`` too)."""
    device, env = setup(args)
    loaded = load(args, device)
    suite = getattr(args, "suite", "quick")
    items = build_workloads(loaded.tokenizer, suite_spec(args.model, suite), "heldout", 0).prose
    t0 = time.perf_counter()
    base, n, _, _ = perplexity(args, loaded, "auto", items)
    result: dict = {**env, "suite": suite, "ppl_tokens": n, "auto_ppl": base}
    try:
        for name, make_store, alone in entries:
            draws = []
            for seed in range(getattr(args, "jitter", 0) + 1):
                store = make_store()
                BlockPool.store = jittered(store, seed, args.jitter_scale) if seed else store
                draws.append(pooled(args, loaded, items) if alone else perplexity(args, loaded, "auto", items)[0])
            result[f"{name}_ppl"] = draws[0]
            result[f"{name}_ppl_delta_pct"] = 100 * (draws[0] / base - 1)
            if len(draws) > 1:
                result.update(draw_summary(name, [100 * (ppl / base - 1) for ppl in draws[1:]]))
    finally:
        BlockPool.store = _STORE
    result["seconds"] = round(time.perf_counter() - t0, 1)
    report(args, result)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--modes", default="token,kivi,konly,vonly")
    p.add_argument("--windows", default="", help="float windows R (tokens, multiples of the block) to measure")
    p.add_argument("--suite", choices=("quick", "standard"), default="quick", help="whose held-out prose")
    p.add_argument("--kv-cache-memory", default="64MiB", help="each scoring engine's pool (standard suite: 1GiB)")
    jitter_args(p)
    args = p.parse_args()
    modes = [(mode, partial(fake_store, mode), False) for mode in filter(None, args.modes.split(","))]
    windows = [(f"window{w}", partial(window_store, int(w)), True) for w in filter(None, args.windows.split(","))]
    run_ablation(args, modes + windows)


if __name__ == "__main__":
    main()
