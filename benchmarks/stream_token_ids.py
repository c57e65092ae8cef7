"""The throughput suite's request stream, run per policy, its output token ids written to a file: the check that a
change to the engine leaves what it generates as it was.

    python benchmarks/stream_token_ids.py --out before.json                 # at the old commit
    python benchmarks/stream_token_ids.py --out after.json                  # at the new one
    python benchmarks/stream_token_ids.py --compare before.json after.json  # identical lists per policy

The stream, the pool and the policies are exactly the suite's (``confkv bench --suite throughput``, burst):
48 chat requests of 1,000-2,000 tokens, outputs of 64-256 with EOS ignored, ``full`` and ``dynamic`` by default.
Run one side per commit in a separate checkout (``git worktree add``), with ``PYTHONPATH`` set to that checkout.
Timings are printed for orientation only: they are not a benchmark unless the machine was otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from confkv.bench.stream_rows import stream_policies
from confkv.bench.streams import ThroughputSpec, make_requests, pool_bytes_for
from confkv.bench.throughput import run_engine_stream
from confkv.llm import LLM
from confkv.model_loader import load_model


def dump(model: str, policies: list[str], out: str) -> None:
    spec = ThroughputSpec()
    loaded = load_model(model, seed=0)
    chosen = stream_policies(policies, [], spec)
    pool = pool_bytes_for(loaded, spec, chosen[0][1].block_size)
    requests = make_requests(loaded.tokenizer, spec, 0)
    ids: dict[str, list[list[int]]] = {}
    for name, policy in chosen:
        t0 = time.perf_counter()
        llm = LLM(model, policy, loaded=loaded, kv_cache_memory=pool, max_batch_size=spec.max_batch_size,
                  max_num_batched_tokens=spec.max_num_batched_tokens, seed=0)  # fmt: skip
        ids[name] = run_engine_stream(llm, requests).token_ids
        print(f"{name}: {len(ids[name])} requests, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    with open(out, "w") as f:
        json.dump(ids, f)


def compare(a: str, b: str) -> int:
    with open(a) as fa, open(b) as fb:
        left, right = json.load(fa), json.load(fb)
    differ = 0
    for name in sorted(set(left) | set(right)):
        if name not in left or name not in right:
            print(f"{name}: only in {'the first' if name in left else 'the second'} file")
            differ += 1
            continue
        same = sum(x == y for x, y in zip(left[name], right[name], strict=False))
        tokens = sum(len(x) for x in left[name])
        print(f"{name}: {same} of {len(left[name])} requests identical ({tokens} tokens)")
        differ += same != len(left[name]) or len(left[name]) != len(right[name])
    return 1 if differ else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policies", default="full,dynamic", help="comma-separated built-in policies")
    p.add_argument("--out", help="write the token ids here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two files instead of running")
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("give --out FILE or --compare A B")
    dump(args.model, [s.strip() for s in args.policies.split(",") if s.strip()], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
