"""Learned controllers: the observation an agent sees, the action it takes, and the exported policy it becomes.

An agent decides once per segment of ``compact_interval`` tokens (the first decision after the first generated
token). Its observation is built only from what a controller sees step by step (``StepSignals`` with their
context), so the same function serves the training environment (``envs/``) and the engine, and an exported
policy behaves in ``confkv generate`` as it did in training. Observation, all in [0, 1]:

 0-2  entropy of the segment's tokens: mean, min, max (divided by ``ENTROPY_SCALE`` nats, clipped)
 3-5  top-1 minus top-2 probability: mean, min, max
 6-8  top-1 probability: mean, min, max
 9    share of the segment's tokens that were uncertain under the base thresholds
 10   budget: (B - base_size) / (max_size - base_size)
 11   resident fraction: resident keys / keys a full cache would hold
 12   position: tokens so far / ``POSITION_SCALE``, clipped
 13   device pool use

Actions. ``knobs`` (a ``Box(-1, 1, (3,))``): the dynamic rule's ``entropy_threshold``, ``gap_threshold`` and
``scaling_factor`` for the next segment, mapped linearly into ``KNOB_BOUNDS``. ``budget`` (``Discrete(3)``): set
the budget directly: contract a fifth of the way to ``base_size``, hold, or expand a fifth of the way to
``max_size``; it then stays still for the segment.

The exported artifact is a folder: ``policy.json`` (layer shapes and activations, action kind and bounds, the
observation layout version) and ``policy.safetensors`` (weights), plus ``policy.yaml`` naming the controller,
so ``confkv generate --policy-file FOLDER`` runs it with torch alone, no stable-baselines3.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from confkv.config import CachePolicy
from confkv.controllers import BudgetState, Controller, DynamicController, StepSignals
from confkv.errors import ConfkvError

OBS_VERSION = 1
OBS_DIM = 14
ENTROPY_SCALE = 12.0
POSITION_SCALE = 8192.0
KNOB_NAMES = ("entropy_threshold", "gap_threshold", "scaling_factor")
KNOB_BOUNDS: dict[str, tuple[float, float]] = {
    "entropy_threshold": (0.5, 6.0),
    "gap_threshold": (0.0, 0.5),
    "scaling_factor": (0.5, 1.0),
}
BUDGET_STEP = 0.2


def knobs_from_action(action: Any) -> dict[str, float]:
    a = np.clip(np.asarray(action, dtype=np.float64).reshape(-1), -1.0, 1.0)
    return {
        k: lo + (float(x) + 1.0) / 2.0 * (hi - lo)
        for k, x, (lo, hi) in zip(KNOB_NAMES, a, KNOB_BOUNDS.values(), strict=True)
    }


def action_from_knobs(knobs: dict[str, float]) -> np.ndarray:
    return np.array([2.0 * (knobs[k] - lo) / (hi - lo) - 1.0 for k, (lo, hi) in KNOB_BOUNDS.items()], dtype=np.float32)


def segment_observation(
    signals: list[StepSignals], budget: float, policy: CachePolicy, uncertain: int | None = None
) -> np.ndarray:
    """The observation after a segment; ``signals`` carry the context of the segment's last token."""
    if not signals:
        return np.zeros(OBS_DIM, dtype=np.float32)
    ent = np.array([s.entropy for s in signals]) / ENTROPY_SCALE
    gap = np.array([s.gap for s in signals])
    top1 = np.array([s.top1_prob for s in signals])
    if uncertain is None:
        uncertain = sum(s.entropy > policy.entropy_threshold or s.gap < policy.gap_threshold for s in signals)
    last = signals[-1]
    span = max(1, policy.max_size - policy.base_size)
    obs = [
        ent.mean(), ent.min(), ent.max(),
        gap.mean(), gap.min(), gap.max(),
        top1.mean(), top1.min(), top1.max(),
        uncertain / len(signals),
        (budget - policy.base_size) / span,
        last.resident / max(1, last.position),
        last.position / POSITION_SCALE,
        last.pool_usage,
    ]  # fmt: skip
    return np.clip(np.nan_to_num(np.asarray(obs, dtype=np.float32)), 0.0, 1.0)


