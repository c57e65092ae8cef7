"""Stopping a long command cleanly: SIGTERM (``kill``, a scheduler's timeout) handled like Ctrl-C.

Python turns SIGINT into ``KeyboardInterrupt`` but lets SIGTERM end the process at once, so nothing can record
that the work stopped: an MLflow run stays RUNNING for ever and the best result so far is lost. Inside
``interruptible()`` SIGTERM raises ``Interrupted`` (a ``KeyboardInterrupt``), so ``finally`` blocks, the MLflow run
(``tuner.tracking.mlflow_run`` ends it KILLED) and the trainer's own clean-up all run, and the command exits with
128 + the signal's number, as a shell reports a process killed by it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Interrupted(KeyboardInterrupt):
    """A stop asked for by a signal; ``signum`` says which (SIGINT's ``KeyboardInterrupt`` has none: 2)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(err: BaseException) -> int:
    """The signal a ``KeyboardInterrupt`` stands for: SIGTERM for ``Interrupted`` from it, else SIGINT."""
    return getattr(err, "signum", int(signal.SIGINT))


@contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Interrupted`` in the main thread; the previous handler is restored after.
    Outside the main thread (where Python cannot install handlers) the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
