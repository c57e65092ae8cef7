"""Progress of long work, shown the same way by every command: a bar on a terminal, timestamped lines elsewhere.

Anything that can take more than about 30 seconds (converting a model, building full-cache references, Optuna
trials, RL timesteps, evaluations, benchmark suites) runs inside ``stage(...)``; stages nest. On a terminal each
open stage is a tqdm bar. When stderr is not a terminal (a log file, CI, ``nohup``), a bar would be one endless
line of carriage returns, so instead a plain line is written every few seconds while any stage is open:

    2025-12-06 00:41:03 [6m12s] train optuna > trials 2/8 (~12m left) > evaluate 4/5 episodes (~9s left)

the wall-clock time, the time since the outermost stage began, then every open stage with how far it has come and
an estimate of what is left (from its rate so far, or, before its first unit is done, from an estimate its caller
gave). A stage that took a while also says when it is done. ``CONFKV_PROGRESS`` (``bar``, ``lines`` or ``off``)
overrides the choice; ``CONFKV_PROGRESS_INTERVAL`` sets the seconds between lines (default 5).

``bars()`` says whether a library's own bar may be drawn (the engine's ``use_tqdm``): only on a terminal.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

MODES = ("bar", "lines", "off")
DEFAULT_INTERVAL_S = 5.0

_lock = threading.RLock()
_open: list[Stage] = []
_wake = threading.Condition(_lock)
_ticker: threading.Thread | None = None


def mode(stream: IO[str] | None = None) -> str:
    """``bar`` on a terminal, ``lines`` otherwise, unless ``CONFKV_PROGRESS`` says which."""
    forced = os.environ.get("CONFKV_PROGRESS", "").strip().lower()
    if forced in MODES:
        return forced
    stream = stream if stream is not None else sys.stderr
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):  # a closed or minimal stream
        return "lines"


def bars() -> bool:
    """Whether libraries may draw their own progress bars: on a terminal only, where they redraw in place."""
    return mode() == "bar"


def interval_s() -> float:
    try:
        value = float(os.environ.get("CONFKV_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


def duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``1h02m``: short enough to keep a progress line on one screen line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Stage:
    """One piece of long work: ``total`` units (None: not counted) of which ``done`` are done."""

    def __init__(
        self, name: str, total: float | None, unit: str, expected_s: float | None, stream: IO[str], kind: str
    ) -> None:
        self.name = name
        self.total = total
        self.unit = unit
        self.expected_s = expected_s
        self.stream = stream
        self.kind = kind
        self.done: float = 0
        self.note = ""
        self.started = time.monotonic()
        self.depth = 0
        self._bar: Any = None

    # ------------------------------------------------------------------------------------------------ updates
    def update(self, n: float = 1) -> None:
        self.set(self.done + n)

    def set(self, done: float) -> None:
        """Units done so far (never past ``total``: a run may overshoot its schedule, as SB3 does)."""
        delta = done - self.done
        self.done = min(done, self.total) if self.total is not None else done
        if self._bar is not None and delta:
            self._bar.n = self.done
            self._bar.refresh()

    def set_note(self, text: str) -> None:
        """What the stage is doing now (``generating full's answers``), shown beside its count."""
        self.note = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    # ------------------------------------------------------------------------------------------------ text
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left_s(self) -> float | None:
        """Seconds left: from the rate so far once a unit is done, else from the caller's estimate."""
        elapsed = self.elapsed()
        if self.total and self.done > 0:
            return elapsed * (self.total - self.done) / self.done
        if self.expected_s is not None:
            return max(0.0, self.expected_s - elapsed)
        return None

    def describe(self) -> str:
        text = self.name
        if self.total is not None:
            text += f" {self.done:g}/{self.total:g}" + (f" {self.unit}" if self.unit else "")
        elif self.done:
            text += f" {self.done:g}" + (f" {self.unit}" if self.unit else "")
        if self.note:
            text += f" ({self.note})"
        left = self.left_s()
        if self.total is not None and self.done >= self.total:
            pass
        elif left is not None:
            text += f" (~{duration(left)} left)"
        elif self.total:
            text += " (estimating)"
        return text


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _write(stream: IO[str], text: str) -> None:
    try:
        stream.write(text + "\n")
        stream.flush()
    except (OSError, ValueError):  # a closed stream must not stop the work it reports on
        pass


def _line() -> str | None:
    """The progress line of every open line-mode stage, outermost first; None when none is open."""
    stages = [s for s in _open if s.kind == "lines"]
    if not stages:
        return None
    return f"{_stamp()} [{duration(stages[0].elapsed())}] " + " > ".join(s.describe() for s in stages)


def _tick() -> None:
    """Write the progress line every interval while a line-mode stage is open; exit when none is. Woken early when
    a stage closes, it writes only when the interval has passed, so short stages opening and closing add no lines."""
    global _ticker
    with _lock:
        due = time.monotonic() + interval_s()
        while True:
            _wake.wait(max(0.0, due - time.monotonic()))
            line = _line()
            if line is None:
                _ticker = None
                return
            if time.monotonic() >= due:
                _write(next(s for s in _open if s.kind == "lines").stream, line)
                due = time.monotonic() + interval_s()


@contextmanager
def stage(
    name: str,
    total: float | None = None,
    unit: str = "",
    *,
    expected_s: float | None = None,
    stream: IO[str] | None = None,
) -> Iterator[Stage]:
    """Report progress of the work inside the block (see the module docstring); yields the ``Stage`` to update."""
    global _ticker
    stream = stream if stream is not None else sys.stderr
    kind = mode(stream)
    st = Stage(name, total, unit, expected_s, stream, kind)
    with _lock:
        st.depth = len(_open)
        _open.append(st)
    if kind == "bar":
        from tqdm.auto import tqdm

        st._bar = tqdm(total=total, desc=name, unit=unit or "it", file=stream, leave=st.depth == 0,
                       dynamic_ncols=True)  # fmt: skip
    elif kind == "lines":
        with _lock:
            if st.depth == 0 or expected_s is not None:
                first = name + (f" (expected about {duration(expected_s)})" if expected_s is not None else "")
                _write(stream, f"{_stamp()} [{duration(_open[0].elapsed())}] {first}: started")
            if _ticker is None:
                _ticker = threading.Thread(target=_tick, name="confkv-progress", daemon=True)
                _ticker.start()
    failed = False
    try:
        yield st
    except BaseException:
        failed = True
        raise
    finally:
        with _lock:
            if st in _open:
                _open.remove(st)
            _wake.notify_all()
        if st._bar is not None:
            st._bar.close()
        elif kind == "lines" and (st.depth == 0 or st.elapsed() >= interval_s()):
            count = f", {st.done:g}/{st.total:g} {st.unit}".rstrip() if st.total is not None else ""
            word = "stopped" if failed else "done"
            with _lock:
                outer = _open[0] if _open and _open[0].kind == "lines" else st
                _write(stream, f"{_stamp()} [{duration(outer.elapsed())}] {st.name}: {word}{count} in "
                       f"{duration(st.elapsed())}")  # fmt: skip
