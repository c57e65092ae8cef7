"""Can a hand rule on the probe's feature beat every constant budget? The cheap check before training an agent.

    python benchmarks/trend_rule.py --workload passkey --items-scale 6 --quality-weights 2,4,6,8,12,16
    python benchmarks/trend_rule.py --workload passkey-varied --rules "entropy_max>0.2,gap_trend>0.51"

On the training and held-out items of a workload (``confkv-tune``'s episodes), measures once per item:

* fixed budgets (``--budgets``): the base policy's ``dynamic`` rule with ``base_size = max_size = B``, the
  constants a search over one budget can find;
* agents acting in the environment with the ``budget`` action (contract / hold / expand a fifth of the way between
  the base policy's ``base_size`` and ``max_size``, the range the probe compared) and observation layout 2:
  ``hold`` (the action's own constant), ``expand`` (always), and the trend rule (expand when the observed
  ``--feature`` exceeds a threshold, else contract), one per ``--thresholds`` value, or one per ``--rules`` entry
  (``feature>threshold``, any layout-2 entry: ``entropy_max>0.2`` expands after a segment holding a surprise, as
  the question of a pass key is); for each, a placebo that
  expands as often at random (the rule's rate without its timing); and schedules that contract until a position
  and expand from there (a timing fixed in advance, which a constant schedule could use as well).

The reward is linear in its weights, so each policy is run once and its reward is printed for every quality weight
of ``--quality-weights`` (memory weight 1 and task weight 1 as the defaults): which weight puts the best constant
inside the budget range, and whether the trend rule beats the best constant there. The threshold and the constant
are chosen on the training split; the held-out split judges them (paired margin, 95% bootstrap interval over
items). ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from confkv.controllers.observation import POSITION_SCALE, obs_names
from envs.constant import paired_margin
from envs.env import RewardWeights
from envs.episodes import build_episodes, scaled_sizes
from envs.evaluate import evaluate_agent, evaluate_policy

CONTRACT, HOLD, EXPAND = 0, 1, 2
POSITION = obs_names(2).index("position")
UNIT = RewardWeights(1.0, 1.0, 1.0)  # each term once: any weights' reward is a weighted sum of these


def trend_rule(feature: int, threshold: float):
    """Expand when observation entry ``feature`` exceeds ``threshold``, else contract (budget actions)."""
    return lambda obs: EXPAND if float(obs[feature]) > threshold else CONTRACT


class Counted:
    """A budget agent that counts its expand actions: the share a placebo is matched to."""

    def __init__(self, act: Callable[[np.ndarray], int]) -> None:
        self.act, self.expand, self.n = act, 0, 0

    def __call__(self, obs: np.ndarray) -> int:
        a = self.act(obs)
        self.expand += a == EXPAND
        self.n += 1
        return a

    @property
    def share(self) -> float:
        return self.expand / max(1, self.n)


def placebo(share: float, seed: int) -> Callable[[np.ndarray], int]:
    """Expand with probability ``share`` whatever is observed: the trend rule's rate without its timing."""
    rng = np.random.default_rng(seed)
    return lambda _obs: EXPAND if rng.random() < share else CONTRACT


def schedule(after: int) -> Callable[[np.ndarray], int]:
    """Contract before position ``after`` (tokens), expand from there: a timing fixed in advance."""
    return lambda obs: EXPAND if float(obs[POSITION]) * POSITION_SCALE >= after else CONTRACT


def reweigh(rows: list[dict[str, Any]], q: float) -> list[dict[str, Any]]:
    """Per-episode rows measured under ``UNIT`` with the reward recomputed for quality weight ``q``."""
    return [{**r, "reward": r["reward_memory"] + q * r["reward_kl"] + r.get("reward_task", 0.0)} for r in rows]


def mean_reward(rows: list[dict[str, Any]], q: float) -> float:
    return float(np.mean([r["reward"] for r in reweigh(rows, q)]))


def parse_rules(spec: str, names: tuple[str, ...]) -> list[tuple[str, int, float]]:
    """``--rules``: comma-separated ``feature>threshold`` (observation layout 2's entry names), as
    ``(label, entry index, threshold)``."""
    rules = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        feature, sep, threshold = part.partition(">")
        if not sep or feature not in names:
            raise SystemExit(f"--rules takes feature>threshold with a feature of {', '.join(names)} (got {part!r})")
        rules.append((f"{feature} > {float(threshold):g}", names.index(feature), float(threshold)))
    return rules


