"""``benchmarks/demote_bytes.py --baseline-token-shares``: each baseline at shares of the text, budgets to a block."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench_scripts import ROOT, bench_script


def test_a_share_of_the_text_is_a_budget_to_the_nearest_block() -> None:
    share_budget = bench_script("demote_bytes").share_budget
    assert share_budget(0.42, 3000, 16) == 1264  # 1,260 tokens: 78.75 blocks
    assert share_budget(0.77, 3000, 16) == 2304
    assert share_budget(0.01, 3000, 16) == 32  # at least two blocks
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="share"):
            share_budget(bad, 3000, 16)


def test_the_sweep_runs_each_baseline_at_each_share_without_dynamic_rows() -> None:
    run = [sys.executable, str(ROOT / "benchmarks/demote_bytes.py"), "--model", "tiny-random", "--suite", "quick",
           "--baselines", "streaming", "--baseline-dtypes", "int8", "--baseline-token-shares", "0.25,0.5",
           "--workloads", "prose", "--prose-items", "1", "--json", "--threads", "1"]  # fmt: skip
    out = json.loads(subprocess.run(run, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    rows = {k for k, v in out.items() if isinstance(v, dict) and "kv_cache_dtype" in v}
    assert rows == {"full@auto", "full@int8", "streaming@int8/0.25", "streaming@int8/0.5"}
    tokens = out["full@auto"]["mean_prose_tokens"]
    for share in (0.25, 0.5):
        row = out[f"streaming@int8/{share:g}"]
        assert row["prose_budget_tokens"] == round(share * tokens / 16) * 16
        assert "passkey_right" not in row
    # fewer tokens kept, fewer bytes held
    assert out["streaming@int8/0.25"]["prose_peak_bytes_vs_full_auto"] < out["streaming@int8/0.5"][
        "prose_peak_bytes_vs_full_auto"] < out["full@int8"]["prose_peak_bytes_vs_full_auto"]  # fmt: skip
