"""What expanding rather than contracting is worth at each decision: the advantages a budget agent learns from.

    python benchmarks/action_advantage.py --workload passkey-varied --items 0,1,2,3,4,5 --quality-weight 6

A PPO agent that collapses to one action faces advantages it cannot use, or advantages that favour that action.
This measures them in the training environment (``envs.env``, the path ``confkv-tune train`` steps): every item is
played by a behaviour rule (default: expand when the latest segment's maximum entropy exceeds 0.2, else contract,
the hand rule of TUNING.md), and for every decision ``k`` twice more, identical up to ``k``, with the action at ``k``
forced to *contract* and to *expand* and the rule again after it. Per decision, expand minus contract:

* the **immediate** reward difference (the segment the action governs, plus the answer's task reward on the last
  step): what PPO's advantage sees at ``--gamma 0``;
* the **discounted return** difference at gamma 0.5 and 1 (every later segment, under the rule): what a farsighted
  agent is credited with.

Reported per number of segments before the answer (1: the decision after the question has been read) and per
band of the observation's ``entropy_max``, so it says where the signal an agent could learn lies and how large it
is against the reward's spread. Rewards are the environment's own (``RewardWeights(1, q, 1)``).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from confkv.controllers.observation import obs_names
from envs.env import RewardWeights
from envs.episodes import TuneData, build_episodes, scaled_sizes
from envs.evaluate import play_episodes

CONTRACT, HOLD, EXPAND = 0, 1, 2
Act = Callable[[np.ndarray], int]


def threshold_rule(feature: int, threshold: float) -> Act:
    return lambda obs: EXPAND if float(obs[feature]) > threshold else CONTRACT


def forced(plan: list[tuple[int, int, int]], rule: Act) -> Callable[[int, int, np.ndarray], int]:
    """Slot ``j`` takes action ``plan[j][2]`` at its decision ``plan[j][1]`` and ``rule``'s everywhere else."""
    return lambda j, k, obs: plan[j][2] if k == plan[j][1] else rule(obs)


def discounted(rewards: list[float], gamma: float) -> float:
    return float(sum(r * gamma**j for j, r in enumerate(rewards)))


def advantages(
    data: TuneData, rule: Act, weights: RewardWeights, batch: int = 24
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (episode, decision): the observation, the rule's action and expand-minus-contract differences
    of the immediate reward and of the returns at gamma 0.5 and 1."""
    episodes = data.episodes
    behaviour = play_episodes(data, lambda _i, _k, obs: rule(obs), "budget", weights, episodes)
    plan = [(i, k, a) for i, (_, acts, _) in enumerate(behaviour) for k in range(len(acts)) for a in (CONTRACT, EXPAND)]
    played: dict[tuple[int, int, int], list[float]] = {}
    for s in range(0, len(plan), batch):
        chunk = plan[s : s + batch]
        runs = play_episodes(data, forced(chunk, rule), "budget", weights, [episodes[i] for i, _, _ in chunk])
        for key, (_, _, rewards) in zip(chunk, runs, strict=True):
            played[key] = rewards
    rows = []
    for i, (obs, acts, _) in enumerate(behaviour):
        n = len(acts)
        for k in range(n):
            up, down = played[(i, k, EXPAND)][k:], played[(i, k, CONTRACT)][k:]
            rows.append({
                "item": episodes[i].item_id, "decision": k, "before_answer": n - k, "obs": obs[k],
                "rule": acts[k], "immediate": up[0] - down[0],
                "return_0.5": discounted(up, 0.5) - discounted(down, 0.5),
                "return_1": discounted(up, 1.0) - discounted(down, 1.0),
                "contract_immediate": down[0],
            })  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], str], title: str) -> str:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    lines = [f"| {title} | decisions | immediate | return, gamma 0.5 | return, gamma 1 | expand better now |",
             "|:---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name in sorted(groups, key=lambda g: (len(g), g)):
        g = groups[name]
        imm = np.array([r["immediate"] for r in g])
        lines.append(
            f"| {name} | {len(g)} | {imm.mean():+.3f} | {np.mean([r['return_0.5'] for r in g]):+.3f} | "
            f"{np.mean([r['return_1'] for r in g]):+.3f} | {100 * np.mean(imm > 0):.0f}% |"
        )
    return "\n".join(lines)


def band(x: float, edges: list[float]) -> str:
    for lo, hi in itertools.pairwise(edges):
        if x < hi:
            return f"{lo:.2f}-{hi:.2f}"
    return f">= {edges[-1]:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workload", default="passkey-varied")
    p.add_argument("--items-scale", type=int, default=6)
    p.add_argument("--split", choices=["train", "heldout"], default="train")
    p.add_argument("--items", default=None, help="comma-separated episode indices (default: all)")
    p.add_argument("--quality-weight", type=float, default=6.0)
    p.add_argument("--feature", default="entropy_max", help="the behaviour rule's observation entry (layout 2)")
    p.add_argument("--threshold", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    names = obs_names(2)
    if args.feature not in names:
        raise SystemExit(f"unknown feature {args.feature!r}; choose one of {', '.join(names)}")
    data = build_episodes(args.model, workload=args.workload, split=args.split, seed=args.seed,
                          sizes=scaled_sizes(args.model, args.items_scale))  # fmt: skip
    data.obs_version = 2
    if args.items:
        try:
            data.episodes = [data.episodes[int(i)] for i in args.items.split(",")]
        except (ValueError, IndexError):
            raise SystemExit(f"--items: indices below {len(data.episodes)} (got {args.items!r})") from None
    weights = RewardWeights(1.0, args.quality_weight, 1.0)
    feature = names.index(args.feature)
    rows = advantages(data, threshold_rule(feature, args.threshold), weights)
    spread = np.std([r["contract_immediate"] for r in rows])
    print(
        f"{len(rows)} decisions on {len(data.episodes)} items; behaviour: expand when {args.feature} > "
        f"{args.threshold:g}; expand minus contract (mean); spread of a step's reward (contract, std) {spread:.3f}\n"
    )
    print(table(rows, lambda r: str(min(r["before_answer"], 6)).replace("6", ">= 6"), "segments before the answer"))
    print()
    edges = [0.0, 0.05, 0.1, 0.2, 0.35]
    print(table(rows, lambda r: band(float(r["obs"][feature]), edges), f"{args.feature} (latest segment)"))


if __name__ == "__main__":
    main()