def measure(
    data: Any, budgets: list[int], rules: list[tuple[str, int, float]], schedules: list[int], seed: int
) -> dict[str, dict[str, Any]]:  # fmt: skip
    base = data.base_policy
    out: dict[str, dict[str, Any]] = {}
    for b in budgets:
        out[f"fixed {b}"] = evaluate_policy(data, base.replace(base_size=b, max_size=b), UNIT, label=f"fixed {b}")
    out["hold"] = evaluate_agent(data, lambda _obs: HOLD, "budget", UNIT)
    out["expand"] = evaluate_agent(data, lambda _obs: EXPAND, "budget", UNIT)
    for label, feature, t in rules:
        rule = Counted(trend_rule(feature, t))
        out[f"rule {label}"] = {**evaluate_agent(data, rule, "budget", UNIT), "expand_share": rule.share}
        out[f"placebo {rule.share:.2f} ({label})"] = evaluate_agent(data, placebo(rule.share, seed), "budget", UNIT)
    for after in schedules:
        out[f"expand from {after}"] = evaluate_agent(data, schedule(after), "budget", UNIT)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workload", default="passkey")
    p.add_argument("--items-scale", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budgets", default="128,192,256,320,384,448,512")
    p.add_argument("--feature", default="gap_trend", help="observation entry (layout 2) the rule reads")
    p.add_argument("--thresholds", default="0.5,0.51,0.52,0.54")
    p.add_argument("--rules", default=None, help="feature>threshold,... (any layout-2 entries; replaces "
                   "--feature and --thresholds)")  # fmt: skip
    p.add_argument("--schedules", default="400,550", help="positions from which a fixed schedule expands")
    p.add_argument("--quality-weights", default="2,4,6,8,12,16")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args()
    names = obs_names(2)
    if args.feature not in names:
        raise SystemExit(f"unknown feature {args.feature!r}; choose one of {', '.join(names)}")
    rules = parse_rules(args.rules or ",".join(f"{args.feature}>{t}" for t in args.thresholds.split(",")), names)
    budgets = [int(b) for b in args.budgets.split(",")]
    qs = [float(q) for q in args.quality_weights.split(",")]
    sizes = scaled_sizes(args.model, args.items_scale)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    loaded = None
    for split in ("train", "heldout"):
        data = build_episodes(args.model, workload=args.workload, split=split, seed=args.seed, sizes=sizes,
                              loaded=loaded)  # fmt: skip
        loaded = data.loaded
        data.obs_version = 2
        print(f"{split}: {len(data.episodes)} episodes, base policy base {data.base_policy.base_size} "
              f"max {data.base_policy.max_size}", flush=True)  # fmt: skip
        schedules = [int(a) for a in args.schedules.split(",") if a]
        results[split] = measure(data, budgets, rules, schedules, args.seed)
    report(results, qs)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))


def report(results: dict[str, dict[str, dict[str, Any]]], qs: list[float]) -> None:
    for split, by in results.items():
        print(f"\n## {split}: KV %, KL, pass keys %, memory and KL terms per episode, reward at quality weight q")
        print("| policy | KV % | KL | pass % | memory | KL term (q=1) | " + " | ".join(f"q={q:g}" for q in qs) + " |")
        for name, m in by.items():
            rows = m["per_episode"]
            mem = np.mean([r["reward_memory"] for r in rows])
            kl = np.mean([r["reward_kl"] for r in rows])
            acc = m["passkey_acc"]
            if "expand_share" in m:
                name = f"{name} (expands {100 * m['expand_share']:.0f}%)"
            print(f"| {name} | {100 * m['kv_fraction']:.1f} | {m['kl_mean']:.4f} | "
                  f"{'n/a' if acc is None else f'{100 * acc:.0f}'} | {mem:.3f} | {kl:.3f} | "
                  + " | ".join(f"{mean_reward(rows, q):.3f}" for q in qs) + " |")  # fmt: skip
    train, held = results["train"], results["heldout"]
    fixed = [n for n in train if n.startswith("fixed")]
    rules = [n for n in train if n.startswith("rule")]
    print("\n## chosen on the training split, judged on the held-out split (margin: mean per item, 95% CI)")
    for q in qs:
        best_c = max(fixed, key=lambda n: mean_reward(train[n]["per_episode"], q))
        best_r = max(rules, key=lambda n: mean_reward(train[n]["per_episode"], q))
        a, b = reweigh(held[best_r]["per_episode"], q), reweigh(held[best_c]["per_episode"], q)
        m = paired_margin(a, b)
        held_best = max(fixed, key=lambda n: mean_reward(held[n]["per_episode"], q))
        m2 = paired_margin(a, reweigh(held[held_best]["per_episode"], q))
        print(f"q={q:g}: best constant (train) {best_c}, rule (train) {best_r}; held-out {best_r} - {best_c}: "
              f"{m.text()}; against the held-out best constant {held_best}: {m2.text()}")  # fmt: skip
        for other in [n for n in held if n.startswith(("placebo", "expand from"))]:
            print(f"    held-out {best_r} - {other}: {paired_margin(a, reweigh(held[other]['per_episode'], q)).text()}")


if __name__ == "__main__":
    main()
