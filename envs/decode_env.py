"""The environment in free-decoding mode: the engine generates, the agent steers, the full cache's answer judges.

An episode is a generation item (a long answer, a chat reply or a pass-key answer) decoded greedily by the engine;
a step applies the agent's action to the sequence's controller, moves its applied budget at once (the replay rule of
``envs.env``) and runs ``compact_interval`` decode steps. The prompt is read before the first decision here (a
pass-key episode is its answer only; the teacher-forced environment is where the agent acts during the haystack).
Without a fixed token sequence there is no per-token KL to the full cache, so quality loss is divergence: the share
of the segment's tokens generated after the output first departed from the full cache's own greedy answer (for a
pass key, from the true key). Reward:

    memory_weight * (1 - resident fraction) - quality_weight * divergence   (+ task_weight for a correct key)

With ``shaping`` (training only), a step also returns the headroom shaping of ``envs.env.Shaping``; episode
summaries keep the plain reward.

Observation and actions are those of the teacher-forced ``ConfKVEnv``, so an agent trained in either mode runs
in both and in the engine. Decoding costs one forward pass per token, so this mode is slower to train on.
"""

from __future__ import annotations

import itertools
from typing import Any

import gymnasium as gym
import numpy as np

from confkv.controllers import BudgetState, StepSignals
from confkv.controllers.observation import SegmentMeans, push_history, segment_observation
from confkv.engine.params import SamplingParams
from confkv.engine.sequence import Sequence
from envs.env import (
    ReadController,
    RewardWeights,
    Shaping,
    action_space,
    after_read,
    budget_range,
    decide,
    observation_space,
)
from envs.episodes import Episode, TuneData


