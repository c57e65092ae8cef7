"""A gymnasium environment over the engine: one episode is one workload item, one step one segment.

A step (1) turns the agent's action into a controller and a budget (``decide``: the dynamic rule's five knobs, or a
direct budget change; see ``confkv.controllers.learned``), (2) moves the sequence's applied budget there at once
(``LLMEngine.resize``: evicting, or recalling host blocks scored by the newest query), (3) scores the next
``compact_interval`` tokens teacher-forced under that controller and returns

    reward = memory_weight * (1 - resident fraction of the segment) - quality_weight * (mean KL to full)

plus, on the last step of a pass-key or multi-key episode, ``task_weight`` if every answer token was the policy's
top-1 choice. So the segment a step is rewarded for is the one its action governed, the last action included.

With ``reference`` (``envs.evaluate.reference_rewards``), a step returns its reward minus what the base policy earns
on the same segment of the same item. The subtracted term depends on the item and the step, never on the agent's
actions, so it changes no policy's ranking; it removes the spread of returns between items (one prose text's KL is
several times another's, a retrieval episode carries a task reward the base policy earns or not), which otherwise
dominates the advantages an agent learns from. Episode summaries and evaluations keep the plain reward.

With ``shaping`` (``Shaping``, training only: ``confkv-tune train --shaping-headroom K``), a step also returns
``gamma * Phi(s') - Phi(s)`` with ``Phi = K x headroom``, the share of the budget range left above the sequence's
budget (Ng, Harada & Russell 1999): a contraction is paid at once for the room it leaves, an expansion charged at
once, where the plain reward pays contracting through a haystack only through an answer segments later. Over an
episode the terms telescope (at gamma 1, to ``Phi(end) - Phi(start)``). Episode summaries and every evaluation
keep the plain reward (``envs.evaluate`` builds its own environments, without shaping).

The budget a knobs action implies (the *replay rule*): the budget the new knobs reach when replayed over the latest
segment's signals from the budget that segment started with. A constant action replays to exactly the budget the
rule already reached, so the fixed rule run as an agent is the engine's own ``dynamic`` policy; an exported agent
decides the same way inside the engine (``LearnedController``).

``ConfKVVecEnv`` runs N episodes as one engine batch (one forward pass per step for all of them) and is what
stable-baselines3 trains on; ``ConfKVEnv`` is the single-episode form the checkers validate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.vec_env import VecEnv

from confkv.config import CachePolicy
from confkv.controllers import BudgetState, DynamicController, StepSignals
from confkv.controllers.learned import KnobSpace, apply_budget_action, full_knobs, replay_budget
from confkv.controllers.observation import OBS_VERSION, SegmentMeans, obs_dim, push_history, segment_observation
from confkv.errors import ConfkvError
from confkv.scoring import ItemState, Scorer, ScoringSession
from envs.episodes import Episode, TuneData

ACTIONS = ("knobs", "budget")


@dataclass(frozen=True)
class RewardWeights:
    memory_weight: float = 1.0
    quality_weight: float = 2.0
    task_weight: float = 1.0

    def __post_init__(self) -> None:
        # NaN passes every range check and compares false with everything: a reward, a comparison of runs or a
        # promotion gate built on it would be decided by accident
        for f in fields(self):
            if not math.isfinite(value := getattr(self, f.name)):
                raise ConfkvError(f"--{f.name.replace('_', '-')} must be a finite number (got {value})")


@dataclass(frozen=True)
class Shaping:
    """Potential-based shaping on the budget's headroom: ``Phi(s) = weight x (hi - budget) / (hi - lo)`` over the
    budget range ``(lo, hi)`` (for a budget action ``base_size`` to ``max_size``), added to each training step as
    ``gamma * Phi(after) - Phi(before)`` with the agent's own discount, so that the discounted shaping of a whole
    episode is ``gamma^T Phi(end) - Phi(start)``: a budget action is paid the headroom it creates in its own step.
    The end state keeps its potential (it is not zeroed as an absorbing state would be), so the objective gains
    ``gamma^T x weight x headroom(end)``, at most ``weight``: the one term that is not policy-invariant."""

    weight: float
    gamma: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ConfkvError(f"--shaping-headroom must be a finite number above 0 (got {self.weight})")
        if not (math.isfinite(self.gamma) and 0 <= self.gamma <= 1):
            raise ConfkvError(f"the shaping's discount must be in [0, 1] (got {self.gamma})")

    def potential(self, budget: float, lo_hi: tuple[float, float]) -> float:
        """``weight`` x the share of the range ``lo_hi`` that ``budget`` leaves below its top (clipped to [0, 1])."""
        lo, hi = lo_hi
        if hi <= lo:
            return 0.0
        return self.weight * min(1.0, max(0.0, (hi - float(budget)) / (hi - lo)))

    def term(self, before: float, after: float, lo_hi: tuple[float, float]) -> float:
        """The shaping of one step whose state's budget went from ``before`` to ``after``."""
        return self.gamma * self.potential(after, lo_hi) - self.potential(before, lo_hi)


