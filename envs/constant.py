"""Does a learned policy use what it sees? Its margin over its own constant, on the same items.

A network that sets the same knobs whatever it observes is a constant policy in disguise, and Optuna can find a
constant. So every learned (knobs) policy is measured against the plain ``dynamic`` rule with the network's median
knobs over the observations it actually saw while being evaluated: ``evaluate_with_actions`` runs the exported
network inside the engine exactly as ``evaluate_policy`` does (the same ``LearnedController``, one controller
shared by every item as the engine shares its own) and records every decision; ``own_constant`` is the rule with
the median of each knob; ``paired_margin`` is the mean per-item difference of episode rewards with a 95%
percentile bootstrap interval over items (``scipy.stats.bootstrap``). The network beats its constant only when
the interval lies above zero; a network that ignores its input scores exactly its constant (margin 0).

A budget-action network (contract / hold / expand) sets no knobs; its constant is its most frequent action taken
every segment whatever it observes (a network with zero weights, run through the same engine path), so a network
that ignores its input scores exactly its constant here too.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from confkv.config import CachePolicy
from confkv.controllers.learned import KNOB_NAMES, SIZE_NAMES, LearnedController, MLPPolicy
from confkv.controllers.observation import obs_dim
from envs.env import RewardWeights
from envs.episodes import Episode, TuneData
from envs.evaluate import evaluate_policy

CONFIDENCE = 0.95
RESAMPLES = 2000


@dataclass
class RecordingPolicy(MLPPolicy):
    """An exported network that keeps every (observation, action) it is asked for."""

    seen: list[tuple[np.ndarray, Any]] = field(default_factory=list)

    @classmethod
    def wrap(cls, mlp: MLPPolicy) -> RecordingPolicy:
        return cls(**{f.name: getattr(mlp, f.name) for f in fields(MLPPolicy)})

    def act(self, obs: np.ndarray) -> np.ndarray | int:
        action = super().act(obs)
        self.seen.append((np.array(obs, copy=True), action))
        return action


def is_network(policy: CachePolicy) -> bool:
    """Whether ``policy`` runs an exported network (knobs or budget actions): the policies checked here."""
    return policy.controller == "learned"


def evaluate_with_actions(
    data: TuneData, policy: CachePolicy, weights: RewardWeights, episodes: list[Episode] | None = None,
    label: str | None = None,
) -> tuple[dict[str, Any], list[dict[str, float]]]:  # fmt: skip
    """``evaluate_policy`` of a learned policy, plus every decision its network took: the knobs it set, or for a
    budget network ``{"budget_action": the action}``."""
    recorder = RecordingPolicy.wrap(MLPPolicy.load(policy.learned_path))
    controller = LearnedController(policy, recorder)
    metrics = evaluate_policy(data, policy, weights, episodes, label=label, controller=controller)
    if controller.space is None:
        return metrics, [{"budget_action": int(a)} for _, a in recorder.seen]  # type: ignore[arg-type]
    return metrics, [controller.space.knobs(a) for _, a in recorder.seen]


def median_knobs(decisions: list[dict[str, float]], policy: CachePolicy) -> dict[str, float]:
    """The median of each knob over ``decisions`` (sizes in whole blocks, ``max_size >= base_size``); a knob the
    network does not set keeps ``policy``'s value. Budget decisions give their most frequent action (ties: the
    smallest, contract before hold before expand)."""
    if not decisions:
        raise ValueError("the network took no decision on these items")
    if "budget_action" in decisions[0]:
        counts = Counter(int(d["budget_action"]) for d in decisions)
        return {"budget_action": max(sorted(counts), key=lambda a: counts[a])}
    out: dict[str, float] = {}
    for name in KNOB_NAMES:
        if name in decisions[0]:
            out[name] = float(np.median([d[name] for d in decisions]))
    bs = policy.block_size
    for name in SIZE_NAMES:
        if name in out:
            out[name] = int(max(bs, round(out[name] / bs) * bs))
    if "base_size" in out or "max_size" in out:
        base = int(out.get("base_size", policy.base_size))
        out["max_size"] = int(max(out.get("max_size", policy.max_size), base))
    return out


def own_constant(policy: CachePolicy, knobs: dict[str, float]) -> CachePolicy:
    """The plain ``dynamic`` rule of ``policy`` with ``knobs`` held constant; for a budget network
    (``budget_action``), the network that takes that action whatever it observes."""
    if "budget_action" in knobs:
        return blind_budget_policy(policy, int(knobs["budget_action"]))
    return policy.replace(controller="dynamic", learned_path=None, **knobs)


BUDGET_ACTIONS = ("contract", "hold", "expand")


def constant_text(knobs: dict[str, float]) -> str:
    """How a report names a learned policy's constant."""
    if "budget_action" in knobs:
        return f"the budget network that always takes {BUDGET_ACTIONS[int(knobs['budget_action'])]}"
    return "dynamic with " + ", ".join(f"{k} {v:g}" for k, v in knobs.items())


