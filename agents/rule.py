"""The requirement's fixed rule as an agent: the same knobs every segment (entropy 3.5, gap 0.15, scaling 0.8).

Run through the environment it must reproduce the engine's own ``dynamic`` policy, which is how the environment
is checked against the engine.
"""

from __future__ import annotations

import numpy as np

from confkv.config import CachePolicy
from confkv.learned import action_from_knobs


class RuleAgent:
    def __init__(self, policy: CachePolicy | None = None) -> None:
        p = policy or CachePolicy()
        self.knobs = {"entropy_threshold": p.entropy_threshold, "gap_threshold": p.gap_threshold,
                      "scaling_factor": p.scaling_factor}  # fmt: skip
        self._action = action_from_knobs(self.knobs)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return self._action.copy()