def observation_space(version: int = OBS_VERSION) -> spaces.Box:
    """The observation of layout ``version`` (``confkv.controllers.learned``): every entry in [0, 1]."""
    return spaces.Box(0.0, 1.0, (obs_dim(version),), dtype=np.float32)


def action_space(action: str, space: KnobSpace | None = None) -> spaces.Space:
    """``knobs``: one coordinate in [-1, 1] per knob of ``space`` (default five); ``budget``: contract/hold/expand."""
    if action == "knobs":
        return spaces.Box(-1.0, 1.0, (space.dim if space is not None else 5,), dtype=np.float32)
    if action == "budget":
        return spaces.Discrete(3)
    raise ValueError(f"action must be one of {ACTIONS} (got {action!r})")


def knob_space(base: CachePolicy) -> KnobSpace:
    """The space the agents act in: the same as Optuna's (``tuner.search``), around the base policy."""
    return KnobSpace.for_policy(base)


def budget_range(kind: str, base: CachePolicy, space: KnobSpace) -> tuple[float, float]:
    return space.budget_range(base) if kind == "knobs" else (float(base.base_size), float(base.max_size))


def segment_signals(st: ItemState, pool_usage: float) -> list[StepSignals]:
    last = st.last
    return [
        StepSignals(e, g, t, r, p, pool_usage)
        for e, g, t, r, p in zip(
            last["entropy"].tolist(),
            last["gap"].tolist(),
            last["top1_prob"].tolist(),
            last["resident"].tolist(),
            last["full"].tolist(),
            strict=True,
        )
    ]


def observe(
    st: ItemState, base: CachePolicy, pool_usage: float, lo_hi: tuple[float, float] | None = None,
    history: tuple[SegmentMeans, ...] | None = None,
) -> np.ndarray:  # fmt: skip
    """The observation after ``st``'s latest segment; ``history`` (layout 2) already holds that segment."""
    return segment_observation(segment_signals(st, pool_usage), st.seq.ctrl.budget, base, budget_range=lo_hi,
                               history=history)  # fmt: skip


class ReadController(DynamicController):
    """The base policy while an episode's context is read and its first token scored, except that the budget stays
    at ``hold`` (the most any first decision can set), so the prompt is trimmed once, by the first decision's
    ``resize``, to the budget the first action implies: what the engine does for an exported policy, whose first
    decision comes with the first token. (Trimming to the rule's budget first and expanding after would need a
    recall, and the prompt's last query is not kept when nothing was on the host yet.) A prompt longer than
    ``max_size`` is still trimmed to it while it is read, as under the base policy."""

    def __init__(self, policy: CachePolicy, hold: float | None = None) -> None:
        super().__init__(policy)
        self.hold = float(hold) if hold is not None else self.max_budget

    def init_state(self) -> BudgetState:
        return BudgetState(budget=self.hold)

    def update(self, state: BudgetState, s: StepSignals) -> BudgetState:
        return replace(state, uncertain=self.is_uncertain(s), steps=state.steps + 1)


