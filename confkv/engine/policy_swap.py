"""The engine's policy, and swapping it between two steps without a restart (hot swap).

A new policy is built and validated before anything changes (a learned policy's network is loaded then, on the
caller's thread, outside any step), handed over under a lock by ``request`` from any thread, and swapped in at the
start of the next step, so it always lands between two steps. What carries over for every live sequence: its KV in
every tier, block importance, the applied budget (clamped to the new policy's ``max_size``), the controller's budget
(``Controller.adopt``: ``dynamic`` keeps it clamped to its range, fixed policies use their size) and the compaction
tick. What resets: a learned controller's knobs and segment. Per-request overrides are put on top of the new policy;
a request whose overrides do not apply to it (a scorer the new preset does not take, a ``base_size`` above its
``max_size``) finishes under the policy it had. A smaller budget is reached by the normal contraction, never by
evicting at the swap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from confkv.config import CachePolicy
from confkv.controllers import Controller, make_controller
from confkv.engine.sequence import Sequence
from confkv.errors import ConfkvError

log = logging.getLogger(__name__)

#: Policy keys that size engine-wide resources and so cannot differ per request.
ENGINE_WIDE_KEYS = frozenset({"block_size", "host_cache_memory", "memory_high_watermark", "memory_low_watermark"})
#: Keys a request may not set: they would load files named by the client.
FORBIDDEN_OVERRIDES = frozenset({"learned_path"})

Info = dict[str, str | None]


class PolicySwitch:
    """The policy in force, its controller, what it is called, and the one waiting to be swapped in."""

    def __init__(self, policy: CachePolicy, info: Info | None = None) -> None:
        self.policy = policy
        self.controller = make_controller(policy)
        self.info: Info = {"name": policy.controller, "version": None, "source": "startup", **(info or {})}
        self.swaps = 0
        self.refused = 0
        self._lock = threading.Lock()
        self._pending: tuple[CachePolicy, Controller, Info] | None = None

    def controller_for(self, overrides: dict[str, Any] | None) -> Controller:
        """The policy's controller, or one for the policy with a request's overrides (validated)."""
        if not overrides:
            return self.controller
        bad = sorted((set(overrides) & (ENGINE_WIDE_KEYS | FORBIDDEN_OVERRIDES)) - {"controller"})
        if bad:
            raise ConfkvError(f"policy key {bad[0]!r} cannot be set per request (it is engine-wide)")
        unknown = sorted(set(overrides) - set(CachePolicy.model_fields))
        if unknown:
            raise ConfkvError(f"unknown policy key {unknown[0]!r}")
        if overrides.get("controller") == "learned" and self.policy.controller != "learned":
            raise ConfkvError("controller 'learned' cannot be chosen per request; serve a learned policy instead")
        return self.controller.derive(self.policy.replace(**overrides))

    def build(self, policy: CachePolicy) -> Controller:
        """The controller of a policy that may replace this one (``ConfkvError`` when it cannot)."""
        if policy.block_size != self.policy.block_size:
            raise ConfkvError("a new policy cannot change block_size while the engine runs", param="block_size")
        return make_controller(policy)

    def request(self, policy: CachePolicy, info: Info) -> None:
        """Hand a policy over from any thread; it is built here and swapped in at the start of the next step."""
        controller = self.build(policy)
        with self._lock:
            self._pending = (policy, controller, info)

    def record_refused(self, source: str, reason: str) -> None:
        """Count (and log) a policy that was not swapped in because it failed to load or validate."""
        with self._lock:
            self.refused += 1
        log.warning("policy from %s refused, keeping the current one: %s", source, reason)

    def take_pending(self) -> tuple[CachePolicy, Controller, Info] | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def swap(self, policy: CachePolicy, controller: Controller, info: Info, seqs: Iterable[Sequence]) -> None:
        """Put ``policy`` in force for the engine and every live sequence (see the module docstring)."""
        # every request's controller is built before anything changes, so that a swap is never half applied
        plan: list[tuple[Sequence, Controller]] = []
        for seq in seqs:
            try:
                plan.append((seq, controller.derive(policy.replace(**seq.overrides)) if seq.overrides else controller))
            except ConfkvError as err:
                log.warning("request %s keeps its policy: its overrides do not apply to the new one (%s)",
                            seq.request_id, err)  # fmt: skip
        self.policy = policy
        self.controller = controller
        for seq, c in plan:
            seq.ctrl = c.adopt(seq.ctrl)
            seq.kv.controller = c
            seq.kv.budget = min(seq.kv.budget, c.max_budget)
        self.info = info
        self.swaps += 1
        log.info("policy swapped to %s (version %s, from %s)", info["name"], info["version"], info["source"])
