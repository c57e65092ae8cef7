"""What a learned budget policy's decisions depend on, and whether a blind timing does as well.

    python benchmarks/what_it_reads.py runs/ppo/policy --workload passkey --items-scale 6 --quality-weight 6

Runs the exported network through the engine on a split (as ``confkv-tune compare`` does), recording every
observation and decision, then:

* **permutation test per group of observation entries**: the share of decisions that change when one group's
  values are shuffled across the recorded observations (the rest kept), averaged over ``--permutations``
  shuffles. A group the network ignores changes nothing; the groups are the position, the budget and resident
  fraction, the latest segment's confidence statistics (entropy, gap, top-1, uncertain share) and layout 2's
  history (their recent means and trends);
* **decisions by position**: the share of expand / hold / contract decisions per position band, and on
  ``passkey-varied`` by how many segments before the answer they come (the last one has read the question);
* **against blind timings**, on the same items and reward: schedules that contract until a position and expand
  from there (``benchmarks/trend_rule.py``'s), and a placebo that expands at random as often as the network does;
  per-item margins with 95% bootstrap intervals.
"""

from __future__ import annotations

import argparse
import itertools
from collections import Counter
from collections.abc import Callable

import numpy as np

from confkv.config import load_policy_file
from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import HISTORY_NAMES, OBS_NAMES, POSITION_SCALE, obs_names
from envs.constant import RecordingPolicy, paired_margin
from envs.env import RewardWeights
from envs.episodes import build_episodes, scaled_sizes
from envs.evaluate import evaluate_agent, evaluate_policy

CONTRACT, HOLD, EXPAND = 0, 1, 2
GROUPS = {
    "position": ["position"],
    "budget and resident fraction": ["budget", "resident_fraction"],
    "latest segment's confidence": [n for n in OBS_NAMES if n.split("_")[0] in ("entropy", "gap", "top1", "uncertain")],
    "history (recent means, trends)": list(HISTORY_NAMES),
}


def permutation_changes(mlp: MLPPolicy, obs: np.ndarray, actions: np.ndarray, cols: list[int], n: int) -> float:
    """Mean share of decisions that change when ``cols`` are shuffled together across the observations."""
    rng = np.random.default_rng(0)
    changed = []
    for _ in range(n):
        shuffled = obs.copy()
        shuffled[:, cols] = obs[rng.permutation(len(obs))][:, cols]
        changed.append(np.mean([mlp.act(o) != a for o, a in zip(shuffled, actions, strict=True)]))
    return float(np.mean(changed))


def segments_before_answer(positions: np.ndarray, prompt_lens: list[int], chunk: int) -> np.ndarray:
    """For each decision (its observation's position, in tokens), how many segments before its item's answer it
    comes: 1 is the decision taken after the question has been read (``passkey-varied`` starts the answer's segment
    at a decision); 0 where the decisions of the batch cannot be told apart.

    The engine asks the network for all items of a batch in turn, so a decision is matched to its item by position:
    an item's decisions lie a whole number of segments before its answer, at the same offset for every item whose
    answer starts a segment (read from the longest item, whose last decision is the latest of all); a decision that
    two items of different lengths could own is left out (0).
    """
    offset = max(prompt_lens) - int(positions.max())  # the longest item's last decision is the latest of all
    out = np.zeros(len(positions), dtype=int)
    for i, at in enumerate(positions):
        owners = {n for n in prompt_lens if n > at and int(n - at) % chunk == offset}
        if len(owners) == 1:
            out[i] = (owners.pop() - int(at) - offset) // chunk + 1
    return out


