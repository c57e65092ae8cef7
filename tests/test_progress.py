"""Progress of long work: timestamped lines when stderr is not a terminal (a log file, CI), a bar when it is."""

from __future__ import annotations

import io
import re
import time

import pytest

from confkv import progress
from tuner.cli import main as tune_main

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[\d+(?:s|m\d\ds|h\d\dm)\] ")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_every_interval_with_stage_count_elapsed_and_estimate(monkeypatch):
    monkeypatch.delenv("CONFKV_PROGRESS", raising=False)
    monkeypatch.setenv("CONFKV_PROGRESS_INTERVAL", "0.05")
    log = io.StringIO()  # not a terminal, as a log file is not
    with (
        progress.stage("train optuna", expected_s=60, stream=log),
        progress.stage("optuna", total=4, unit="trials", stream=log) as trials,
    ):
        for _ in range(4):
            time.sleep(0.08)
            trials.update()
    lines = log.getvalue().splitlines()
    assert all(LINE.match(line) for line in lines), lines
    assert "train optuna (expected about 1m00s): started" in lines[0]
    beats = [line for line in lines if "train optuna" in line and " > optuna " in line]
    assert len(beats) >= 2  # a line every interval while the work runs, not only at the end
    assert any(re.search(r"optuna [1-3]/4 trials \(~\d+s left\)", line) for line in beats), beats
    assert lines[-1].endswith("train optuna: done in 0s")
    assert "\r" not in log.getvalue()


def test_an_estimate_given_up_front_counts_down_before_the_first_unit(monkeypatch):
    monkeypatch.setenv("CONFKV_PROGRESS", "lines")
    monkeypatch.setenv("CONFKV_PROGRESS_INTERVAL", "0.05")
    log = io.StringIO()
    with progress.stage("references", total=3, unit="items", expected_s=600, stream=log):
        time.sleep(0.15)
    assert re.search(r"references 0/3 items \(~(9m5\ds|10m00s) left\)", log.getvalue()), log.getvalue()


def test_a_stage_stopped_by_an_error_says_so(monkeypatch):
    monkeypatch.setenv("CONFKV_PROGRESS", "lines")
    log = io.StringIO()
    with pytest.raises(KeyboardInterrupt), progress.stage("trials", total=8, unit="trials", stream=log) as st:
        st.update(3)
        raise KeyboardInterrupt
    assert "trials: stopped, 3/8 trials in 0s" in log.getvalue()


def test_a_terminal_gets_a_bar_and_the_mode_can_be_forced(monkeypatch):
    monkeypatch.delenv("CONFKV_PROGRESS", raising=False)
    tty = _Tty()
    assert progress.mode(tty) == "bar" and progress.mode(io.StringIO()) == "lines"
    with progress.stage("optuna", total=2, unit="trials", stream=tty) as st:
        st.update(2)
    assert "\r" in tty.getvalue() and "2/2" in tty.getvalue()
    monkeypatch.setenv("CONFKV_PROGRESS", "off")
    quiet = io.StringIO()
    with progress.stage("optuna", total=2, stream=quiet) as st:
        st.update(2)
    assert quiet.getvalue() == ""
    assert progress.duration(59) == "59s" and progress.duration(185) == "3m05s" and progress.duration(3720) == "1h02m"


def test_confkv_tune_eval_reports_progress_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    """capsys' stderr is not a terminal: the episodes, their references and the evaluation are progress lines."""
    monkeypatch.delenv("CONFKV_PROGRESS", raising=False)
    monkeypatch.setenv("CONFKV_PROGRESS_INTERVAL", "0.2")
    assert tune_main(["eval", "default", "--model", "tiny-random", "--no-mlflow"]) == 0
    err = capsys.readouterr().err.splitlines()
    stamped = [line for line in err if LINE.match(line)]
    assert any("episodes of mixed, heldout split: started" in line for line in stamped), err
    assert any(re.search(r"evaluate default: done, (\d+)/\1 episodes in \d+s", line) for line in stamped), err
