"""The budget rules from the requirement: the fixed baselines and the confidence rule (``dynamic``).

Every rule here is a ``Controller`` (``confkv.controllers.base``) registered by name; ``window``, ``streaming``,
``h2o`` and ``snapkv`` are presets of ``fixed`` (a fixed budget of ``max_size``) with a scorer each.

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

from dataclasses import replace

from confkv.controllers.base import BudgetState, Controller, StepSignals
from confkv.plugins import CONTROLLERS


@CONTROLLERS.register
class FullController(Controller):
    """The reference: every token stays on the device."""

    name = "full"
    default_scorer = None
    evicts = False


class FixedController(Controller):
    """A fixed budget of ``max_size`` tokens, ranked by the policy's scorer (default: recency)."""

    name = "fixed"


@CONTROLLERS.register
class WindowController(FixedController):
    """Preset: the last ``max_size`` tokens, no sinks (fixed + recency)."""

    name = "window"
    default_scorer = "recency"
    preset = True

    @property
    def sink_tokens(self) -> int:
        return 0


@CONTROLLERS.register
class StreamingController(FixedController):
    """Preset, StreamingLLM: ``sink_tokens`` attention sinks plus the most recent tokens (fixed + recency)."""

    name = "streaming"
    default_scorer = "recency"
    preset = True


@CONTROLLERS.register
class H2OController(FixedController):
    """Preset: heavy hitters by accumulated attention plus the ``min_recent`` most recent tokens (fixed + h2o)."""

    name = "h2o"
    default_scorer = "h2o"
    preset = True


@CONTROLLERS.register
class SnapKVController(FixedController):
    """Preset: the prompt's last queries select what stays, then a sliding window (fixed + snapkv)."""

    name = "snapkv"
    default_scorer = "snapkv"
    preset = True


@CONTROLLERS.register
class DynamicController(Controller):
    """CONF-KV: the budget follows the model's confidence between ``base_size`` and ``max_size`` (any scorer)."""

    name = "dynamic"
    #: snapkv: at equal mean memory it lost less than h2o's accumulated attention on every workload measured
    #: (docs/history/2026-12-05-benchmarks.md, "Choices made"), and it records no decode attention, so decode steps
    #: keep the fused attention kernel.
    default_scorer = "snapkv"
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


CONTROLLERS.register(FixedController)  # after the presets: names are listed in the order users meet them