def after_read(seq: Any, base: CachePolicy, segment: list[StepSignals]) -> float:
    """Give a sequence read under ``ReadController`` the budget the base rule reached over its first segment (what
    a first decision that keeps the base knobs applies), without moving the applied budget; returns where the base
    rule started (the first replay's origin)."""
    start = float(base.base_size)
    seq.ctrl = replace(seq.ctrl, budget=replay_budget(start, segment, full_knobs(base)))
    return start


@dataclass
class Decision:
    """What an action does to a sequence: the controller for its next segment and the budget applied at once."""

    controller: DynamicController
    budget: float
    applied: dict[str, float]


def decide(
    action: Any, kind: str, base: CachePolicy, space: KnobSpace, segment: list[StepSignals], start: float,
    current: float, in_force: CachePolicy | None = None,
) -> Decision:  # fmt: skip
    """The controller and budget an action implies, given the latest segment's signals, the budget that segment
    started from (``start``), the controller's budget now (``current``) and the policy it ran under (``in_force``).

    ``knobs``: the dynamic rule under the new knobs, at the budget they reach replayed over ``segment`` from
    ``start`` (the replay rule); knobs equal to those in force keep ``current``, which is what the replay gives
    (exactly, teacher-forced; in free decoding a recomputed step's recorded signals differ from the ones the rule
    saw, and this keeps a constant agent equal to the engine's rule there too). ``budget``: the budget moved a fifth
    of the way (or held), then kept still.
    """
    if kind == "knobs":
        knobs = space.knobs(action)
        controller = DynamicController(base.replace(**knobs))
        if in_force is not None and all(getattr(in_force, k) == v for k, v in knobs.items()):
            return Decision(controller, current, {**knobs, "budget": current})
        state = BudgetState(budget=controller.clamp(start))
        for s in segment:
            state = controller.update(state, s)
        return Decision(controller, state.budget, {**knobs, "budget": state.budget})
    if kind != "budget":
        raise ValueError(f"action must be one of {ACTIONS} (got {kind!r})")
    budget = apply_budget_action(current, int(np.asarray(action).reshape(-1)[0]), base)
    return Decision(DynamicController(base.replace(scaling_factor=1.0)), budget, {"budget": budget})


def reward_of(weights: RewardWeights, resident: torch.Tensor, full: torch.Tensor, kl: torch.Tensor | None) -> float:
    """A segment's reward from its tokens' resident keys, full-cache keys and KL."""
    fraction = float((resident.float() / full.float()).mean())
    quality = float(kl.mean()) if kl is not None else 0.0
    return weights.memory_weight * (1.0 - fraction) - weights.quality_weight * quality


def segment_reward(st: ItemState, episode: Episode, weights: RewardWeights) -> tuple[float, dict[str, float]]:
    last = st.last
    fraction = float((last["resident"].float() / last["full"].float()).mean())
    kl = float(last["kl"].mean()) if "kl" in last else 0.0
    reward = reward_of(weights, last["resident"], last["full"], last.get("kl"))
    info = {"kv_fraction": fraction, "kl": kl, "nll": float(-last["token_logprobs"].mean())}
    if st.done and episode.task is not None:
        a, b = episode.task
        matches = st.rows["greedy_match"]
        correct = bool(torch.cat(matches)[a:b].all())
        reward += weights.task_weight * float(correct)
        info["task_correct"] = float(correct)
    return reward, info


