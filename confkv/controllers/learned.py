"""Learned controllers: the observation an agent sees, the action it takes, and the exported policy it becomes.

An agent decides once per segment of ``compact_interval`` tokens (the first decision after the first generated
token). Its observation is built only from what a controller sees step by step (``StepSignals`` with their
context), so the same function serves the training environment (``envs/``) and the engine, and an exported
policy behaves in ``confkv generate`` as it did in training. The observation's layouts are in
``confkv.controllers.observation``.

Actions. ``knobs`` (a ``Box(-1, 1, (5,))``): the dynamic rule's ``entropy_threshold``, ``gap_threshold``,
``scaling_factor``, ``base_size`` and ``max_size``, the space Optuna searches too (``KnobSpace``: bounds from the
base policy, sizes in whole blocks, ``max_size`` never below ``base_size``). Each coordinate maps piecewise
linearly: -1 to the knob's low bound, 0 to the base policy's value, +1 to its high bound, so an untrained agent
(mean action near 0) starts as the base policy and explores around it. ``budget`` (``Discrete(3)``): set the
budget directly: contract a fifth of the way to ``base_size``, hold, or expand a fifth of the way to
``max_size``; it then stays still for the segment.

When a decision takes effect (the ``replay`` rule). A knobs decision made after segment ``k`` also moves the budget
at once, to what the new knobs give when replayed over segment ``k``'s signals from the budget segment ``k`` started
with; the engine applies it before segment ``k + 1`` is computed (expanding with a recall, or contracting), so the
action governs the very segment it is rewarded for. With unchanged knobs the replay is exactly the budget the rule
already reached, so a constant agent is the plain ``dynamic`` rule. A budget decision moves the budget at once too.

The exported artifact is a folder: ``policy.json`` (layer shapes and activations, action kind, the knob space and
the budget rule, the observation layout version) and ``policy.safetensors`` (weights), plus ``policy.yaml`` naming
the controller, so ``confkv generate --policy-file FOLDER`` runs it with torch alone, no stable-baselines3.
Exports of format 1 (three knobs, linear mapping, no replay: the knobs governed the segment after next) still
load and run as they were trained; a format newer than this code knows is refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from confkv.config import CachePolicy
from confkv.controllers.base import BudgetState, Controller, StepSignals
from confkv.controllers.observation import (
    OBS_VERSION,
    OBS_VERSIONS,
    SegmentMeans,
    obs_dim,
    push_history,
    segment_observation,
)
from confkv.controllers.rules import DynamicController
from confkv.errors import ConfkvError
from confkv.plugins import CONTROLLERS

#: policy.json format: 1 = three threshold knobs, linear mapping, lagged; 2 = ``KnobSpace`` + ``budget_rule``.
FORMAT_VERSION = 2
KNOB_NAMES = ("entropy_threshold", "gap_threshold", "scaling_factor", "base_size", "max_size")
THRESHOLD_NAMES = KNOB_NAMES[:3]
SIZE_NAMES = KNOB_NAMES[3:]
#: Bounds of the threshold knobs (sizes take theirs from the base policy: ``KnobSpace.for_policy``). The entropy
#: range reaches 8 nats so that a calibrated threshold of a small model (``confkv calibrate``) lies well inside.
THRESHOLD_BOUNDS: dict[str, tuple[float, float]] = {
    "entropy_threshold": (0.25, 8.0),
    "gap_threshold": (0.0, 0.5),
    "scaling_factor": (0.5, 1.0),
}
#: What format-1 exports were trained with (read when their policy.json lacks ``knob_bounds``).
LEGACY_KNOB_BOUNDS: dict[str, tuple[float, float]] = {
    "entropy_threshold": (0.5, 6.0),
    "gap_threshold": (0.0, 0.5),
    "scaling_factor": (0.5, 1.0),
}
#: Kept for callers of format 1's name.
KNOB_BOUNDS = LEGACY_KNOB_BOUNDS
BUDGET_STEP = 0.2
BUDGET_RULES = ("replay", "lagged")


# ------------------------------------------------------------------------------------------------ the knob space
def size_bounds(base: CachePolicy) -> dict[str, tuple[int, int]]:
    """``base_size`` from half to twice the base's; ``max_size`` from what the protected window needs (sinks plus
    ``min_recent``, so every point keeps the base's ``min_recent``) to twice the base's; all in whole blocks."""
    bs = base.block_size
    up = lambda v: int(math.ceil(v / bs) * bs)  # noqa: E731
    b_lo = max(bs, up(base.base_size / 2))
    b_hi = max(b_lo, 2 * base.base_size)
    m_lo = max(b_lo, up(base.min_recent + base.sink_tokens))
    m_hi = max(m_lo, 2 * base.max_size)
    return {"base_size": (b_lo, b_hi), "max_size": (m_lo, m_hi)}


@dataclass(frozen=True)
class KnobSpace:
    """The knobs an agent sets (and Optuna searches), their bounds and the value an action of 0 maps to.

    ``centre`` None is format 1's linear map (-1 -> low, +1 -> high); otherwise the map is piecewise linear through
    the centre. Size knobs are rounded to whole blocks, and ``max_size`` is never below ``base_size``.
    """

    names: tuple[str, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]
    centre: tuple[float, ...] | None = None
    block_size: int = 16

    @classmethod
    def for_policy(cls, base: CachePolicy, sizes: bool = True, bounds_of: CachePolicy | None = None) -> KnobSpace:
        """The space around ``base``: the three thresholds, plus ``base_size`` and ``max_size`` when ``sizes``.

        ``bounds_of`` takes the size bounds from another policy: a warm-started agent acts in the space Optuna
        searched around the tuned base, centred on the policy it starts from (``confkv-tune train --init-policy``).
        """
        bounds: dict[str, tuple[float, float]] = dict(THRESHOLD_BOUNDS)
        if sizes:
            bounds.update(size_bounds(bounds_of or base))
        names = tuple(bounds)
        low = tuple(float(bounds[n][0]) for n in names)
        high = tuple(float(bounds[n][1]) for n in names)
        centre = tuple(min(h, max(lo, float(getattr(base, n)))) for n, lo, h in zip(names, low, high, strict=True))
        return cls(names, low, high, centre, base.block_size)

    @property
    def dim(self) -> int:
        return len(self.names)

    def bounds(self) -> dict[str, tuple[float, float]]:
        return {n: (lo, hi) for n, lo, hi in zip(self.names, self.low, self.high, strict=True)}

    def budget_range(self, policy: CachePolicy) -> tuple[float, float]:
        """What observation 10 normalises the budget over: the widest sizes this space can set."""
        b = self.bounds()
        lo = b["base_size"][0] if "base_size" in b else policy.base_size
        hi = b["max_size"][1] if "max_size" in b else policy.max_size
        return float(lo), float(hi)

    def knobs(self, action: Any) -> dict[str, float]:
        """The knob values of an action in ``[-1, 1]^dim`` (clipped)."""
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(-1), -1.0, 1.0)
        if a.size != self.dim:
            raise ConfkvError(f"a knobs action has {self.dim} values (got {a.size})")
        centre = self.centre or (None,) * self.dim
        out: dict[str, float] = {}
        for name, x, lo, hi, c in zip(self.names, a.tolist(), self.low, self.high, centre, strict=True):
            if c is None:
                v = lo + (x + 1.0) / 2.0 * (hi - lo)
            elif x < 0:
                v = c + x * (c - lo)
            else:
                v = c + x * (hi - c)
            if name in SIZE_NAMES:
                bs = self.block_size
                v = min(hi, max(lo, round(v / bs) * bs))
            out[name] = v
        if "base_size" in out and "max_size" in out:
            out["base_size"] = int(out["base_size"])
            out["max_size"] = int(max(out["max_size"], out["base_size"]))
        return out

    def action(self, knobs: dict[str, float]) -> np.ndarray:
        """The action that maps to ``knobs`` (the inverse of ``knobs``, up to block rounding)."""
        centre = self.centre or (None,) * self.dim
        out = []
        for name, lo, hi, c in zip(self.names, self.low, self.high, centre, strict=True):
            v = float(knobs[name])
            if c is None:
                x = 2.0 * (v - lo) / (hi - lo) - 1.0 if hi > lo else 0.0
            elif v < c:
                x = (v - c) / (c - lo) if c > lo else 0.0
            else:
                x = (v - c) / (hi - c) if hi > c else 0.0
            out.append(min(1.0, max(-1.0, x)))
        return np.array(out, dtype=np.float32)

    def to_json(self) -> dict[str, Any]:
        centre = None if self.centre is None else list(self.centre)
        return {"names": list(self.names), "low": list(self.low), "high": list(self.high), "centre": centre,
                "block_size": self.block_size}  # fmt: skip

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> KnobSpace:
        names = tuple(doc["names"])
        unknown = sorted(set(names) - set(KNOB_NAMES))
        if unknown or not names:
            raise ConfkvError(f"unknown knob(s) {unknown} in the exported policy")
        centre = doc.get("centre")
        return cls(names, tuple(map(float, doc["low"])), tuple(map(float, doc["high"])),
                   None if centre is None else tuple(map(float, centre)), int(doc.get("block_size", 16)))  # fmt: skip


def full_knobs(policy: CachePolicy, knobs: dict[str, float] | None = None) -> tuple[float, ...]:
    """All five knobs (``KNOB_NAMES`` order): ``knobs`` where given, else ``policy``'s."""
    knobs = knobs or {}
    return tuple(float(knobs.get(n, getattr(policy, n))) for n in KNOB_NAMES)