# ------------------------------------------------------------------------------------------------ the artifact
@dataclass
class MLPPolicy:
    """A deterministic MLP policy: linear layers with activations, then the action head."""

    layers: list[tuple[torch.Tensor, torch.Tensor, str]]
    action: str  # "knobs" or "budget"
    meta: dict[str, Any] = field(default_factory=dict)

    def act(self, obs: np.ndarray) -> np.ndarray | int:
        x = torch.as_tensor(obs, dtype=torch.float32)[None]
        with torch.no_grad():
            for w, b, act in self.layers:
                x = x @ w.T + b
                if act == "tanh":
                    x = torch.tanh(x)
                elif act == "relu":
                    x = torch.relu(x)
        out = x[0]
        if self.action == "budget":
            return int(out.argmax())
        if self.meta.get("squash") == "tanh":
            out = torch.tanh(out)
        return out.clamp(-1.0, 1.0).numpy()

    def save(self, folder: str | Path, base_policy: CachePolicy, extra: dict[str, Any] | None = None) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        spec = []
        for i, (w, b, act) in enumerate(self.layers):
            tensors[f"layer{i}.weight"] = w.contiguous()
            tensors[f"layer{i}.bias"] = b.contiguous()
            spec.append({"weight": f"layer{i}.weight", "bias": f"layer{i}.bias", "activation": act,
                         "shape": list(w.shape)})  # fmt: skip
        save_file(tensors, str(folder / "policy.safetensors"))
        doc = {
            "format": "confkv-learned-policy",
            "obs_version": OBS_VERSION,
            "obs_dim": OBS_DIM,
            "action": self.action,
            "knob_bounds": KNOB_BOUNDS,
            "budget_step": BUDGET_STEP,
            "layers": spec,
            **self.meta,
            **(extra or {}),
        }
        (folder / "policy.json").write_text(json.dumps(doc, indent=2))
        policy = base_policy.replace(controller="learned", learned_path=".")
        import yaml

        (folder / "policy.yaml").write_text(yaml.safe_dump({"cache_policy": policy.model_dump(mode="json")}))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> MLPPolicy:
        from safetensors.torch import load_file

        folder = Path(folder)
        try:
            doc = json.loads((folder / "policy.json").read_text())
            tensors = load_file(str(folder / "policy.safetensors"))
        except (OSError, ValueError) as err:
            raise ConfkvError(f"cannot load learned policy from {folder}: {err}") from None
        if doc.get("format") != "confkv-learned-policy" or doc.get("obs_version") != OBS_VERSION:
            raise ConfkvError(f"{folder} is not a confkv learned policy of observation version {OBS_VERSION}")
        layers = [(tensors[s["weight"]], tensors[s["bias"]], s["activation"]) for s in doc["layers"]]
        meta = {k: v for k, v in doc.items() if k in ("squash", "algo")}
        return cls(layers=layers, action=doc["action"], meta=meta)


# ------------------------------------------------------------------------------------------------ the controller
@dataclass(frozen=True)
class LearnedState(BudgetState):
    knobs: tuple[float, float, float] = (3.5, 0.15, 0.8)
    segment: tuple[StepSignals, ...] = ()
    hold: bool = False  # budget actions keep the budget still between decisions


def apply_budget_action(budget: float, action: int, policy: CachePolicy) -> float:
    if action == 0:
        return budget - BUDGET_STEP * (budget - policy.base_size)
    if action == 2:
        return budget + BUDGET_STEP * (policy.max_size - budget)
    return budget


class LearnedController(DynamicController):
    """The dynamic rule with its knobs (or the budget itself) set by an exported policy every segment."""

    name = "learned"

    def __init__(self, policy: CachePolicy, mlp: MLPPolicy | None = None) -> None:
        super().__init__(policy)
        if mlp is None:
            if not policy.learned_path:
                raise ConfkvError("the learned controller needs learned_path (an exported policy folder)")
            mlp = MLPPolicy.load(policy.learned_path)
        self.mlp = mlp

    def init_state(self) -> LearnedState:
        p = self.policy
        return LearnedState(budget=float(p.base_size), knobs=(p.entropy_threshold, p.gap_threshold, p.scaling_factor))

    def derive(self, policy: CachePolicy) -> Controller:
        if policy.controller == "learned" and policy.learned_path == self.policy.learned_path:
            return LearnedController(policy, self.mlp)
        return super().derive(policy)

    def update(self, state: BudgetState, s: StepSignals) -> LearnedState:
        st = state if isinstance(state, LearnedState) else self.init_state()
        p = self.policy
        ent_t, gap_t, scaling = st.knobs
        uncertain = s.entropy > ent_t or s.gap < gap_t
        budget = st.budget
        if not st.hold:
            rate = 1.0 - scaling
            budget = budget + rate * (p.max_size - budget) if uncertain else budget - rate * (budget - p.base_size)
        budget = min(float(p.max_size), max(float(p.base_size), budget))
        steps = st.steps + 1
        segment = (*st.segment, s)
        new = LearnedState(budget=budget, uncertain=uncertain, steps=steps, knobs=st.knobs, segment=segment,
                           hold=st.hold)  # fmt: skip
        if (steps - 1) % p.compact_interval == 0:
            new = self.decide(new)
        return new

    def decide(self, st: LearnedState) -> LearnedState:
        obs = segment_observation(list(st.segment), st.budget, self.policy)
        action = self.mlp.act(obs)
        if self.mlp.action == "budget":
            budget = apply_budget_action(st.budget, int(action), self.policy)
            return replace(st, budget=budget, segment=(), hold=True)
        k = knobs_from_action(action)
        return replace(st, knobs=tuple(k[n] for n in KNOB_NAMES), segment=(), hold=False)