def blind_budget_policy(policy: CachePolicy, action: int) -> CachePolicy:
    """``policy``'s budget network replaced by one with zero weights that always takes ``action`` (saved in a
    temporary folder, which the returned policy points at and which is removed when the process exits)."""
    mlp = MLPPolicy.load(policy.learned_path)
    bias = torch.zeros(3)
    bias[action] = 1.0
    blind = MLPPolicy(layers=[(torch.zeros(3, obs_dim(mlp.obs_version)), bias, "none")], action="budget",
                      obs_version=mlp.obs_version)  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="confkv-constant-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    blind.save(folder, policy)
    return policy.replace(learned_path=str(folder))


@dataclass
class Margin:
    """Mean per-item reward difference (a minus b) with its bootstrap interval over items."""

    mean: float
    lo: float | None
    hi: float | None
    items: int

    @property
    def above_zero(self) -> bool:
        return self.lo is not None and self.lo > 0

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "items": self.items, "above_zero": self.above_zero}

    def text(self) -> str:
        interval = "no interval" if self.lo is None else f"95% CI [{self.lo:+.4f}, {self.hi:+.4f}]"
        return f"{self.mean:+.4f} ({interval}, {self.items} items)"


def paired_margin(
    a: list[dict[str, Any]], b: list[dict[str, Any]], resamples: int = RESAMPLES, seed: int = 0
) -> Margin:
    """``a``'s per-episode rewards minus ``b``'s on the same items (``per_episode`` rows of an evaluation)."""
    from scipy.stats import bootstrap

    rb = {r["item"]: r["reward"] for r in b}
    missing = [r["item"] for r in a if r["item"] not in rb]
    if missing or len(rb) != len(a):
        raise ValueError("a paired margin needs both evaluations on the same items")
    diff = np.array([r["reward"] - rb[r["item"]] for r in a], dtype=np.float64)
    if diff.size < 2:
        return Margin(float(diff.mean()), None, None, int(diff.size))
    if np.ptp(diff) == 0:  # every item the same: the interval is that point (bootstrap refuses degenerate data)
        return Margin(float(diff[0]), float(diff[0]), float(diff[0]), int(diff.size))
    res = bootstrap((diff,), np.mean, confidence_level=CONFIDENCE, n_resamples=resamples, method="percentile",
                    rng=np.random.default_rng(seed))  # fmt: skip
    ci = res.confidence_interval
    return Margin(float(diff.mean()), float(ci.low), float(ci.high), int(diff.size))


@dataclass
class ConstantCheck:
    """A learned policy against its own constant: the knobs, both evaluations and the margin."""

    knobs: dict[str, float]
    decisions: int
    learned: dict[str, Any]
    constant: dict[str, Any]
    margin: Margin

    def to_dict(self) -> dict[str, Any]:
        return {"knobs": self.knobs, "decisions": self.decisions, "margin": self.margin.to_dict(),
                "constant_reward": self.constant["reward"], "constant_kv_fraction": self.constant["kv_fraction"],
                "learned_reward": self.learned["reward"]}  # fmt: skip


def check_against_constant(
    data: TuneData, policy: CachePolicy, weights: RewardWeights, seed: int = 0, label: str = "learned"
) -> ConstantCheck:
    """Evaluate a learned policy, derive its own constant from its decisions, evaluate that, and pair them."""
    learned, decisions = evaluate_with_actions(data, policy, weights, label=f"evaluate {label}")
    knobs = median_knobs(decisions, policy)
    constant = evaluate_policy(data, own_constant(policy, knobs), weights, label=f"evaluate {label}'s constant")
    margin = paired_margin(learned["per_episode"], constant["per_episode"], seed=seed)
    return ConstantCheck(knobs, len(decisions), learned, constant, margin)
