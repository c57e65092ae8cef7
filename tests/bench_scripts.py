"""A benchmark script loaded as a module, for tests of its functions."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def bench_script(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` as a module (it imports its siblings, so ``benchmarks/`` is on the path only while it
    loads)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