class _Slots:
    """Episodes in flight on one scoring session, one per slot."""

    def __init__(
        self, data: TuneData, n: int, kind: str, weights: RewardWeights,
        reference: dict[str, list[float]] | None = None, shaping: Shaping | None = None,
    ) -> None:  # fmt: skip
        self.data = data
        self.kind = kind
        self.weights = weights
        self.reference = reference
        self.shaping = shaping
        self.space = data.knob_space()
        self.budget_range = budget_range(kind, data.base_policy, self.space)
        self.llm = data.llm(max_batch_size=max(n, 1))
        self.engine = self.llm.engine
        self.session: ScoringSession = Scorer(self.engine).session()
        self.index: list[int | None] = [None] * n
        self.episode: list[Episode | None] = [None] * n
        self.totals: list[dict[str, float]] = [{} for _ in range(n)]
        self.start_budget: list[float] = [0.0] * n  # the budget each slot's current segment started from
        #: Each slot's recent segment means (observation layout 2; None for layout 1): what a ``LearnedController``
        #: of that layout keeps in its state
        self.history: list[tuple[SegmentMeans, ...] | None] = [None] * n

    def _observe(self, slot: int, st: ItemState, usage: float, first: bool = False) -> np.ndarray:
        """The slot's observation after its latest segment, the segment pushed onto its history first."""
        if self.data.obs_version == 2:
            signals = segment_signals(st, usage)
            self.history[slot] = push_history(() if first else self.history[slot] or (), signals)
        return observe(st, self.data.base_policy, usage, self.budget_range, self.history[slot])

    def start(self, slot: int, episode: Episode) -> np.ndarray:
        """Begin ``episode`` in ``slot``: read its prompt and first token alone; returns the first observation."""
        base = self.data.base_policy
        idx = self.session.add(episode.item, ReadController(base, self.budget_range[1]))
        self.index[slot], self.episode[slot] = idx, episode
        self.totals[slot] = {"reward": 0.0, "kv_fraction": 0.0, "kl": 0.0, "steps": 0.0}
        st = None
        while st is None or not st.last:
            self.session.step(only={idx})
            st = self.session.state(idx)
            if st is None:  # a one-token episode finished while being read
                raise RuntimeError("episode too short to observe")
        self.start_budget[slot] = after_read(st.seq, base, segment_signals(st, self.engine.pool.usage))
        return self._observe(slot, st, self.engine.pool.usage, first=True)

    def advance(self, actions: list[Any]) -> list[tuple[np.ndarray, float, bool, dict[str, Any]]]:
        return self.advance_some(list(range(len(actions))), actions)

    def advance_some(
        self, slots: list[int], actions: list[Any]
    ) -> list[tuple[np.ndarray, float, bool, dict[str, Any]]]:
        """Apply each slot's action (controller and budget, at once), score one more segment of those slots together
        under it, return what each saw."""
        base = self.data.base_policy
        states = {slot: self.session.state(self.index[slot]) for slot in slots}  # type: ignore[arg-type]
        applied = {}
        before: dict[int, float] = {}  # each slot's budget before its action: the state the shaping starts from
        usage = self.engine.pool.usage
        for slot, action in zip(slots, actions, strict=True):
            st = states[slot]
            assert st is not None, "slot has no running episode"
            before[slot] = float(st.seq.ctrl.budget)
            d = decide(action, self.kind, base, self.space, segment_signals(st, usage), self.start_budget[slot],
                       st.seq.ctrl.budget, st.controller.policy)  # fmt: skip
            st.controller = d.controller
            self.engine.resize(st.seq.request_id, d.budget)
            self.start_budget[slot] = d.budget
            applied[slot] = d.applied
        self.session.step(only={st.index for st in states.values() if st is not None})
        out = []
        usage = self.engine.pool.usage
        for slot in slots:
            st, episode = states[slot], self.episode[slot]
            assert st is not None and episode is not None
            reward, info = segment_reward(st, episode, self.weights)
            info["action"] = applied[slot]
            tot = self.totals[slot]
            returned = reward - self._reference(episode, int(tot["steps"]))
            if self.shaping is not None:
                info["shaping"] = self.shaping.term(before[slot], float(st.seq.ctrl.budget), self.budget_range)
                returned += info["shaping"]
            tot["reward"] += reward
            tot["kv_fraction"] += info["kv_fraction"]
            tot["kl"] += info["kl"]
            tot["steps"] += 1
            if st.done:
                # "episode" in stable-baselines3's Monitor format, "summary" with the memory and quality figures
                info["episode"] = {"r": tot["reward"], "l": int(tot["steps"]), "t": 0.0}
                info["summary"] = {
                    "item": episode.item_id,
                    "workload": episode.workload,
                    "reward": tot["reward"],
                    "kv_fraction": tot["kv_fraction"] / tot["steps"],
                    "kl": tot["kl"] / tot["steps"],
                    **({"task_correct": info["task_correct"]} if "task_correct" in info else {}),
                }
            out.append((self._observe(slot, st, usage), returned, st.done, info))
        return out

    def _reference(self, episode: Episode, step: int) -> float:
        if self.reference is None:
            return 0.0
        steps = self.reference.get(episode.item_id)
        if steps is None or step >= len(steps):
            raise KeyError(f"no reference reward for step {step} of item {episode.item_id!r}")
        return steps[step]

    def close(self) -> None:
        self.session.close()


