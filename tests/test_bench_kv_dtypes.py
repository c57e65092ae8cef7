"""``confkv bench`` rows at their own KV dtype (``POLICY:KV_DTYPE[:demote=DTYPE]``), memory in bytes beside tokens,
and fixed baselines matched on the bytes (not the tokens) of the dtype/demoted row they are compared with."""

import dataclasses
import json

import pytest

from confkv.bench.memory import Usage
from confkv.bench.report import write_report
from confkv.bench.specs import TEACHER_FORCED, TINY, scaled_dynamic
from confkv.bench.suite import plan_policies, run_suite
from confkv.cli import main

DEMOTING = "dynamic:int8:demote=int4"
BASELINE = f"window:int8@{DEMOTING}"


def test_rows_per_dtype_with_bytes_and_byte_matched_baselines(tmp_path):
    out = tmp_path / "bench"
    # the quick tiny suite less its batch-throughput measure and with one pass-key depth: the rows are what is tested
    spec = dataclasses.replace(TINY, batch={}, passkey={**TINY.passkey, "depths": (0.2,)})
    rows = ["full", "full:int8", DEMOTING, "window"]
    write_report(run_suite("tiny-random", "quick", rows, spec=spec, log=lambda _: None), out)
    results = json.loads((out / "results.json").read_text())
    pol = results["policies"]
    assert set(pol) == {"full", "full:int8", DEMOTING, BASELINE}
    assert [pol[n]["kv_cache_dtype"] for n in ("full", "full:int8", DEMOTING, BASELINE)] == [
        "auto",
        "int8",
        "int8",
        "int8",
    ]
    assert pol[DEMOTING]["policy"]["demote_dtype"] == "int4" and pol[BASELINE]["policy"]["demote_dtype"] == "none"
    # full at auto holds every token at the model's dtype; at int8 the same tokens in fewer bytes
    assert pol["full"]["kv_bytes_fraction_mean"] == pytest.approx(1.0)
    assert pol["full:int8"]["kv_fraction_mean"] == pytest.approx(1.0)
    assert pol["full:int8"]["kv_bytes_fraction_mean"] < 0.4
    assert pol["full:int8"]["kl_mean"] > 0  # quantised: measured against the exact references, not equal to them
    # the demoted copies count in the demoting row's bytes: more than its resident tokens alone would take
    prose = pol[DEMOTING]["workloads"]["prose"]
    assert prose["kv_mean_bytes"] > prose["kv_mean_tokens"] * prose["kv_bytes_per_token"]
    # matched on bytes: per teacher-forced measure, the baseline's mean bytes equal the variant's within a block,
    # unless the variant's bytes (demoted copies counted at their peak on every step) exceed what a full cache at
    # the pool's dtype holds: then the baseline holds every token, the most bytes a fixed budget can spend
    matched = 0
    for m in TEACHER_FORCED:
        v, b = pol[DEMOTING]["workloads"][m], pol[BASELINE]["workloads"][m]
        block = scaled_dynamic(1 / 32).block_size * b["kv_bytes_per_token"]
        if b["kv_fraction_mean"] > 0.999:
            assert v["kv_mean_bytes"] >= b["kv_mean_bytes"] - block, m
        else:
            assert abs(b["kv_mean_bytes"] - v["kv_mean_bytes"]) <= block, (m, v["kv_mean_bytes"], b["kv_mean_bytes"])
            matched += 1
    # on tiny-random, chat is matched; prose and long generation hold more than a full int8 cache since an expansion
    # inside a scored chunk recalls into the trimmed chunk's room (70995a1: long generation by 24 bytes)
    assert matched >= 1
    assert set(results["comparisons"]) == {DEMOTING}
    report = (out / "report.md").read_text()
    assert "KV bytes mean %" in report and f"`{BASELINE}`" in report


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("full:int9", "unknown kv_cache_dtype 'int9'"),
        ("dynamic:int8:demote=int3", "write demote=none|int4|int2"),
        ("dynamic:int8:int4", "write demote=none|int4|int2"),
        ("full:int8:demote=int4", "applies to an evicting policy"),
        ("dynamic:int8:demote=int4:x", "POLICY[:KV_DTYPE[:demote=DTYPE]]"),
        ("best:int8", "unknown policy 'best'"),
    ],
)
def test_a_bad_row_spec_is_a_one_line_error(entry, said, tmp_path, capsys):
    assert main(["bench", "--model", "tiny-random", "--policies", f"full,{entry}", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err and "Traceback" not in err


def test_plan_names_rows_by_dtype_and_baselines_follow_the_variants_pool():
    dyn = scaled_dynamic(0.125)
    plan = plan_policies(["full", "full:int8", "dynamic", DEMOTING, "h2o", "window:fp8"], [], dyn)
    assert [(p.name, p.matched_to, p.kv_cache_dtype) for p in plan] == [
        ("full", None, None),
        ("full:int8", None, "int8"),
        ("dynamic", None, None),
        ("h2o", "dynamic", None),
        (DEMOTING, None, "int8"),
        (f"h2o:int8@{DEMOTING}", DEMOTING, "int8"),
        ("window:fp8", None, "fp8"),
    ]
    assert plan[4].policy.demote_dtype == "int4" and plan[5].policy.demote_dtype == "none"
    assert plan[6].policy.controller == "window" and plan[6].policy.max_size == 2 * dyn.base_size


def test_tokens_at_counts_demoted_copies():
    u = Usage("chunked", auto_bytes_per_token=8.0, bytes_per_token=2.0, resident=100.0, full=400.0)
    u.resident_bytes = 100 * 2.0 + 60.0  # 100 resident token-steps at 2 B, demoted copies 60 B over the steps
    assert u.tokens_at(2.0) == pytest.approx(130.0) and u.tokens_at(4.0) == pytest.approx(65.0)
    assert u.bytes_fraction_mean == pytest.approx(260.0 / 3200.0)
