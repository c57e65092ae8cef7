"""``benchmarks/demote_bytes.py``: each baseline at shares of the text (budgets to a block); more prose items no more
alike than the suite's own; every row paired with the demoting row, with a bootstrap interval over the items."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from confkv.bench import prose_draw
from confkv.bench.paired import (
    keys_verdict,
    mcnemar_exact,
    overall,
    pair_keys,
    pair_prose,
    pair_rows,
    pooled_ppl,
    verdict,
)
from confkv.bench.specs import TINY_STANDARD
from confkv.bench.workloads import WorkloadItem
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


def rows_on_items(seed: int = 0, items: int = 8) -> dict[str, dict]:
    """Three rows scored on the same items: full, a demoting row a little worse, a baseline worse on some items."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(200, 400, items)]
    full = [t * float(rng.uniform(2.0, 3.0)) for t in tokens]  # per-token NLL 2-3 nats, differing by item
    demoting = [f + 0.002 * t for f, t in zip(full, tokens, strict=True)]
    baseline = [f + float(rng.uniform(0.0, 0.01)) * t for f, t in zip(full, tokens, strict=True)]
    return {name: {"prose_nll": nll, "prose_tokens": tokens, "passkey_items": keys}
            for name, nll, keys in (("full@auto", full, [True, True, False]), ("demote", demoting, [True, False, True]),
                                    ("base", baseline, [False, True, False]))}  # fmt: skip


def test_the_paired_difference_is_the_difference_of_the_deltas_and_its_interval_holds_it() -> None:
    rows = rows_on_items()
    pair = pair_prose(rows["base"], rows["demote"], rows["full@auto"])
    idx = np.arange(8)
    ppl = {k: pooled_ppl(r, idx) for k, r in rows.items()}
    delta = {k: 100 * (ppl[k] / ppl["full@auto"] - 1) for k in ("base", "demote")}
    assert pair["ppl_diff_pp"] == pytest.approx(delta["base"] - delta["demote"], abs=1e-9)
    low, high = pair["ppl_diff_ci95"]
    assert low < pair["ppl_diff_pp"] < high  # a real spread: the baseline's cost differs by item
    assert high - low > 0.01


def test_the_pairing_is_antisymmetric_and_a_row_against_itself_is_zero() -> None:
    rows = rows_on_items(seed=3)
    ab = pair_prose(rows["base"], rows["demote"], rows["full@auto"])
    ba = pair_prose(rows["demote"], rows["base"], rows["full@auto"])
    assert ba["ppl_diff_pp"] == pytest.approx(-ab["ppl_diff_pp"])
    assert ba["ppl_diff_ci95"] == pytest.approx([-ab["ppl_diff_ci95"][1], -ab["ppl_diff_ci95"][0]])
    pairs = pair_rows(rows, "demote")
    assert pairs["demote"] == {"ppl_diff_pp": 0.0, "ppl_diff_ci95": [0.0, 0.0], "keys_row_only": 0,
                               "keys_against_only": 0, "keys_p": 1.0,
                               "verdicts": {"prose": "tied", "keys": "tied", "overall": "tied"}}  # fmt: skip
    # keys item by item: full answers the first two, demotion the first and third
    assert (pairs["full@auto"]["keys_row_only"], pairs["full@auto"]["keys_against_only"]) == (1, 1)
    assert (pairs["base"]["keys_row_only"], pairs["base"]["keys_against_only"]) == (1, 2)


def test_the_verdict_reads_the_interval() -> None:
    assert verdict({"ppl_diff_pp": 0.1, "ppl_diff_ci95": [0.02, 0.2]}) == "ahead"
    assert verdict({"ppl_diff_pp": 0.1, "ppl_diff_ci95": [-0.02, 0.2]}) == "tied"
    assert verdict({"ppl_diff_pp": -0.1, "ppl_diff_ci95": [-0.2, -0.01]}) == "behind"
    assert verdict({"ppl_diff_pp": 0.1, "ppl_diff_ci95": None}) == "tied"


def test_the_keys_verdict_is_an_exact_mcnemar_test_on_the_discordant_keys() -> None:
    # six keys one way and none the other: 2 * 0.5**6; five are not enough at 5%
    assert mcnemar_exact(0, 6) == pytest.approx(0.03125)
    assert mcnemar_exact(5, 0) == pytest.approx(0.0625)
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == 1.0
    # the keys both rows answer (or both miss) do not enter it
    row = {"passkey_items": [False] * 6 + [True] * 20 + [False] * 4}
    demoting = {"passkey_items": [True] * 6 + [True] * 20 + [False] * 4}
    pair = pair_keys(row, demoting)
    assert (pair["keys_row_only"], pair["keys_against_only"]) == (0, 6)
    assert pair["keys_p"] == pytest.approx(0.03125)
    assert keys_verdict(pair) == "ahead"  # the row paired against (demotion) answers the six
    assert keys_verdict(pair_keys(demoting, row)) == "behind"
    five = pair_keys({"passkey_items": [False] * 5 + [True]}, {"passkey_items": [True] * 6})
    assert keys_verdict(five) == "tied"


