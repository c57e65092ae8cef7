"""The quantised pool's decoders and int4 key write against an earlier version of the code: identical outputs, and
their time at smollm2's decode geometry (8 sequences of 33 blocks of 16 tokens, 3 KV heads, head_dim 64).

    git archive 47e3828 | tar -x -C /tmp/before
    python benchmarks/kv_decode_micro.py --before /tmp/before

Checks that every dtype's rows decode to the same values under both versions (and every byte of fp8, int4 and
int2), and that the int4 pool's bytes after a prefill of 40 tokens of 8 sequences and 40 decode steps are the same;
reports per-layer decode milliseconds (K and V) at fp8 and int4, and the key write's milliseconds per decode step
over 30 layers. Needs no model.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from types import ModuleType

import torch

from confkv.kv import quant as new
from confkv.kv.pool import BlockPool

KVH, D, BS, N, NB, LAYERS = 3, 64, 16, 8, 33, 30


def _module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ms(f, reps: int = 40) -> float:
    f()
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps * 1000


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def decoders(old: ModuleType) -> bool:
    x = torch.randn(N, NB, BS, KVH, D, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 30, D)
    ok = True
    for name in ("int8", "fp8", "int4"):
        fo, fn = old.KVFormat(name, D, BS, torch.float32), new.KVFormat(name, D, BS, torch.float32)
        kr, vr = fn.encode_k(x), fn.encode_v(x.reshape(N, -1, KVH, D))
        ok &= torch.equal(kr, fo.encode_k(x)) and torch.equal(vr, fo.encode_v(x.reshape(N, -1, KVH, D)))
        ok &= _same(fo.decode_k(kr), fn.decode_k(kr)) and _same(fo.decode_v(vr), fn.decode_v(vr))
        if name != "int8":
            k = (_ms(lambda f=fo, r=kr: f.decode_k(r)), _ms(lambda f=fn, r=kr: f.decode_k(r)))
            v = (_ms(lambda f=fo, r=vr: f.decode_v(r)), _ms(lambda f=fn, r=vr: f.decode_v(r)))
            print(f"{name} decode, ms per layer: K {k[0]:.3f} -> {k[1]:.3f}, V {v[0]:.3f} -> {v[1]:.3f}")
    every = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    for cls, grid in (
        ("Fp8Codec", [0x00, 0x3C]),
        ("Int4Codec", [0x00, 0x3C, 0x00, 0x3C]),
        ("Int2Codec", [0x00, 0x3C, 0x00, 0x3C]),
    ):
        rows = torch.cat([every, torch.tensor([grid] * 4, dtype=torch.uint8)], -1)  # scale 1.0 (and zero point 1.0)
        ok &= _same(getattr(old, cls)().decode(rows, torch.float32), getattr(new, cls)().decode(rows, torch.float32))
    return ok


def key_write(old_pool: ModuleType) -> bool:
    pools, times = {}, {}
    for label, cls in (("before", old_pool.BlockPool), ("after", BlockPool)):
        g = torch.Generator().manual_seed(1)
        pool = cls(num_layers=LAYERS, num_kv_heads=KVH, head_dim=D, block_size=BS, num_blocks=200,
                   dtype=torch.float32, device="cpu", kv_cache_dtype="int4")  # fmt: skip
        seqs = [pool.allocate(6) for _ in range(N)]
        slots = torch.cat([pool.slots_of(s)[:40] for s in seqs])
        for layer in range(LAYERS):
            pool.store(
                layer, slots, torch.randn(len(slots), KVH, D, generator=g), torch.randn(len(slots), KVH, D, generator=g)
            )
        t = time.perf_counter()
        for step in range(40, 80):
            slots = torch.stack([pool.slots_of(s)[step] for s in seqs])
            for layer in range(LAYERS):
                pool.store(layer, slots, torch.randn(N, KVH, D, generator=g), torch.randn(N, KVH, D, generator=g))
        times[label] = (time.perf_counter() - t) / 40 * 1000
        pools[label] = (pool, torch.cat([pool.slots_of(s) for s in seqs]))
    (a, used), (b, _) = pools["before"], pools["after"]  # the rest of each pool is torch.empty's garbage
    print(f"int4 store, ms per decode step (30 layers, 8 tokens): {times['before']:.2f} -> {times['after']:.2f}")
    return torch.equal(a.k[:, used], b.k[:, used]) and torch.equal(a.v[:, used], b.v[:, used])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, type=Path, help="a tree of the earlier code (its confkv/kv/*.py)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ok = decoders(_module(args.before / "confkv/kv/quant.py", "before_quant"))
    ok &= key_write(_module(args.before / "confkv/kv/pool.py", "before_pool"))
    print("identical" if ok else "DIFFERENT")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
