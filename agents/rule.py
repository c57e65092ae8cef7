"""The requirement's fixed rule as an agent: the same knobs every segment (a policy's thresholds, scaling and sizes).

Run through the environment it must reproduce the engine's own ``dynamic`` policy, which is how the environment
is checked against the engine. ``space`` is the environment's knob space (default: the one around ``policy``, the
environment's own when ``policy`` is its base policy).
"""

from __future__ import annotations

import numpy as np

from confkv.config import CachePolicy
from confkv.controllers.learned import KnobSpace


class RuleAgent:
    def __init__(self, policy: CachePolicy | None = None, space: KnobSpace | None = None) -> None:
        p = policy or CachePolicy()
        self.space = space or KnobSpace.for_policy(p)
        self.knobs = {name: float(getattr(p, name)) for name in self.space.names}
        self._action = self.space.action(self.knobs)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return self._action.copy()
