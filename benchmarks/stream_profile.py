"""Where a policy's decode step goes on the long-generation stream: cProfile over the throughput suite's own loop
(``run_engine_stream``), one policy after another, at the headline's operating point (issue 34).

    python benchmarks/stream_profile.py --policies h2o@144 \
        --policy-file docs/bench/policies/dynamic-128-512-decayed-r75-d98-per-token-stale.yaml

The first ``--requests`` of the CPU long-generation stream, each cut to ``--max-tokens`` tokens (a short profile),
in the pool of ``--full-fits`` copies of the stream's longest request with ``--max-batch-size``. Per policy: steps,
profiled ms per step and mean running, then the functions by own time and by cumulative time. cProfile slows
Python-heavy code more than the kernels, so compare policies with each other, not with unprofiled runs.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import sys
import time

from confkv import LLM
from confkv.bench.stream_rows import stream_policies
from confkv.bench.streams import LONGGEN_CPU, make_longgen_requests, pool_bytes_for
from confkv.bench.throughput import run_engine_stream
from confkv.model_loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policies", default="h2o@144", help="built-in policies at the stream's sizes (comma-separated)")
    ap.add_argument("--policy-file", action="append", default=[], help="also a YAML policy")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens each request generates")
    ap.add_argument("--full-fits", type=int, default=LONGGEN_CPU.full_fits)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--top", type=int, default=18, help="functions listed per ordering")
    args = ap.parse_args()
    if min(args.requests, args.max_tokens, args.full_fits, args.max_batch_size, args.top) < 1:
        raise SystemExit("--requests, --max-tokens, --full-fits, --max-batch-size and --top take positive numbers")
    stream = dataclasses.replace(LONGGEN_CPU, full_fits=args.full_fits, max_batch_size=args.max_batch_size)
    spec = dataclasses.replace(stream, requests=args.requests, max_tokens=args.max_tokens)
    loaded = load_model(args.model, device="cpu")
    requests = make_longgen_requests(loaded.tokenizer, spec)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    pool = pool_bytes_for(loaded, stream, 16)  # the pool of the whole stream, not of the cut requests
    for name, policy in stream_policies(names, args.policy_file, spec):
        if name == "full" and "full" not in names:
            continue  # the quality reference stream_policies adds
        llm = LLM(args.model, policy, loaded=loaded, kv_cache_memory=pool, max_batch_size=spec.max_batch_size,
                  max_num_batched_tokens=spec.max_num_batched_tokens)  # fmt: skip
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        result = run_engine_stream(llm, requests)
        prof.disable()
        steps = len(result.running)
        print(f"== {name}: {steps} steps, {time.perf_counter() - t0:.1f} s, "
              f"{1000 * result.metrics['makespan_s'] / steps:.1f} ms/step (profiled), mean running "
              f"{result.metrics['mean_running']:.1f}", flush=True)  # fmt: skip
        stats = pstats.Stats(prof, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top + 7)


if __name__ == "__main__":
    main()