class ConfKVEnv(gym.Env):
    """One episode at a time; ``reset(options={"episode": i})`` picks an episode, else a seeded random one."""

    metadata = {"render_modes": []}  # noqa: RUF012

    def __init__(
        self, data: TuneData, action: str = "knobs", weights: RewardWeights | None = None,
        reference: dict[str, list[float]] | None = None, shaping: Shaping | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.data = data
        self.observation_space = observation_space(data.obs_version)
        self.action_space = action_space(action, data.knob_space())
        self._slots = _Slots(data, 1, action, weights or RewardWeights(), reference, shaping)
        self._live = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        if self._live:
            self._slots.close()
            self._slots.session = Scorer(self._slots.engine).session()
        i = (options or {}).get("episode")
        if i is None:
            i = int(self.np_random.integers(len(self.data.episodes)))
        obs = self._slots.start(0, self.data.episodes[i])
        self._live = True
        return obs, {"episode_index": i, "item": self.data.episodes[i].item_id}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if not self._live:
            raise RuntimeError("call reset() first")
        ((obs, reward, done, info),) = self._slots.advance([action])
        if done:
            self._live = False
        return obs, float(reward), done, False, info

    def close(self) -> None:
        self._slots.close()


class ConfKVVecEnv(VecEnv):
    """N episodes stepped as one engine batch (stable-baselines3's ``VecEnv``; auto-resets finished slots)."""

    def __init__(
        self, data: TuneData, n_envs: int, action: str = "knobs", weights: RewardWeights | None = None, seed: int = 0,
        reference: dict[str, list[float]] | None = None, shaping: Shaping | None = None,
    ) -> None:  # fmt: skip
        self.render_mode = None
        super().__init__(n_envs, observation_space(data.obs_version), action_space(action, data.knob_space()))
        self.data = data
        self._slots = _Slots(data, n_envs, action, weights or RewardWeights(), reference, shaping)
        self._rng = np.random.default_rng(seed)
        self._actions: list[Any] = []

    def _pick(self) -> Episode:
        return self.data.episodes[int(self._rng.integers(len(self.data.episodes)))]

    def reset(self) -> np.ndarray:
        self._slots.close()
        self._slots.session = Scorer(self._slots.engine).session()
        return np.stack([self._slots.start(i, self._pick()) for i in range(self.num_envs)])

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = list(actions)

    def step_wait(self):
        results = self._slots.advance(self._actions)
        obs, rewards, dones, infos = [], [], [], []
        for slot, (o, r, d, info) in enumerate(results):
            if d:
                info["terminal_observation"] = o
                o = self._slots.start(slot, self._pick())
            obs.append(o)
            rewards.append(r)
            dones.append(d)
            infos.append(info)
        return np.stack(obs), np.array(rewards, dtype=np.float32), np.array(dones), infos

    def seed(self, seed: int | None = None) -> list[int | None]:
        self._rng = np.random.default_rng(seed)
        return [seed] * self.num_envs

    def close(self) -> None:
        self._slots.close()

    def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
        return [getattr(self, attr_name)] * len(self._indices(indices))

    def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
        setattr(self, attr_name, value)

    def env_method(self, method_name: str, *args: Any, indices: Any = None, **kwargs: Any) -> list[Any]:
        return [getattr(self, method_name)(*args, **kwargs)] * len(self._indices(indices))

    def env_is_wrapped(self, wrapper_class: type, indices: Any = None) -> list[bool]:
        return [False] * len(self._indices(indices))

    def _indices(self, indices: Any) -> list[int]:
        if indices is None:
            return list(range(self.num_envs))
        return [indices] if isinstance(indices, int) else list(indices)
