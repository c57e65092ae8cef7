"""What every budget rule shares: the signals it reads, the state it carries, and the class it subclasses.

A cache policy is a budget rule (a ``Controller``) plus a block scorer (``confkv.scorers``). A controller's rule is
pure: ``update(state, signals) -> state`` and nothing else, so it can be unit-tested step by step, swapped between
engine steps, and replaced by a learned one. The cache manager turns the budget into block moves and asks the
controller's ``scorer`` which blocks to move; the scorer tells the attention function what to record.
Adding a rule is one module with one subclass, registered by name with ``@CONTROLLERS.register``.
"""

from __future__ import annotations

import math
from abc import ABC
from dataclasses import dataclass, replace
from typing import ClassVar

from confkv.config import CachePolicy
from confkv.errors import ConfkvError
from confkv.plugins import CONTROLLERS, SCORERS
from confkv.scorers.base import BlockScorer, DecodeRecord, PrefillRecord


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
    #: The scorer the rule ranks blocks with when the policy names none (``None``: it never evicts).
    default_scorer: ClassVar[str | None] = "recency"
    #: A preset always ranks with its ``default_scorer`` (``window``, ``streaming``, ``h2o``, ``snapkv``).
    preset: ClassVar[bool] = False
    #: Whether the policy ever removes KV from the device (``full`` does not).
    evicts: ClassVar[bool] = True
    #: Whether expansion brings evicted blocks back from the host tier (and recomputes the step).
    recalls: ClassVar[bool] = False

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        name = policy.effective_scorer
        self.scorer: BlockScorer | None = SCORERS.lookup(name)(policy) if self.evicts and name else None

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


def make_controller(policy: CachePolicy) -> Controller:
    """The registered controller class the policy names, built for it (``ConfkvError`` when it cannot be)."""
    try:
        cls = CONTROLLERS.lookup(policy.controller)
    except ValueError as err:
        raise ConfkvError(str(err), param="controller") from None
    return cls(policy)