def legacy_space(bounds: dict[str, Any] | None = None) -> KnobSpace:
    """Format 1's space: the three thresholds, mapped linearly over ``bounds`` (default ``LEGACY_KNOB_BOUNDS``)."""
    b = {n: tuple((bounds or LEGACY_KNOB_BOUNDS)[n]) for n in THRESHOLD_NAMES}
    return KnobSpace(THRESHOLD_NAMES, tuple(float(b[n][0]) for n in THRESHOLD_NAMES),
                     tuple(float(b[n][1]) for n in THRESHOLD_NAMES))  # fmt: skip


def dynamic_update(budget: float, s: StepSignals, knobs: Sequence[float]) -> tuple[float, bool]:
    """One step of the dynamic rule under ``knobs`` (``KNOB_NAMES`` order), with the very arithmetic of
    ``DynamicController.update``, so a replay here equals what the engine's controller computed."""
    ent_t, gap_t, scaling, base_size, max_size = knobs
    rate = 1.0 - scaling
    uncertain = s.entropy > ent_t or s.gap < gap_t
    budget = budget + rate * (max_size - budget) if uncertain else budget - rate * (budget - base_size)
    return min(float(max_size), max(float(base_size), budget)), uncertain


def replay_budget(start: float, signals: Iterable[StepSignals], knobs: Sequence[float]) -> float:
    """The budget ``knobs`` reach over ``signals`` from ``start`` (clamped to their sizes first): the replay rule."""
    budget = min(float(knobs[4]), max(float(knobs[3]), start))
    for s in signals:
        budget, _ = dynamic_update(budget, s, knobs)
    return budget