def test_ahead_overall_is_ahead_on_one_measure_and_behind_on_none() -> None:
    assert overall(["tied", "ahead"]) == "ahead"
    assert overall(["ahead", "ahead"]) == "ahead"
    assert overall(["tied", "tied"]) == "tied"
    assert overall(["behind", "tied"]) == "behind"
    assert overall(["ahead", "behind"]) == "mixed"
    pairs = pair_rows(rows_on_items(), "demote")
    assert pairs["base"]["verdicts"]["keys"] == "tied"  # one key against two
    assert pairs["base"]["verdicts"]["overall"] == overall(
        [pairs["base"]["verdicts"]["prose"], pairs["base"]["verdicts"]["keys"]]
    )


def test_rows_on_different_items_are_not_paired() -> None:
    rows = rows_on_items()
    rows["base"]["prose_tokens"] = [*rows["base"]["prose_tokens"][:-1], 1]
    with pytest.raises(ValueError, match="same items"):
        pair_prose(rows["base"], rows["demote"], rows["full@auto"])


def fake_prose(ids: list[tuple[int, ...]]):
    """A stand-in for ``make_workload``: item ``i`` is ``ids[i]`` whatever ``n`` is, as the suite's draws are."""

    def make(name, tokenizer, split, n, seed, **sizes):
        return [WorkloadItem("prose", f"prose-{split}-{i:04d}", split, ids[i], max_tokens=0) for i in range(n)]

    return make


def test_more_prose_skips_a_draw_that_repeats_a_kept_item(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c, d = (tuple(range(k * 100, k * 100 + 64)) for k in range(4))
    repeat = a[:40] + tuple(range(900, 924))  # shares most of item 0, where the suite's own items share nothing
    monkeypatch.setattr(prose_draw, "make_workload", fake_prose([a, b, repeat, c, d, *[a] * 20]))
    spec = dataclasses.replace(TINY_STANDARD, prose={"n": 2, "length": 64})
    items, limit = prose_draw.draw_prose(None, spec, 4)
    assert limit == 0
    assert [it.prompt_ids for it in items] == [a, b, c, d]
    with pytest.raises(ValueError, match="not 5"):  # only repeats of item 0 follow
        prose_draw.draw_prose(None, spec, 5)
    assert prose_draw.overlap(a, repeat) == pytest.approx(25 / 49)  # 25 of repeat's 49 windows of 16 are item 0's


def test_prose_n_draws_that_many_distinct_items_and_every_row_is_paired() -> None:
    run = [sys.executable, str(ROOT / "benchmarks/demote_bytes.py"), "--model", "tiny-random", "--suite", "standard",
           "--baselines", "streaming", "--baseline-dtypes", "int8", "--prose-n", "5", "--depths", "0.1,0.5",
           "--seeds", "11", "--filler", "repeat,prose", "--length", "400", "--json", "--threads", "1"]  # fmt: skip
    out = json.loads(subprocess.run(run, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    assert out["passkey_item_ids"] == ["0.1/11", "0.5/11", "prose/0.1/11", "prose/0.5/11"]
    assert out["prose_items"] == 5 and len(set(out["prose_item_ids"])) == 5
    assert out["prose_item_ids"][:2] == ["prose-heldout-0000", "prose-heldout-0001"]  # the suite's own come first
    assert out["prose_overlap_max"] <= out["prose_overlap_limit"]
    against = out["paired"]["against"]
    assert against == "dynamic+int4@int8"
    pairs = out["paired"]["rows"]
    assert set(pairs) == {"full@auto", "full@int8", "dynamic@int8", against, "streaming@int8"}
    for name, pair in pairs.items():
        row = out[name]
        assert len(row["prose_nll"]) == 5 and len(row["passkey_items"]) == 4
        delta = row.get("ppl_delta_pct", 0.0) - out[against]["ppl_delta_pct"]
        assert pair["ppl_diff_pp"] == pytest.approx(delta, abs=1e-9)
        assert pair["ppl_diff_ci95"][0] <= pair["ppl_diff_pp"] <= pair["ppl_diff_ci95"][1]
        assert pair["keys_row_only"] - pair["keys_against_only"] == row["passkey_right"] - out[against][
            "passkey_right"]  # fmt: skip
    assert pairs[against]["ppl_diff_pp"] == 0.0


def test_prose_n_beyond_what_the_split_gives_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = bench_script("demote_bytes")

    def too_few(tokenizer, spec, n, split="heldout", seed=0):
        raise ValueError(f"the {split} prose gives 12 items of 3000 tokens sharing at most 15% of their text, not {n}")

    monkeypatch.setattr(script, "draw_prose", too_few)
    monkeypatch.setattr(sys, "argv", ["demote_bytes.py", "--model", "tiny-random", "--prose-n", "14", "--threads", "1"])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--prose-n: the heldout prose gives 12 items" in err and "not 14" in err and "Traceback" not in err


def test_a_bad_filler_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    script = bench_script("demote_bytes")
    monkeypatch.setattr(sys, "argv", ["demote_bytes.py", "--model", "tiny-random", "--filler", "repeat,hay"])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--filler: one or more of repeat, prose, not 'repeat,hay'" in err and "Traceback" not in err
