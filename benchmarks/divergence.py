"""Where a free generation first leaves full's text, and what the step looked like there.

    python benchmarks/divergence.py --policy-file docs/bench/policies/dynamic-256-384-decayed-r75-d98.yaml \
        --items 8 --baselines snapkv,streaming
    python benchmarks/divergence.py --workload throughput --policy-file docs/bench/policies/dynamic-256-1024.yaml \
        --items 12

The standard suite scores free long generations by BLEU-4 against full's text, and one early divergence moves an
item by tens of points. For the variant and each fixed baseline (matched to the variant's mean resident KV, as the
suite matches them) this reports, per item, the first generated token that differs from full's, how many of the
tokens before it were resident when it was chosen (of the prompt plus the tokens so far), whether the policy had
expanded (recalled and recomputed) at that token, and the top-1/top-2 probability gap there under full and under the
policy. A divergence where nearly the whole context was resident and full's own gap was small is a near-tie that
any perturbation of the keys (evicting and recalling them, or another arithmetic order) can flip.
``--workload throughput`` runs the throughput suite's requests instead (its first ``--items``: prompts of
1,000-2,000 tokens of held-out documentation with a task, 64-256 tokens out), whose answers read a prompt that
no budget holds whole.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from common import load, longgen_evaluator, parser, report, setup, variant_args

from confkv.bench.memory import Usage, matched_budget
from confkv.bench.specs import baseline_policy
from confkv.bench.streams import ThroughputSpec, make_requests
from confkv.bench.textmetrics import rouge_l
from confkv.config import CachePolicy
from confkv.engine.params import SamplingParams
from confkv.engine.sequence import RequestOutput
from confkv.policy_source import load_policy


def first_divergence(full: RequestOutput, out: RequestOutput) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(full.token_ids, out.token_ids, strict=True)) if a != b), None)


def main() -> None:
    p = parser(__doc__)
    variant_args(p, items=8, split="heldout", baselines="snapkv,streaming")
    p.add_argument(
        "--workload", choices=("longgen", "throughput"), default="longgen",
        help="the standard suite's free long generations, or the throughput suite's requests (held-out)",
    )  # fmt: skip
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="tokens per engine step (default the engine's, 512): a prompt no longer than this is read in one chunk, "
        "so no part of it is computed over a trimmed context",
    )  # fmt: skip
    p.add_argument("--near-tie", type=float, default=0.05, help="full's gap below which a divergence is a near-tie")
    p.add_argument("--out", default=None, help="also write every row to this JSON file")
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    ev = longgen_evaluator(args, loaded)
    params: SamplingParams | list[SamplingParams]
    if args.workload == "throughput":
        if args.split != "heldout":
            raise SystemExit("--workload throughput has held-out requests only")
        requests = make_requests(loaded.tokenizer, ThroughputSpec(requests=args.items))
        prompts = [list(r.prompt_ids) for r in requests]
        params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    else:
        prompts = [list(it.prompt_ids) for it in ev.workloads.longgen]
        params = SamplingParams(max_tokens=ev.spec.free_tokens, ignore_eos=True)

    def run(policy: CachePolicy) -> list[RequestOutput]:
        step = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
        return ev.llm(policy, max_batch_size=len(prompts), **step).generate(prompts, params, use_tqdm=False)

    full = run(CachePolicy(controller="full"))
    variant = load_policy(args.policy_file)
    name = Path(args.policy_file).stem
    runs = {name: run(variant)}
    usage = Usage("decode")
    for o in runs[name]:
        usage.add_generated(o)
    budget = matched_budget([usage], usage.resident, variant)
    for b in args.baselines.split(","):
        runs[f"{b}@{budget}"] = run(baseline_policy(variant, b, budget))

    result: dict = {**env, "policy_file": args.policy_file, "workload": args.workload, "split": args.split,
                    "items": args.items, "max_num_batched_tokens": args.max_num_batched_tokens}  # fmt: skip

    def texts(outs: list[RequestOutput]) -> list[str]:
        return [loaded.tokenizer.decode(o.token_ids) for o in outs]

    rows = []
    for key, outs in runs.items():
        firsts, near_ties, whole, shares = [], 0, 0, []
        for i, (f, o) in enumerate(zip(full, outs, strict=True)):
            t = first_divergence(f, o)
            if t is None:
                continue
            context = len(f.prompt_token_ids) + t
            row = {"policy": key, "item": i, "token": t, "context": context, "resident": o.trace.resident[t],
                   "expanded": o.trace.expanded[t], "gap_full": round(f.trace.gap[t], 4),
                   "gap_policy": round(o.trace.gap[t], 4)}  # fmt: skip
            rows.append(row)
            firsts.append(t)
            near_ties += f.trace.gap[t] < args.near_tie
            whole += o.trace.resident[t] >= 0.95 * context
            shares.append(o.trace.resident[t] / context)
        result[f"{key}_first_divergence"] = " ".join(str(r["token"]) for r in rows if r["policy"] == key)
        result[f"{key}_first_divergence_median"] = statistics.median(firsts) if firsts else None
        result[f"{key}_first_divergence_of_length"] = " ".join(
            f"{r['token']}/{len(full[r['item']].token_ids)}" for r in rows if r["policy"] == key
        )
        result[f"{key}_diverged"] = f"{len(firsts)} / {len(prompts)}"
        result[f"{key}_rougeL_vs_full"] = round(rouge_l(texts(outs), texts(full)), 3)
        result[f"{key}_at_near_ties"] = f"{near_ties} / {len(firsts)}"
        result[f"{key}_with_95pct_resident"] = f"{whole} / {len(firsts)}"
        result[f"{key}_resident_share_median"] = round(statistics.median(shares), 3) if shares else None
    report(args, result)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