def schedule(position: int, after: int) -> Callable[[np.ndarray], int]:
    """Contract before token ``after``, expand from there (``position``: the observation's entry)."""
    return lambda obs: EXPAND if float(obs[position]) * POSITION_SCALE >= after else CONTRACT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("policy", help="an exported budget-action policy folder")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workload", default="passkey")
    p.add_argument("--items-scale", type=int, default=6)
    p.add_argument("--split", choices=["train", "heldout"], default="heldout")
    p.add_argument("--quality-weight", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--permutations", type=int, default=20)
    p.add_argument("--schedules", default="400,550")
    args = p.parse_args()
    policy = load_policy_file(args.policy)
    mlp = MLPPolicy.load(policy.learned_path)
    if mlp.action != "budget":
        raise SystemExit(f"{args.policy} is a {mlp.action} network; this reads budget-action networks")
    names = obs_names(mlp.obs_version)
    weights = RewardWeights(1.0, args.quality_weight, 1.0)
    data = build_episodes(args.model, workload=args.workload, split=args.split, seed=args.seed,
                          sizes=scaled_sizes(args.model, args.items_scale))  # fmt: skip
    data.obs_version = mlp.obs_version

    from confkv.controllers.learned import LearnedController

    recorder = RecordingPolicy.wrap(mlp)
    learned = evaluate_policy(data, policy, weights, controller=LearnedController(policy, recorder), label="network")
    obs = np.stack([o for o, _ in recorder.seen])
    actions = np.array([int(a) for _, a in recorder.seen])
    expand_share = float(np.mean(actions == EXPAND))
    print(f"{len(actions)} decisions: expand {100 * expand_share:.0f}%, hold {100 * np.mean(actions == HOLD):.0f}%, "
          f"contract {100 * np.mean(actions == CONTRACT):.0f}%; reward {learned['reward']:.3f}, "
          f"KV {100 * learned['kv_fraction']:.1f}%, KL {learned['kl_mean']:.4f}, "
          f"pass keys {100 * (learned['passkey_acc'] or 0):.0f}%")  # fmt: skip

    print("\n| entries shuffled | decisions changed |\n|:---|---:|")
    for group, members in GROUPS.items():
        cols = [names.index(m) for m in members if m in names]
        if cols:
            print(f"| {group} | {100 * permutation_changes(mlp, obs, actions, cols, args.permutations):.1f}% |")

    pos = obs[:, names.index("position")] * POSITION_SCALE
    edges = [0, 200, 300, 400, 500, 600, 700, 10_000]
    print("\n| position (tokens) | decisions | expand % | hold % | contract % |\n|:---|---:|---:|---:|---:|")
    for lo, hi in itertools.pairwise(edges):
        sel = actions[(pos >= lo) & (pos < hi)]
        if sel.size:
            c = Counter(sel.tolist())
            print(f"| {lo}-{hi} | {sel.size} | {100 * c[EXPAND] / sel.size:.0f} | {100 * c[HOLD] / sel.size:.0f} | "
                  f"{100 * c[CONTRACT] / sel.size:.0f} |")  # fmt: skip

    if data.workload == "passkey-varied":
        lens = [ep.prompt_len for ep in data.episodes]
        before = segments_before_answer(pos, lens, data.base_policy.compact_interval)
        print("\n| segments before the answer (1: the decision after the question) | decisions | expand % | hold % | "
              "contract % |\n|:---|---:|---:|---:|---:|")  # fmt: skip
        for label, sel in (("1", before == 1), ("2", before == 2), ("3", before == 3), ("4 or more", before >= 4),
                           ("not told apart", before == 0)):  # fmt: skip
            chosen = actions[sel]
            if chosen.size:
                c = Counter(chosen.tolist())
                print(f"| {label} | {chosen.size} | {100 * c[EXPAND] / chosen.size:.0f} | "
                      f"{100 * c[HOLD] / chosen.size:.0f} | {100 * c[CONTRACT] / chosen.size:.0f} |")  # fmt: skip

    print("\n| blind timing | KV % | KL | pass keys % | reward | network's margin [95% CI] |")
    print("|:---|---:|---:|---:|---:|---:|")
    position = names.index("position")
    rng = np.random.default_rng(args.seed)
    blind = {f"expand from {a}": schedule(position, a) for a in (int(s) for s in args.schedules.split(",") if s)}
    blind[f"placebo, expands {100 * expand_share:.0f}% at random"] = lambda _o: (
        EXPAND if rng.random() < expand_share else CONTRACT
    )
    for name, act in blind.items():
        m = evaluate_agent(data, act, "budget", weights)
        margin = paired_margin(learned["per_episode"], m["per_episode"], seed=args.seed)
        print(f"| {name} | {100 * m['kv_fraction']:.1f} | {m['kl_mean']:.4f} | {100 * (m['passkey_acc'] or 0):.0f} | "
              f"{m['reward']:.3f} | {margin.text()} |")  # fmt: skip


if __name__ == "__main__":
    main()
