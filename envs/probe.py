"""What a larger budget gains, segment by segment, and what a controller saw before it had to choose.

A controller can beat the best constant policy only where the gain of a larger budget varies from segment to
segment *and* something it observes says in advance where that gain is large. This module measures both on one
workload's items, through the same teacher-forced scoring path every evaluation uses (``confkv.scoring``):

* each item is scored three times over the same tokens: with the budget held at the base policy's ``base_size``,
  held at its ``max_size``, and under the ``dynamic`` rule itself (the base policy as it is);
* a segment's **gain** is its mean KL to ``full`` at ``base_size`` minus its mean KL at ``max_size`` (how much the
  larger budget is worth there); a token's gain is the same difference for that token;
* a segment's **features** are what a controller deciding before the segment can observe (the ``dynamic`` run's
  signals, as serving would see them): the previous segment's mean entropy, top-1/top-2 gap and top-1 probability,
  their means over the last ``RECENT`` segments and their trend (previous minus recent mean), the position, and the
  ``dynamic`` rule's own budget entering the segment. The same segment's own mean entropy is kept beside them as a
  reference the rule, which reacts token by token, partly sees.

Only segments (and tokens) whose context already exceeds ``base_size`` count: before that both budgets hold
everything, the gain is exactly zero and any controller knows it from the position alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from confkv.bench.scored import score_items
from confkv.config import CachePolicy
from confkv.progress import stage
from confkv.scoring import ScoreResult
from envs.episodes import TuneData
from envs.evaluate import segments

#: Segments averaged for the "recent" features and the trend.
RECENT = 4
#: Segment features, in table order; ``*_now`` is the segment's own signal (a reference, not a prediction).
SEGMENT_FEATURES = (
    "entropy", "gap", "top1",
    "entropy_recent", "gap_recent", "top1_recent",
    "entropy_trend", "gap_trend", "top1_trend",
    "position", "dynamic_budget", "entropy_now",
)  # fmt: skip
#: Token features: the previous token's signals and the rule's budget after it.
TOKEN_FEATURES = ("entropy", "gap", "top1", "position", "dynamic_budget")


@dataclass
class ItemProbe:
    """One item's segments (and tokens) with their gain and features: arrays of equal length per level."""

    item_id: str
    workload: str
    segment_gain: np.ndarray
    segment_features: dict[str, np.ndarray] = field(default_factory=dict)
    token_gain: np.ndarray = field(default_factory=lambda: np.zeros(0))
    token_features: dict[str, np.ndarray] = field(default_factory=dict)


def budget_policies(base: CachePolicy) -> dict[str, CachePolicy]:
    """The three runs: the budget held at ``base_size``, held at ``max_size``, and the ``dynamic`` rule."""
    return {
        "small": base.replace(controller="dynamic", max_size=base.base_size),
        "large": base.replace(controller="dynamic", base_size=base.max_size),
        "dynamic": base.replace(controller="dynamic"),
    }


def _item_probe(item_id: str, workload: str, small: ScoreResult, large: ScoreResult, rule: ScoreResult,
                chunk: int, base_size: int) -> ItemProbe:  # fmt: skip
    if small.kl is None or large.kl is None:
        raise ValueError("the probe needs items with full-cache references (KL)")
    kl_gain = (small.kl - large.kl).numpy().astype(np.float64)
    ent, gap, top1 = (t.numpy().astype(np.float64) for t in (rule.entropy, rule.gap, rule.top1_prob))
    budget = rule.budget.numpy().astype(np.float64)
    position = rule.full.numpy().astype(np.float64)  # keys a full cache holds when the token is predicted
    segs = segments(rule.num_tokens, chunk)
    seg_mean = lambda x: np.array([x[s].mean() for s in segs])  # noqa: E731
    means = {"entropy": seg_mean(ent), "gap": seg_mean(gap), "top1": seg_mean(top1)}
    gain, feats = [], {name: [] for name in SEGMENT_FEATURES}
    for k in range(1, len(segs)):
        if position[segs[k].start] <= base_size:
            continue
        gain.append(kl_gain[segs[k]].mean())
        window = slice(max(0, k - RECENT), k)
        for sig, m in means.items():
            recent = float(m[window].mean())
            feats[sig].append(m[k - 1])
            feats[f"{sig}_recent"].append(recent)
            feats[f"{sig}_trend"].append(m[k - 1] - recent)
        feats["position"].append(position[segs[k].start])
        feats["dynamic_budget"].append(budget[segs[k].start - 1])
        feats["entropy_now"].append(means["entropy"][k])
    tokens = np.flatnonzero(position > base_size)
    tokens = tokens[tokens >= 1]
    token_feats = {"entropy": ent[tokens - 1], "gap": gap[tokens - 1], "top1": top1[tokens - 1],
                   "position": position[tokens], "dynamic_budget": budget[tokens - 1]}  # fmt: skip
    return ItemProbe(item_id, workload, np.asarray(gain), {k: np.asarray(v) for k, v in feats.items()},
                     kl_gain[tokens], token_feats)  # fmt: skip


def probe_items(data: TuneData, label: str | None = None) -> list[ItemProbe]:
    """Every episode of ``data`` scored under the three budgets (each run one engine batch), as ``ItemProbe``s."""
    base = data.base_policy
    runs: dict[str, list[ScoreResult]] = {}
    items = [ep.item for ep in data.episodes]
    policies = budget_policies(base)
    with stage(label or f"probe {data.workload}", total=len(policies) * len(items), unit="items") as progress:
        for name, policy in policies.items():
            llm = data.llm(policy, max_batch_size=len(items))
            runs[name] = score_items(llm.engine, items, on_done=lambda _: progress.update(1))
    return [
        _item_probe(ep.item_id, ep.workload, s, lg, r, base.compact_interval, base.base_size)
        for ep, s, lg, r in zip(data.episodes, runs["small"], runs["large"], runs["dynamic"], strict=True)
    ]
