"""The throughput suite, ``benchmarks/longgen_fidelity.py`` and ``benchmarks/step_cost.py`` with rows at their own
KV dtype (issues 34 and 35):
``snapkv@128:int8`` and ``rule.yaml:int8`` run on a pool of the same bytes as ``full``'s, hold more tokens there,
and report their memory in bytes beside tokens; ``full`` at the run's dtype stays the reference; a bad dtype is
one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from confkv.bench.specs import parse_file_row
from confkv.bench.stream_rows import stream_policies, stream_rows
from confkv.bench.streams import TINY_LONGGEN
from confkv.cli import main
from confkv.errors import ConfkvError

ROOT = Path(__file__).resolve().parents[1]
WINDOW = "cache_policy: {controller: window, base_size: 64, max_size: 64, min_recent: 32}\n"


@pytest.fixture(scope="module")
def dtype_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One longgen run of the tiny stream: ``full`` (auto), ``full:int8``, a sized baseline at int8 and a policy
    file at int8 beside the same file at auto, with the ceiling; (its output folder, the policy file)."""
    tmp = tmp_path_factory.mktemp("dtype-run")
    policy = tmp / "win.yaml"
    policy.write_text(WINDOW)
    out = tmp / "tp"
    args = ["bench", "--model", "tiny-random", "--suite", "throughput", "--policies", "full,full:int8,h2o@64:int8",
            "--policy-file", f"{policy}:int8", "--policy-file", str(policy), "--scenarios", "longgen",
            "--requests", "3", "--ceiling", "2", "--no-hf", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    return out, policy


def test_a_dtype_row_runs_on_the_same_bytes_with_more_tokens_and_full_stays_the_reference(dtype_run, capsys):
    out, _ = dtype_run
    results = json.loads((out / "results.json").read_text())
    section = results["longgen"]
    rows = section["policies"]
    assert list(rows) == ["full", "full:int8", "h2o@64:int8", "win:int8", "win", "full:2x"]
    assert section["speed_reference"] == "full" and section["quality_reference"] == "full"
    dtypes = {name: m["kv_cache_dtype"] for name, m in rows.items()}
    assert dtypes == {"full": "auto", "full:int8": "int8", "h2o@64:int8": "int8", "win:int8": "int8", "win": "auto",
                      "full:2x": "auto"}  # fmt: skip
    assert results["row_kv_cache_dtypes"] == dtypes
    h2o = results["policy_settings"]["h2o@64:int8"]
    assert (h2o["controller"], h2o["max_size"], h2o["min_recent"]) == ("h2o", 64, 32)
    # the same bytes for every row but the ceiling: int8 stores each token in fewer, so its pool holds more
    assert rows["full:int8"]["pool_tokens"] > 3 * rows["full"]["pool_tokens"]
    assert rows["win:int8"]["pool_tokens"] == rows["full:int8"]["pool_tokens"] == rows["h2o@64:int8"]["pool_tokens"]
    assert rows["win"]["pool_tokens"] == rows["full"]["pool_tokens"]
    assert rows["full:2x"]["pool_tokens"] == 2 * rows["full"]["pool_tokens"]  # the ceiling: twice the bytes, at auto
    # memory in bytes over full's at the model's dtype: full itself 1, the same tokens at int8 far less
    assert rows["full"]["kv_bytes_fraction_mean"] == pytest.approx(1.0)
    assert rows["full:int8"]["kv_fraction_mean"] == pytest.approx(1.0)
    assert rows["full:int8"]["kv_bytes_fraction_mean"] < 0.4
    ratio = rows["full:int8"]["kv_bytes_fraction_mean"]  # bytes of an int8 token over an auto one
    for name in ("win:int8", "h2o@64:int8"):
        m = rows[name]
        assert m["kv_bytes_fraction_mean"] == pytest.approx(ratio * m["kv_fraction_mean"], rel=1e-6), name
        low, high = m["kv_bytes_fraction_ci"]
        assert low <= m["kv_bytes_fraction_mean"] <= high, name
    assert rows["win:int8"]["kv_fraction_mean"] == pytest.approx(rows["win"]["kv_fraction_mean"])  # same tokens kept
    assert rows["full"]["exact_match_vs_full"] == 1.0
    report = (out / "report.md").read_text()
    assert "KV bytes %" in report and "| `full:int8` |" in report and "| int8 |" in report


def test_the_headline_table_shows_each_rows_dtype_and_bytes(dtype_run, tmp_path):
    """``longgen_fidelity.py`` takes the same dtype rows (a policy and a policy file at int8), scores them on
    ``full``'s answers with their bytes, and ``headline.py`` joins both runs' rows by name with their dtype."""
    out, policy = dtype_run
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, str(ROOT / "benchmarks/longgen_fidelity.py"), "--model", "tiny-random", "--requests", "2",
           "--output-tokens", "8,12", "--policies", "full:int8,h2o@64:int8", "--policy-file", f"{policy}:int8",
           "--json"]  # fmt: skip
    done = subprocess.run(run, capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    fid = tmp_path / "fidelity.json"
    fid.write_text(done.stdout)
    rows = json.loads(done.stdout.splitlines()[-1])["policies"]
    assert list(rows) == ["full:int8", "h2o@64:int8", "win:int8"]  # full at auto is the reference, not a row
    assert all(r["kv_cache_dtype"] == "int8" for r in rows.values())
    full8 = rows["full:int8"]
    assert full8["kv_fraction"][0] == 1.0 and full8["kv_bytes_fraction"][0] < 0.4
    assert full8["kl"][0] > 0  # quantised, read against full's exact distributions
    for name in ("h2o@64:int8", "win:int8"):
        assert rows[name]["kv_bytes_fraction"][0] == pytest.approx(
            full8["kv_bytes_fraction"][0] * rows[name]["kv_fraction"][0], rel=1e-6
        )
    head = [sys.executable, str(ROOT / "benchmarks/headline.py"), "--throughput", str(out / "results.json"),
            "--fidelity", str(fid)]  # fmt: skip
    table = json.loads(subprocess.run([*head, "--json"], capture_output=True, text=True, check=True).stdout)["rows"]
    tp = json.loads((out / "results.json").read_text())["longgen"]["policies"]
    assert table["win:int8"]["kv_cache_dtype"] == "int8" and table["full"]["kv_cache_dtype"] == "auto"
    assert table["win:int8"]["kv_bytes_share"][0] == tp["win:int8"]["kv_bytes_fraction_mean"]
    assert table["win:int8"]["kv_bytes_share_scoring"] == rows["win:int8"]["kv_bytes_fraction"]
    assert table["win:int8"]["kl"] == rows["win:int8"]["kl"]
    md = subprocess.run(head, capture_output=True, text=True, check=True).stdout
    assert "KV bytes share (served)" in md and "| `win:int8` |" in md
    assert f"| `full:int8` | {tp['full:int8']['kv_fraction_mean']:.2f} [" in md and " | int8 | " in md


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (["--policies", "full,snapkv@128:int9"], "unknown kv_cache_dtype 'int9' in 'snapkv@128:int9'"),
        (["--policies", "full:int8:demote=int3"], "write demote="),
        (["--policies", "dynamic,full:int8:demote=int4"], "demote_dtype applies to an evicting policy"),
        (["--policy-file", "POLICY:fp9"], "unknown kv_cache_dtype 'fp9'"),
        (["--policy-file", "POLICY:int8:x"], "bad 'x'"),
    ],
)
def test_a_bad_dtype_row_is_one_line_before_the_model_loads(tmp_path, capsys, entry, says):
    policy = tmp_path / "win.yaml"
    policy.write_text(WINDOW)
    entry = [e.replace("POLICY", str(policy)) for e in entry]
    args = ["bench", "--model", "no-such-model", "--suite", "throughput", "--scenarios", "longgen", "--no-hf",
            "--out", str(tmp_path / "out"), *entry]  # fmt: skip
    assert main(args) == 2  # the model name is wrong too: the entry is refused first
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    fidelity = [sys.executable, str(ROOT / "benchmarks/longgen_fidelity.py"), "--model", "no-such-model", *entry]
    done = subprocess.run(fidelity, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    steps = [sys.executable, str(ROOT / "benchmarks/step_cost.py"), "--model", "no-such-model", *entry]
    done = subprocess.run(steps, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_step_cost_runs_each_row_at_its_dtype_on_the_same_bytes(tmp_path):
    """``step_cost.py`` takes the suite's dtype rows: ``snapkv@64:int8`` runs on an int8 pool of the bytes the
    plain row's pool has (so about 3.9 times its tokens), keeps the same tokens, and no reference ``full`` is added."""
    out = tmp_path / "steps.json"
    run = [sys.executable, str(ROOT / "benchmarks/step_cost.py"), "--model", "tiny-random", "--requests", "2",
           "--policies", "snapkv@64,snapkv@64:int8", "--max-num-batched-tokens", "64", "--min-steps", "1",
           "--json", str(out)]  # fmt: skip
    subprocess.run(run, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = json.loads(out.read_text())["policies"]
    assert list(rows) == ["snapkv@64", "snapkv@64:int8"]
    plain, int8 = rows["snapkv@64"], rows["snapkv@64:int8"]
    assert (plain["kv_cache_dtype"], int8["kv_cache_dtype"]) == ("auto", "int8")
    assert int8["pool_tokens"] > 3 * plain["pool_tokens"]
    assert int8["totals"]["generated"] == plain["totals"]["generated"] > 0
    assert int8["kv_bytes_fraction_mean"] < 0.4 * plain["kv_bytes_fraction_mean"]  # the same tokens in fewer bytes
    assert int8["totals"]["evicted_blocks"] == plain["totals"]["evicted_blocks"] > 0  # the same blocks leave


def test_file_rows_keep_colons_of_their_path_and_one_dtype_benchmarks_refuse_dtype_rows(tmp_path):
    odd = tmp_path / "a:b.yaml"
    odd.write_text(WINDOW)
    assert parse_file_row(str(odd)).policy == str(odd) and parse_file_row(str(odd)).kv_cache_dtype is None
    row = parse_file_row(f"{odd}:int8:demote=int4")
    assert (row.policy, row.kv_cache_dtype, row.demote_dtype) == (str(odd), "int8", "int4")
    rows = stream_rows(["snapkv@128:int8", "dynamic:int8:demote=int4"], [f"{odd}:fp8"], TINY_LONGGEN)
    assert [(r.name, r.kv_cache_dtype) for r in rows] == [
        ("full", "auto"), ("snapkv@128:int8", "int8"), ("dynamic:int8:demote=int4", "int8"), ("a:b:fp8", "fp8")
    ]  # fmt: skip
    assert rows[1].policy.max_size == 128 and rows[2].policy.demote_dtype == "int4"
    at_int8 = stream_rows(["full:int8", "snapkv@128"], [], TINY_LONGGEN, "int8")
    assert [(r.name, r.kv_cache_dtype) for r in at_int8] == [("full:int8", "int8"), ("snapkv@128", "int8")]
    with pytest.raises(ConfkvError, match="runs every policy at one kv_cache_dtype"):
        stream_policies(["full", "snapkv@128:int8"], [], TINY_LONGGEN)