# ------------------------------------------------------------------------------------------------ the artifact
@dataclass
class MLPPolicy:
    """A deterministic MLP policy: linear layers with activations, then the action head.

    ``space`` is the knob space of a knobs policy (None: the one ``KnobSpace.for_policy`` gives the base policy
    for the network's output width: 5 knobs, or the 3 thresholds); ``budget_rule`` when its decisions take effect.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor, str]]
    action: str  # "knobs" or "budget"
    meta: dict[str, Any] = field(default_factory=dict)
    space: KnobSpace | None = None
    budget_rule: str = "replay"
    #: The observation layout the network reads (``OBS_VERSIONS``): 1 for every export before layout 2 existed.
    obs_version: int = OBS_VERSION

    @property
    def out_dim(self) -> int:
        return int(self.layers[-1][0].shape[0])

    def resolved_space(self, policy: CachePolicy) -> KnobSpace:
        """The knob space this network's actions live in, around ``policy`` when the network does not carry one."""
        if self.space is not None:
            return self.space
        return KnobSpace.for_policy(policy, sizes=self.out_dim == len(KNOB_NAMES))

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
        doc: dict[str, Any] = {
            "format": "confkv-learned-policy",
            "format_version": FORMAT_VERSION,
            "obs_version": self.obs_version,
            "obs_dim": obs_dim(self.obs_version),
            "action": self.action,
            "budget_rule": self.budget_rule,
            "budget_step": BUDGET_STEP,
            "layers": spec,
        }
        if self.action == "knobs":
            space = self.resolved_space(base_policy)
            if space.dim != self.out_dim:
                raise ConfkvError(f"the network sets {self.out_dim} knobs but its space has {space.dim}")
            doc["knobs"] = space.to_json()
            doc["knob_bounds"] = space.bounds()  # for readers of format 1
        doc.update({**self.meta, **(extra or {})})
        (folder / "policy.json").write_text(json.dumps(doc, indent=2))
        # the scorer is named: it was the base policy's while training, whatever learned's default is
        policy = base_policy.replace(controller="learned", learned_path=".", scorer=base_policy.effective_scorer)
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
        obs_version = doc.get("obs_version")
        if doc.get("format") != "confkv-learned-policy" or obs_version not in OBS_VERSIONS:
            raise ConfkvError(f"{folder} is not a confkv learned policy of an observation layout this confkv knows "
                              f"({', '.join(map(str, OBS_VERSIONS))}; got {obs_version!r})")  # fmt: skip
        version = doc.get("format_version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfkvError(f"{folder}/policy.json: format_version must be a positive integer (got {version!r})")
        if version > FORMAT_VERSION:
            raise ConfkvError(f"{folder} is a learned policy of format {version}; this confkv reads formats up to "
                              f"{FORMAT_VERSION} (upgrade confkv)")  # fmt: skip
        try:
            layers = [(tensors[s["weight"]], tensors[s["bias"]], s["activation"]) for s in doc["layers"]]
            action = doc["action"]
            if version == 1:  # three thresholds, linear map, the knobs governed the segment after next
                space = legacy_space(doc.get("knob_bounds")) if action == "knobs" else None
                rule = "lagged"
            else:
                space = KnobSpace.from_json(doc["knobs"]) if action == "knobs" else None
                rule = doc.get("budget_rule", "replay")
        except (KeyError, TypeError, ValueError) as err:
            raise ConfkvError(f"{folder}/policy.json is incomplete or malformed: {err!r}") from None
        if action not in ("knobs", "budget") or rule not in BUDGET_RULES:
            raise ConfkvError(f"{folder}: unknown action {action!r} or budget rule {rule!r}")
        # checked here, not at the first decision inside an engine step: an activation this code does not apply
        # would run as none, and layers that do not chain from the observation fail on a tensor shape there
        width = obs_dim(obs_version)
        for i, (w, b, activation) in enumerate(layers):
            if activation not in ("tanh", "relu", "none"):
                raise ConfkvError(f"{folder}: layer {i} has activation {activation!r} (tanh, relu or none)")
            if w.dim() != 2 or w.shape[1] != width or b.shape != (w.shape[0],):
                raise ConfkvError(f"{folder}: layer {i} is {tuple(w.shape)} with bias {tuple(b.shape)}; its input "
                                  f"is {width} wide")  # fmt: skip
            width = w.shape[0]
        mlp = cls(layers=layers, action=action, meta={k: v for k, v in doc.items() if k in ("squash", "algo")},
                  space=space, budget_rule=rule, obs_version=obs_version)  # fmt: skip
        want = space.dim if space is not None else 3
        if mlp.out_dim != want:
            raise ConfkvError(f"{folder}: the network outputs {mlp.out_dim} values; its {action} action takes {want}")
        return mlp


# ------------------------------------------------------------------------------------------------ the controller
@dataclass(frozen=True)
class LearnedState(BudgetState):
    #: The knobs in force (``KNOB_NAMES`` order: thresholds, scaling, base_size, max_size).
    knobs: tuple[float, ...] = (3.5, 0.15, 0.8, 1024.0, 4096.0)
    segment: tuple[StepSignals, ...] = ()
    start: float = 0.0  # the budget the current segment started from (the replay rule's origin)
    hold: bool = False  # budget actions keep the budget still between decisions
    #: The recent segments' means (observation layout 2; ``push_history``), the latest last.
    history: tuple[SegmentMeans, ...] = ()


def apply_budget_action(budget: float, action: int, policy: CachePolicy) -> float:
    if action == 0:
        return budget - BUDGET_STEP * (budget - policy.base_size)
    if action == 2:
        return budget + BUDGET_STEP * (policy.max_size - budget)
    return budget


@CONTROLLERS.register
class LearnedController(DynamicController):
    """The dynamic rule with its knobs (or the budget itself) set by an exported policy every segment.

    The policy's ``base_size``/``max_size`` are the base the agent was trained around: the starting budget and
    knobs, and the most a prompt keeps while it is read; a decision may set other sizes within its knob space.
    """

    name = "learned"

    def __init__(self, policy: CachePolicy, mlp: MLPPolicy | None = None) -> None:
        super().__init__(policy)
        if mlp is None:
            if not policy.learned_path:
                raise ConfkvError("the learned controller needs learned_path (an exported policy folder)")
            mlp = MLPPolicy.load(policy.learned_path)
        self.mlp = mlp
        self.space = mlp.resolved_space(policy) if mlp.action == "knobs" else None
        self.budget_range = (
            self.space.budget_range(policy) if self.space is not None else (float(policy.base_size),
                                                                            float(policy.max_size))
        )  # fmt: skip

    def init_state(self) -> LearnedState:
        p = self.policy
        return LearnedState(budget=float(p.base_size), knobs=full_knobs(p), start=float(p.base_size))

    def adopt(self, state: BudgetState) -> LearnedState:
        st = super().adopt(state)
        return replace(st, start=st.budget)  # type: ignore[return-value]

    def derive(self, policy: CachePolicy) -> Controller:
        if policy.controller == "learned" and policy.learned_path == self.policy.learned_path:
            return LearnedController(policy, self.mlp)
        return super().derive(policy)

    def update(self, state: BudgetState, s: StepSignals) -> LearnedState:
        st = state if isinstance(state, LearnedState) else self.init_state()
        if st.hold:
            ent_t, gap_t, _, base_size, max_size = st.knobs
            uncertain = s.entropy > ent_t or s.gap < gap_t
            budget = min(float(max_size), max(float(base_size), st.budget))
        else:
            budget, uncertain = dynamic_update(st.budget, s, st.knobs)
        steps = st.steps + 1
        new = replace(st, budget=budget, uncertain=uncertain, steps=steps, segment=(*st.segment, s))
        if (steps - 1) % self.policy.compact_interval == 0:
            new = self.decide(new)
        return new

    def decide(self, st: LearnedState) -> LearnedState:
        history = push_history(st.history, st.segment) if self.mlp.obs_version == 2 else None
        obs = segment_observation(list(st.segment), st.budget, self.policy, budget_range=self.budget_range,
                                  history=history)  # fmt: skip
        st = replace(st, history=history or ())
        action = self.mlp.act(obs)
        if self.mlp.action == "budget":
            budget = apply_budget_action(st.budget, int(action), self.policy)
            return replace(st, budget=budget, start=budget, segment=(), hold=True)
        assert self.space is not None
        knobs = full_knobs(self.policy, self.space.knobs(action))
        replay = self.mlp.budget_rule == "replay" and knobs != st.knobs  # unchanged knobs replay to st.budget
        budget = replay_budget(st.start, st.segment, knobs) if replay else st.budget
        return replace(st, knobs=knobs, budget=budget, start=budget, segment=(), hold=False)
