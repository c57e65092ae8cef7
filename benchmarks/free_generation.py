"""Free long generation at equal memory over more items than the standard suite's four.

    python benchmarks/free_generation.py --policy-file docs/bench/policies/dynamic-256-384-decayed-r75-d98.yaml \
        --items 12 --split train --baselines snapkv,h2o,streaming

The standard suite decides its "long gen (free)" row on four answers of 1,024 tokens, scored by BLEU-4 against
full's text. Once a generation leaves full's text, everything after it differs, so one early divergence moves an
item's score by tens of points and four items cannot tell two policies apart (the same fixed ``h2o`` gave 57.5 and
41.4 at budgets of 275 and 269 tokens). This runs the suite's own measure (``Evaluator.generate_long``: the same
prompts, greedy, EOS ignored) on ``--items`` answers, matches each fixed baseline to the variant's measured mean
resident KV as the suite does, and reports corpus BLEU-4 and ROUGE-L with each item's BLEU-4, and on how many items
the variant is ahead of each baseline. ``--split train`` uses prompts no policy in ``docs/bench/policies`` was chosen
on (they were chosen on the held-out teacher-forced items).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from common import load, longgen_evaluator, parser, report, setup, variant_args

from confkv.bench.memory import matched_budget
from confkv.bench.specs import baseline_policy
from confkv.bench.textmetrics import bleu4
from confkv.config import CachePolicy
from confkv.policy_source import load_policy


def main() -> None:
    p = parser(__doc__)
    variant_args(p, items=12, split="train", baselines="snapkv,h2o,streaming")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default: the standard suite's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write every number, and the texts, to this JSON file")
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    ev = longgen_evaluator(args, loaded, args.max_tokens, args.seed)
    variant = load_policy(args.policy_file)
    name = Path(args.policy_file).stem

    t0 = time.perf_counter()
    full, _ = ev.generate_long(CachePolicy(controller="full"), None)
    refs = full["texts"]
    runs: dict[str, tuple[dict, float]] = {}
    out, usage = ev.generate_long(variant, refs)
    runs[name] = (out, usage.fraction_mean or 0.0)
    budget = matched_budget([usage], usage.resident, variant)
    for b in args.baselines.split(","):
        out_b, usage_b = ev.generate_long(baseline_policy(variant, b, budget), refs)
        runs[f"{b}@{budget}"] = (out_b, usage_b.fraction_mean or 0.0)

    result: dict = {**env, "policy_file": args.policy_file, "split": args.split, "items": args.items,
                    "tokens_per_answer": ev.spec.free_tokens,
                    "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    per_item = {k: [bleu4([t], [r]) for t, r in zip(o["texts"], refs, strict=True)] for k, (o, _) in runs.items()}
    for key, (o, kv) in runs.items():
        result[f"{key}_kv_fraction"] = round(kv, 4)
        result[f"{key}_bleu4"] = round(o["bleu4_vs_full"], 1)
        result[f"{key}_rougeL"] = round(o["rougeL_vs_full"], 3)
        result[f"{key}_bleu4_items"] = " ".join(f"{x:.0f}" for x in per_item[key])
    for key in list(runs)[1:]:
        ahead = sum(a > b for a, b in zip(per_item[name], per_item[key], strict=True))
        behind = sum(a < b for a, b in zip(per_item[name], per_item[key], strict=True))
        result[f"{name}_vs_{key}_items_ahead_behind"] = f"{ahead} / {behind}"
    report(args, result)
    if args.out:
        texts = {k: o["texts"] for k, (o, _) in runs.items()} | {"full": refs}
        Path(args.out).write_text(json.dumps({**result, "texts": texts}, indent=1))


if __name__ == "__main__":
    main()