class ConfKVDecodeEnv(gym.Env):
    metadata = {"render_modes": []}  # noqa: RUF012

    def __init__(
        self, data: TuneData, action: str = "knobs", weights: RewardWeights | None = None,
        shaping: Shaping | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.data = data
        self.kind = action
        self.weights = weights or RewardWeights()
        self.shaping = shaping
        self.space = data.knob_space()
        self.budget_range = budget_range(action, data.base_policy, self.space)
        self.observation_space = observation_space(data.obs_version)
        self.action_space = action_space(action, self.space)
        self.episodes = [ep for ep in data.episodes if ep.workload != "prose"]
        if not self.episodes:
            raise ValueError("free decoding needs generation episodes (longgen, chat or passkey)")
        self.llm = data.llm(max_batch_size=1)
        self.engine = self.llm.engine
        self._ids = itertools.count()
        self._rid: str | None = None
        self._episode: Episode | None = None
        self._reference: list[int] = []
        self._seen = 0
        self._seen_div = 0
        self._diverged = False
        self._totals: dict[str, float] = {}
        self._segment: list[StepSignals] = []  # the latest segment's signals (what the next decision replays)
        self._start = 0.0  # the budget that segment started from
        self._history: tuple[SegmentMeans, ...] | None = None  # recent segment means (observation layout 2)

    # ------------------------------------------------------------------------------------------------- helpers
    def _seq(self) -> Sequence | None:
        return self.engine.sequence(self._rid) if self._rid else None

    def _run(self, tokens: int) -> tuple[Sequence, bool]:
        """Decode up to ``tokens`` more tokens; returns the sequence and whether it finished."""
        seq = self._seq()
        assert seq is not None
        target = len(seq.output_token_ids) + tokens
        while len(seq.output_token_ids) < target:
            finished = any(o.finished for o in self.engine.step() if o.request_id == self._rid)
            if finished:
                return seq, True
        return seq, False

    def _segment_since(self, seq: Sequence) -> list[StepSignals]:
        """The signals the controller decided on for the tokens generated since the last decision (after a recall
        the first pass's, as a ``LearnedController`` in serving sees them); kept for the next decision's replay."""
        out = list(seq.decided_on[self._seen :])
        self._segment = out
        return out

    def _observe(self, seq: Sequence, segment: list[StepSignals], first: bool = False) -> np.ndarray:
        if self.data.obs_version == 2:
            self._history = push_history(() if first else self._history or (), segment)
        return segment_observation(segment, seq.ctrl.budget, self.data.base_policy, budget_range=self.budget_range,
                                   history=self._history)  # fmt: skip

    # --------------------------------------------------------------------------------------------------- gym api
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        if self._rid is not None:
            self.engine.abort_request(self._rid)
        i = (options or {}).get("episode")
        if i is None:
            i = int(self.np_random.integers(len(self.episodes)))
        ep = self._episode = self.episodes[i]
        item = ep.item
        self._reference = item.token_ids[ep.prompt_len :]
        self._rid = f"env-{next(self._ids)}"
        params = SamplingParams(max_tokens=len(self._reference), ignore_eos=True)
        self.engine.add_request(self._rid, item.token_ids[: ep.prompt_len], params)
        seq = self._seq()
        assert seq is not None
        seq.controller = reader = ReadController(self.data.base_policy, self.budget_range[1])
        seq.ctrl = BudgetState(budget=reader.hold)
        self._seen = 0
        self._seen_div = 0
        self._diverged = False
        self._totals = {"reward": 0.0, "kv_fraction": 0.0, "divergence": 0.0, "steps": 0.0}
        seq, _ = self._run(1)
        segment = self._segment_since(seq)
        self._start = after_read(seq, self.data.base_policy, segment)
        self._seen = len(seq.trace.entropy)
        self._update_divergence(seq)
        return self._observe(seq, segment, first=True), {"episode_index": i, "item": ep.item_id}

    def _update_divergence(self, seq: Sequence) -> list[bool]:
        """Per new token: whether the output had departed from the reference by then."""
        out = seq.output_token_ids
        flags = []
        for j in range(self._seen_div, len(out)):
            if not self._diverged and (j >= len(self._reference) or out[j] != self._reference[j]):
                self._diverged = True
            flags.append(self._diverged)
        self._seen_div = len(out)
        return flags

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self._rid is None or self._episode is None:
            raise RuntimeError("call reset() first")
        seq = self._seq()
        if seq is None:
            raise RuntimeError("the episode has ended; call reset()")
        before = float(seq.ctrl.budget)  # the state the shaping starts from
        d = decide(action, self.kind, self.data.base_policy, self.space, self._segment, self._start, seq.ctrl.budget,
                   seq.controller.policy)  # fmt: skip
        seq.controller = d.controller
        self.engine.resize(seq.request_id, d.budget)
        self._start = d.budget
        applied = d.applied
        seq, done = self._run(self.data.base_policy.compact_interval)
        segment = self._segment_since(seq)
        # memory as each token was computed (after a recall, with what came back: the trace's, not the decision's)
        n0, resident = seq.num_prompt_tokens, seq.trace.resident
        held = [resident[i] / max(1, n0 + i) for i in range(self._seen, len(resident))]
        self._seen = len(seq.trace.entropy)
        flags = self._update_divergence(seq)
        fraction = float(np.mean(held)) if held else 1.0
        divergence = float(np.mean(flags)) if flags else 0.0
        w = self.weights
        reward = w.memory_weight * (1.0 - fraction) - w.quality_weight * divergence
        info: dict[str, Any] = {"kv_fraction": fraction, "divergence": divergence, "action": applied}
        tot = self._totals
        tot["kv_fraction"] += fraction
        tot["divergence"] += divergence
        tot["steps"] += 1
        if done:
            ep = self._episode
            if ep.task is not None:
                text = self.engine.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
                key = self.engine.tokenizer.decode(self._reference, skip_special_tokens=True).strip()
                info["task_correct"] = float(key in text)
                reward += w.task_weight * info["task_correct"]
            tot["reward"] += reward
            info["episode"] = {"r": tot["reward"], "l": int(tot["steps"]), "t": 0.0}
            info["summary"] = {
                "item": ep.item_id, "workload": ep.workload, "reward": tot["reward"],
                "kv_fraction": tot["kv_fraction"] / tot["steps"], "divergence": tot["divergence"] / tot["steps"],
                "output_token_ids": list(seq.output_token_ids), "budgets": list(seq.trace.budget),
                **({"task_correct": info["task_correct"]} if "task_correct" in info else {}),
            }  # fmt: skip
            self._rid = None
        else:
            tot["reward"] += reward
        if self.shaping is not None:  # after the totals: summaries keep the plain reward
            info["shaping"] = self.shaping.term(before, float(seq.ctrl.budget), self.budget_range)
            reward += info["shaping"]
        return self._observe(seq, segment), float(reward), done, False, info

    def close(self) -> None:
        if self._rid is not None:
            self.engine.abort_request(self._rid)
            self._rid = None
