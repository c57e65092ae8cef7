"""Where a quantised pool's decode step spends its extra time: torch.profiler over the same steps at each dtype.

    python benchmarks/kv_dtype_profile.py --dtypes auto,int8,fp8,int4 --context 512 --batch 8 --steps 5

``--batch`` sequences of ``--context`` tokens (windows of README.md) decode under ``full`` (as
``benchmarks/kv_dtypes.py`` times them); after 20 steps to settle, ``--steps`` steps run under ``torch.profiler``
(CPU activities); an entry ``DTYPE@R`` runs with a float window of R tokens. Reported per dtype: the step's wall
time under the profiler, and the ``--top`` operators by self CPU time per step, with their calls per step; then, for
each operator, its time per step at each dtype minus at ``--base`` (``auto`` by default; the operators that account
for the difference, largest first). The profiler adds its own overhead to every
operator call, so the absolute times are above ``kv_dtypes.py``'s; the differences between dtypes are what it shows.
"""

from __future__ import annotations

import time

import torch
from common import load, parser, readme_windows, report, setup
from kv_dtypes import decoding_engine, split_entry
from torch.profiler import ProfilerActivity, profile


def profile_steps(args, loaded, dtype: str, prompts: list[list[int]]) -> tuple[float, dict[str, tuple[float, float]]]:
    """Wall ms per step under the profiler, and ``{op: (self CPU ms per step, calls per step)}``."""
    kv_dtype, window = split_entry(dtype)  # DTYPE@R: with a float window of R tokens
    engine = decoding_engine(args, loaded, kv_dtype, prompts, window)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = (time.perf_counter() - t0) / args.steps * 1000
    for i in range(args.batch):
        engine.abort_request(str(i))
    ops = {
        e.key: (e.self_cpu_time_total / 1000 / args.steps, e.count / args.steps)
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    }
    return wall, ops


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--dtypes", default="auto,int8,fp8,int4")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--base", default="auto", help="the entry the others are compared with (int4, for int4@32)")
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    prompts = readme_windows(loaded, args.context, args.batch)
    dtypes = args.dtypes.split(",")
    result: dict = {**env, "context": args.context, "batch": args.batch, "steps": args.steps}
    t_start = time.perf_counter()
    per: dict[str, dict[str, tuple[float, float]]] = {}
    with torch.inference_mode():
        for dtype in dtypes:
            wall, ops = profile_steps(args, loaded, dtype, prompts)
            per[dtype] = ops
            top = sorted(ops.items(), key=lambda kv: -kv[1][0])[: args.top]
            result[f"{dtype}_step_ms_profiled"] = round(wall, 1)
            result[f"{dtype}_top_ops"] = {k: f"{ms:.2f} ms, {calls:.0f} calls" for k, (ms, calls) in top}
    base = args.base
    if base in per:
        for dtype in dtypes:
            if dtype == base:
                continue
            names = set(per[dtype]) | set(per[base])
            diff = {n: per[dtype].get(n, (0.0, 0))[0] - per[base].get(n, (0.0, 0))[0] for n in names}
            largest = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]
            result[f"{dtype}_minus_{base}_ms"] = {k: round(v, 2) for k, v in largest}
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    report(args, result)


if __name__ == "__main__":
    main()
