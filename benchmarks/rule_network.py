"""Export a hand rule on one observation entry as a budget network, so it runs where a learned policy runs.

    python benchmarks/rule_network.py --feature entropy_max --threshold 0.2 --out runs/rule-entropy-max
    confkv-tune compare --workload passkey-varied --policy rule=runs/rule-entropy-max --policy optuna=...

``benchmarks/trend_rule.py`` measures its rules as agents in the environment; ``confkv-tune compare`` runs
policies through the engine (``LearnedController``), and the two paths start a budget network's first decision from
different budgets (TUNING.md). This writes the rule "expand when ``feature`` exceeds ``threshold``, else contract" as
one linear layer over observation layout 2 (expand's logit ``k (x - t)``, contract's ``k (t - x)``, hold's -1), so
that ``compare`` measures it on the engine's path beside Optuna's policy and the learned ones, with the same
intervals and its own constant.
"""

from __future__ import annotations

import argparse

import torch

from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import obs_names
from envs.episodes import default_base_policy

SLOPE = 1e4  # |logit| of expand and contract at 1e-4 from the threshold: hold (-1) wins only closer than that


def rule_network(feature: str, threshold: float, version: int = 2) -> MLPPolicy:
    """A budget network that expands when observation entry ``feature`` exceeds ``threshold``, else contracts."""
    names = obs_names(version)
    if feature not in names:
        raise SystemExit(f"unknown feature {feature!r}; choose one of {', '.join(names)}")
    w = torch.zeros(3, len(names))
    i = names.index(feature)
    w[0, i], w[2, i] = -SLOPE, SLOPE  # contract, hold, expand (``apply_budget_action``'s order)
    b = torch.tensor([SLOPE * threshold, -1.0, -SLOPE * threshold])
    return MLPPolicy(layers=[(w, b, "none")], action="budget", budget_rule="replay", obs_version=version,
                     meta={"algo": f"rule {feature} > {threshold:g}"})  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="whose base policy the exported policy.yaml takes")
    p.add_argument("--feature", default="entropy_max")
    p.add_argument("--threshold", type=float, default=0.2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    folder = rule_network(args.feature, args.threshold).save(args.out, default_base_policy(args.model))
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
