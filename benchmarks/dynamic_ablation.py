"""What makes ``dynamic`` good or bad at equal memory: variants of the dynamic policy, each against the fixed
baselines re-matched to that variant's own mean resident memory, workload by workload.

    python benchmarks/dynamic_ablation.py --suite standard --items 2 --variants default,recency,tova
    python benchmarks/dynamic_ablation.py --list
    python benchmarks/dynamic_ablation.py --workloads multikey --items 12 --split train --variants "" \
        --policy-file docs/bench/policies/dynamic-256-384-decayed-r75-d98-reselect25-stale.yaml

Teacher-forced workloads (prose, long generation, chat) report the mean KL to the full cache per token; retrieval
(``--retrieval``: pass-key, multi-key) reports accuracy. For every (variant, workload) the baselines get the budget
whose predicted mean resident memory equals the variant's measured one (``confkv.bench.memory.matched_budget``), so
the table reads "at this memory, who loses less". The full-cache references are cached under ``$CONFKV_CACHE``.
A ``--policy-file`` variant gets baselines that take the file's other keys, as ``confkv bench`` matches them.
Multi-key retrieval may run more items than the suite's four (``--items``), since one answer is 25% there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from common import shrunk_spec, split_arg

from confkv.bench.evaluator import Evaluator
from confkv.bench.memory import matched_budget
from confkv.bench.specs import baseline_policy, scaled_dynamic, suite_spec
from confkv.config import CachePolicy
from confkv.policy_source import load_policy
from confkv.progress import bars

#: Each variant: policy keys changed from the requirement's dynamic defaults scaled to the suite.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "recency": {"scorer": "recency"},
    "snapkv": {"scorer": "snapkv"},
    "h2o": {"scorer": "h2o"},
    "tova": {"scorer": "tova"},
    "knorm": {"scorer": "knorm"},
    "no-expansion": {"scaling_factor": 1.0},
}
TEACHER_FORCED = ("prose", "longgen", "chat")
BASELINES = ("streaming", "h2o", "snapkv")


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` from VARIANTS, or ``name:key=value;key=value`` for an ad-hoc one (JSON values where they parse)."""
    name, _, rest = spec.partition(":")
    if not rest:
        return name, VARIANTS[name]
    changes: dict[str, Any] = {}
    for kv in rest.split(";"):
        key, _, value = kv.partition("=")
        try:
            changes[key] = json.loads(value)
        except json.JSONDecodeError:
            changes[key] = value
    return name, changes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--suite", default="standard")
    p.add_argument("--items", type=int, default=2, help="items per workload (the suite's first ones)")
    p.add_argument("--variants", default="default", help="comma-separated; NAME or NAME:key=value;key=value")
    p.add_argument("--workloads", default=",".join(TEACHER_FORCED))
    p.add_argument("--retrieval", action="store_true", help="also pass-key and multi-key accuracy")
    p.add_argument("--baselines", default=",".join(BASELINES))
    p.add_argument("--policy-file", action="append", default=[], help="also a dynamic policy (YAML) as a variant")
    split_arg(p)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--list", action="store_true")
    args = p.parse_args()
    if args.list:
        for name, changes in VARIANTS.items():
            print(f"{name}: {changes}")
        return
    spec = shrunk_spec(suite_spec(args.model, args.suite), args.items, TEACHER_FORCED)
    spec = dataclasses.replace(spec, multikey={**spec.multikey, "n": args.items})
    t0 = time.perf_counter()
    ev = Evaluator.prepare(args.model, spec, split=args.split, progress=bars())
    print(f"references ready ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    base = scaled_dynamic(spec.scale)
    workloads = [w for w in args.workloads.split(",") if w]
    if args.retrieval:
        workloads += ["passkey", "multikey"]
    rows = []
    variants = [(n, base.replace(**c), base) for n, c in map(parse_variant, filter(None, args.variants.split(",")))]
    variants += [(Path(f).stem, p, p) for f, p in ((f, load_policy(f)) for f in args.policy_file)]
    for name, policy, matched_from in variants:
        for workload in workloads:
            t1 = time.perf_counter()
            metrics, usage = measure(ev, policy, workload)
            row = {"variant": name, "workload": workload, "kv": usage.fraction_mean, **metrics, "baselines": {}}
            for b in (x for x in args.baselines.split(",") if x):
                budget = matched_budget([usage], usage.resident, matched_from)
                bm, busage = measure(ev, baseline_policy(matched_from, b, budget), workload)
                row["baselines"][b] = {"budget": budget, "kv": busage.fraction_mean, **bm}
            row["seconds"] = time.perf_counter() - t1
            rows.append(row)
            print(format_row(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "suite": args.suite, "items": args.items, "split": args.split,
                       "base": base.model_dump(mode="json"), "rows": rows}, f, indent=1)  # fmt: skip


def measure(ev: Evaluator, policy: CachePolicy, workload: str) -> tuple[dict[str, Any], Any]:
    if workload in TEACHER_FORCED:
        metrics, usage = ev.score_workload(policy, workload)
        out = {"kl": metrics["kl_mean"]}
        if "ppl_delta_rel" in metrics:
            out["ppl_delta"] = metrics["ppl_delta_rel"]
        return out, usage
    metrics, usage = ev.retrieve(policy, workload)
    return {"acc": metrics["acc"]}, usage


def format_row(row: dict[str, Any]) -> str:
    key = "kl" if "kl" in row else "acc"
    fmt = (lambda v: f"{v:.4f}") if key == "kl" else (lambda v: f"{100 * v:.0f}%")
    parts = [f"{row['variant']:>14} {row['workload']:>8} kv {100 * row['kv']:5.1f}% {key} {fmt(row[key])}"]
    for b, m in row["baselines"].items():
        parts.append(f"{b} {fmt(m[key])} ({100 * m['kv']:.1f}%)")
    return " | ".join(parts) + f"  [{row['seconds']:.0f}s]"


if __name__ == "__main__":
    main()
