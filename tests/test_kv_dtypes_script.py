"""``benchmarks/kv_dtypes.py``: the standard suite's texts are scored in a pool of ``--kv-cache-memory`` (its 3,000
tokens do not fit the 64 MiB the step measurement uses), and a pool too small for them is a one-line error."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench_scripts import ROOT

RUN = [sys.executable, str(ROOT / "benchmarks/kv_dtypes.py"), "--model", "tiny-random", "--suite", "standard",
       "--dtypes", "auto,int8", "--no-step", "--threads", "1"]  # fmt: skip


def test_the_standard_suite_is_scored_in_the_pool_asked_for() -> None:
    out = json.loads(subprocess.run([*RUN, "--json"], check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    assert out["ppl_tokens"] > 0
    assert out["auto_ppl_delta_pct"] == 0.0
    assert out["int8_mean_kv_bytes_vs_full_auto"] < 0.5  # int8 codes and scales against float32


def test_a_pool_too_small_for_the_texts_is_a_one_line_error() -> None:
    done = subprocess.run([*RUN, "--kv-cache-memory", "16KiB"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert "--kv-cache-memory 16KiB: a scored text does not fit in the KV pool" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_step_reports_the_pools_writes_within_it() -> None:
    """The step's share spent in the pool's writes is measured at every dtype (the calls attention makes)."""
    run = [sys.executable, str(ROOT / "benchmarks/kv_dtypes.py"), "--model", "tiny-random", "--dtypes", "auto,fp8",
           "--no-ppl", "--context", "40", "--batch", "2", "--steps", "3", "--repeats", "1", "--json",
           "--threads", "1"]  # fmt: skip
    out = json.loads(subprocess.run(run, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    for dtype in ("auto", "fp8"):
        assert 0 < out[f"{dtype}_store_ms"] < out[f"{dtype}_step_ms"], out


def test_jitter_draws_the_rounding_again_and_reports_their_spread() -> None:
    """``--jitter`` perturbs what the pool is given, seeded per draw: two draws of a quantised pool differ, the
    summary is of the draws listed, and a float pool's draws (the control) stay near zero."""
    run = [sys.executable, str(ROOT / "benchmarks/kv_dtypes.py"), "--model", "tiny-random", "--dtypes", "auto,int4",
           "--no-step", "--jitter", "2", "--jitter-scale", "1e-3", "--json", "--threads", "1"]  # fmt: skip
    out = json.loads(subprocess.run(run, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    draws = out["int4_jitter_ppl_delta_pct"]
    assert len(draws) == 2 and draws[0] != draws[1], draws
    assert out["int4_jitter_ppl_delta_pct_mean"] == sum(draws) / 2
    lo, hi = out["int4_jitter_ppl_delta_pct_ci95"]
    assert lo <= out["int4_jitter_ppl_delta_pct_mean"] <= hi
    assert out["int4_jitter_ppl_delta_pct_min"] == min(draws) and out["int4_jitter_ppl_delta_pct_max"] == max(draws)
    assert all(abs(d) < 0.1 for d in out["auto_jitter_ppl_delta_pct"]), out["auto_jitter_ppl_delta_pct"]


def test_jitter_without_auto_is_a_one_line_error() -> None:
    run = [sys.executable, str(ROOT / "benchmarks/kv_dtypes.py"), "--model", "tiny-random", "--dtypes", "int8",
           "--no-step", "--jitter", "1", "--threads", "1"]  # fmt: skip
    done = subprocess.run(run, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert "--jitter measures deltas against auto" in done.stderr and "Traceback" not in done.stderr
