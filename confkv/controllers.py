"""What sets each sequence's KV budget: the confidence rule from the requirement and the fixed baselines.

A cache policy is a budget rule (this module) plus a block scorer (``confkv.scorers``). A controller's budget rule is
pure: ``update(state, signals) -> state`` and nothing else, so it can be unit-tested step by step, swapped between
engine steps, and replaced by a learned one. The cache manager turns the budget into block moves and asks the
controller's ``scorer`` which blocks to move; the scorer tells the attention function what to record.

The ``dynamic`` rule, exactly. With ``a = 1 - scaling_factor`` and ``B`` the budget in tokens (starting at
``base_size``), after every computed token:

* the step is *uncertain* when ``entropy > entropy_threshold`` or ``top1 - top2 < gap_threshold``;
* uncertain: ``B <- B + a * (max_size - B)`` (expand a fraction ``a`` of the way to ``max_size``);
* confident: ``B <- B - a * (B - base_size)`` (contract a fraction ``a`` of the way back to ``base_size``).

``scaling_factor = 1`` keeps the budget still; the requirement's 0.8 moves it 20% of the remaining way per step.
Expansion takes effect at once (the cache manager recalls host blocks and the step is recomputed); contraction is
applied every ``compact_interval`` tokens, so a run of confident tokens does not evict a block per token.
"""

from __future__ import annotations

import math
from abc import ABC
from dataclasses import dataclass, replace
from typing import ClassVar

from confkv.config import CachePolicy
from confkv.scorers import BlockScorer, make_scorer
from confkv.scorers.base import DecodeRecord, PrefillRecord


@dataclass(frozen=True)
class StepSignals:
    """One sequence's confidence at one step, on the host, with the context a learned controller observes."""

    entropy: float
    gap: float
    top1_prob: float
    resident: int = 0  # keys the step attended over
    position: int = 0  # tokens so far (what a full cache would hold)
    pool_usage: float = 0.0


@dataclass(frozen=True)
class BudgetState:
    """A sequence's controller state; learned controllers may subclass it to carry more."""

    budget: float
    uncertain: bool = False
    steps: int = 0


class Controller(ABC):
    """Base class: a fixed budget of ``max_size`` tokens, blocks ranked by the policy's scorer."""

    name: ClassVar[str]
    #: Whether the policy ever removes KV from the device (``full`` does not).
    evicts: ClassVar[bool] = True
    #: Whether expansion brings evicted blocks back from the host tier (and recomputes the step).
    recalls: ClassVar[bool] = False

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        name = policy.effective_scorer
        self.scorer: BlockScorer | None = make_scorer(name, policy) if self.evicts and name else None

    @property
    def prefill_attention(self) -> PrefillRecord:
        """Which prefill queries' attention the attention function records (for the scorer)."""
        return self.scorer.prefill_attention if self.scorer else "none"

    @property
    def decode_attention(self) -> DecodeRecord:
        return self.scorer.decode_attention if self.scorer else "none"

    @property
    def decode_decay(self) -> float:
        return self.scorer.decode_decay if self.scorer else 1.0

    @property
    def prefill_window(self) -> int:
        return self.scorer.prefill_window if self.scorer else 0

    @property
    def sink_tokens(self) -> int:
        return self.policy.sink_tokens

    @property
    def protected_recent(self) -> int:
        """Most recent tokens the cache manager may not evict."""
        return min(self.policy.min_recent, max(0, self.policy.max_size - self.sink_tokens))

    @property
    def max_budget(self) -> float:
        return float(self.policy.max_size) if self.evicts else math.inf

    def init_state(self) -> BudgetState:
        return BudgetState(budget=self.max_budget)

    def is_uncertain(self, s: StepSignals) -> bool:
        """The requirement's test, recorded for every policy so runs can be compared on the same signals."""
        return s.entropy > self.policy.entropy_threshold or s.gap < self.policy.gap_threshold

    def update(self, state: BudgetState, s: StepSignals) -> BudgetState:
        return replace(state, uncertain=self.is_uncertain(s), steps=state.steps + 1)

    def adopt(self, state: BudgetState) -> BudgetState:
        """The state a running sequence carries into this controller when the policy is swapped under it.

        A fixed policy has one budget, so only the step count carries over; ``dynamic`` keeps the budget.
        """
        return replace(self.init_state(), steps=state.steps)

    def derive(self, policy: CachePolicy) -> Controller:
        """A controller for a variant of this policy (a request's overrides), sharing anything already loaded."""
        return make_controller(policy)


class FullController(Controller):
    """The reference: every token stays on the device."""

    name = "full"
    evicts = False


class FixedController(Controller):
    """A fixed budget of ``max_size`` tokens, ranked by the policy's scorer (default: recency)."""

    name = "fixed"


class WindowController(FixedController):
    """Preset: the last ``max_size`` tokens, no sinks (fixed + recency)."""

    name = "window"

    @property
    def sink_tokens(self) -> int:
        return 0


class StreamingController(FixedController):
    """Preset, StreamingLLM: ``sink_tokens`` attention sinks plus the most recent tokens (fixed + recency)."""

    name = "streaming"


class H2OController(FixedController):
    """Preset: heavy hitters by accumulated attention plus the ``min_recent`` most recent tokens (fixed + h2o)."""

    name = "h2o"


class SnapKVController(FixedController):
    """Preset: the prompt's last queries select what stays, then a sliding window (fixed + snapkv)."""

    name = "snapkv"


class DynamicController(Controller):
    """CONF-KV: the budget follows the model's confidence between ``base_size`` and ``max_size`` (any scorer)."""

    name = "dynamic"
    recalls = True

    @property
    def protected_recent(self) -> int:
        return self.policy.min_recent

    def init_state(self) -> BudgetState:
        return BudgetState(budget=float(self.policy.base_size))

    def clamp(self, budget: float) -> float:
        return min(float(self.policy.max_size), max(float(self.policy.base_size), budget))

    def adopt(self, state: BudgetState) -> BudgetState:
        """Keep the running budget, clamped to this policy's ``[base_size, max_size]`` (a full cache's: max)."""
        return replace(self.init_state(), budget=self.clamp(state.budget), uncertain=state.uncertain, steps=state.steps)

    def update(self, state: BudgetState, s: StepSignals) -> BudgetState:
        p = self.policy
        rate = 1.0 - p.scaling_factor
        uncertain = self.is_uncertain(s)
        if uncertain:
            budget = state.budget + rate * (p.max_size - state.budget)
        else:
            budget = state.budget - rate * (state.budget - p.base_size)
        budget = min(float(p.max_size), max(float(p.base_size), budget))
        return BudgetState(budget=budget, uncertain=uncertain, steps=state.steps + 1)


CONTROLLERS: dict[str, type[Controller]] = {
    c.name: c
    for c in (
        FullController,
        FixedController,
        WindowController,
        StreamingController,
        H2OController,
        SnapKVController,
        DynamicController,
    )
}


def make_controller(policy: CachePolicy) -> Controller:
    if policy.controller == "learned":
        from confkv.learned import LearnedController

        return LearnedController(policy)
    return CONTROLLERS[policy.controller](policy)
