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
