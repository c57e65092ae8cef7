"""Pass-key retrieval under each policy: does confidence-triggered recall bring the key back?

    python benchmarks/passkey_recall.py --length 2000 --depths 0.1,0.15,0.2 --seeds 11,12

Prompts of about ``--length`` tokens hide a 5-digit key in the first fifth of a repeated-filler haystack. The
``dynamic`` runs use a small base (256 tokens, 128 recent, max 2048); ``window`` and ``streaming`` get a budget
equal to the mean resident KV of the ``dynamic`` recency run, rounded up to a block.
"""

from __future__ import annotations

import math

from common import load, parser, report, setup

from confkv import LLM, SamplingParams
from confkv.bench.passkey import passkey_item


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--length", type=int, default=2000)
    p.add_argument("--depths", default="0.1,0.15,0.2")
    p.add_argument("--seeds", default="11,12")
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    llm = LLM(args.model, "full", loaded=loaded, device=args.device)
    items = [
        passkey_item(llm.tokenizer, args.length, float(d), int(s))
        for d in args.depths.split(",")
        for s in args.seeds.split(",")
    ]
    small = dict(base_size=256, min_recent=128, max_size=2048)

    def run(name: str, **policy: object) -> tuple[float, float, float, int]:
        llm.engine.set_policy(llm.policy.replace(**{"controller": name, **small, **policy}))
        outs = llm.generate([it.prompt for it in items], SamplingParams(max_tokens=8))
        acc = sum(it.correct(o.text) for it, o in zip(items, outs, strict=True)) / len(items)
        resident = sum(o.kv["mean_resident_tokens"] for o in outs) / len(outs)
        full = sum(o.kv["full_tokens"] for o in outs) / len(outs)
        return acc, resident, resident / full, sum(o.kv["recalled_blocks"] for o in outs)

    result: dict = {**env, "items": len(items), "mean_prompt_tokens": sum(i.num_tokens for i in items) / len(items)}
    runs = {
        "full": run("full"),
        "dynamic (snapkv scorer, the default)": run("dynamic"),
        "dynamic (h2o scorer)": run("dynamic", scorer="h2o"),
        "dynamic (recency scorer)": run("dynamic", scorer="recency"),
        "dynamic (recency, scaling 1.0: no expansion)": run("dynamic", scorer="recency", scaling_factor=1.0),
    }
    budget = int(math.ceil(runs["dynamic (recency scorer)"][1] / 16) * 16)
    result["baseline_budget_tokens"] = budget
    for name in ("window", "streaming", "h2o", "snapkv"):
        runs[f"{name} (max_size {budget})"] = run(name, max_size=budget, base_size=budget, min_recent=budget // 2)
    for name, (acc, resident, frac, recalled) in runs.items():
        result[name] = f"acc {100 * acc:.0f}%  resident {resident:.0f} tok ({100 * frac:.0f}%)  recalled {recalled}"
    report(args, result)


if __name__ == "__main__":
    main()
