"""What sets each sequence's KV budget: the requirement's confidence rule, the fixed baselines, a learned policy.

Each rule is one class registered by name (``confkv.plugins.CONTROLLERS``); importing this package registers the
built-in ones, and ``make_controller`` builds whichever a policy names.
"""

from confkv.controllers import learned, rules  # noqa: F401  (each registers its controllers)
from confkv.controllers.base import BudgetState, Controller, StepSignals, make_controller
from confkv.controllers.rules import DynamicController, FixedController, FullController

__all__ = [
    "BudgetState",
    "Controller",
    "DynamicController",
    "FixedController",
    "FullController",
    "StepSignals",
    "make_controller",
]
