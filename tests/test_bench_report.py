"""The benchmark report and text metrics on synthetic results: no model, seconds to run."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from confkv.bench.plots import _grid_cells, plot_passkey
from confkv.bench.report import REQUIRED_POLICY_KEYS, write_report
from confkv.bench.tables import equal_memory_comparisons, markdown_table
from confkv.bench.textmetrics import bleu4, rouge_l

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _policy(controller: str, size: int) -> dict[str, Any]:
    return {
        "controller": controller,
        "base_size": size,
        "max_size": 4 * size,
        "entropy_threshold": 3.5,
        "gap_threshold": 0.15,
        "scaling_factor": 0.8,
    }


def _entry(controller: str, kv: float, ppl: float | None, passkey: float, **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "policy": _policy(controller, 64),
        "kv_fraction_mean": kv,
        "kv_fraction_peak": min(1.0, kv * 1.3),
        "ppl": ppl,
        "ppl_delta_rel": None if ppl is None else ppl / 12.3 - 1,
        "kl_mean": 0.0 if controller == "full" else 0.0123,
        "passkey_acc": passkey,
        "multikey_acc": 0.8 * passkey,
        "bleu4_vs_full": 100.0 if controller == "full" else 41.5,
        "rougeL_vs_full": 1.0 if controller == "full" else 0.62,
        "tokens_per_s": 20.1,
        "requests_per_s": 0.5,
        "nvml_peak_bytes": None,
    }
    entry.update(extra)
    return entry


def _trace(n: int, prompt: int, kind: str, rng: random.Random) -> dict[str, list[Any]]:
    full_tokens = [prompt + i for i in range(n)]
    entropy = [max(0.0, rng.gauss(2.5, 1.2)) for _ in range(n)]
    gap = [min(1.0, max(0.0, rng.gauss(0.4, 0.25))) for _ in range(n)]
    if kind == "full":
        resident = full_tokens[:]
        budget = [float(r) for r in resident]
        expanded = [False] * n
    else:
        budget, expanded, b = [], [], 128.0
        for e, g in zip(entropy, gap, strict=True):
            up = e > 3.5 or g < 0.15
            b = b + 0.2 * (512 - b) if up else b - 0.2 * (b - 128)
            budget.append(b)
            expanded.append(up)
        resident = [min(int(b) + 16, t) for b, t in zip(budget, full_tokens, strict=True)]
    return {
        "resident": resident,
        "budget": budget,
        "entropy": entropy,
        "gap": gap,
        "expanded": expanded,
        "full_tokens": full_tokens,
    }


def _grid(rate: float, rng: random.Random) -> list[dict[str, Any]]:
    return [
        {"length": length, "depth": depth, "correct": rng.random() < rate}
        for length in (500, 1000, 2000)
        for depth in (0.1, 0.5, 0.9)
        for _ in range(2)
    ]


@pytest.fixture
def results() -> dict[str, Any]:
    rng = random.Random(0)
    return {
        "model": "smollm2-135m",
        "suite": "quick",
        "commit": "abc1234",
        "created": "2026-12-03T01:00:00Z",
        "settings": {"dynamic_scale": 0.125, "workloads": {"passkey": [500, 1000, 2000]}, "split": "heldout"},
        "policies": {
            "full": _entry("full", 1.0, 12.3, 1.0),
            "window": _entry("window", 0.3, None, 0.33, tokens_per_s=None),
            "dynamic": _entry("dynamic", 0.35, 12.6, 0.9),
        },
        "passkey_grid": {"full": _grid(1.0, rng), "window": _grid(0.3, rng), "dynamic": _grid(0.9, rng)},
        "long_trace": {"full": _trace(400, 600, "full", rng), "dynamic": _trace(400, 600, "dynamic", rng)},
    }


def _table_rows(table: str) -> dict[str, list[str]]:
    rows = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_write_report_writes_everything(results: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "run"
    written = write_report(results, out)
    assert set(written) == {"results", "report", "plane", "trace", "passkey"}
    for path in written.values():
        assert path.exists() and path.parent == out
    for key in ("plane", "trace", "passkey"):
        data = written[key].read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        assert len(data) > 5_000
    assert json.loads(written["results"].read_text()) == results
    report = written["report"].read_text()
    for name in results["policies"]:
        assert f"`{name}`" in report
    assert markdown_table(results).splitlines()[0] in report
    for header in ("KV mean %", "Δppl %", "BLEU-4 vs full", "ROUGE-L vs full", "tok/s", "req/s"):
        assert header in report
    for key in ("plane", "trace", "passkey"):
        assert f"]({written[key].name})" in report
    assert "How to read this" in report
    assert "smollm2-135m" in report and "abc1234" in report and "2026-12-03" in report


def test_none_values_print_na(results: dict[str, Any]) -> None:
    table = markdown_table(results)
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")][1:]
    rows = {name: dict(zip(header, cells, strict=True)) for name, cells in _table_rows(table).items()}
    assert list(rows) == ["full", "window", "dynamic"]
    window = rows["window"]
    assert window["ppl"] == "n/a" and window["Δppl %"] == "n/a" and window["tok/s"] == "n/a"
    assert rows["full"]["KV mean %"] == "100.0" and rows["dynamic"]["KV mean %"] == "35.0"
    assert rows["dynamic"]["Δppl %"].startswith("+")
    assert "n/a" not in [v for k, v in rows["full"].items() if k != "KV bytes mean %"]  # the fixture has no bytes


def test_partial_results_do_not_crash(results: dict[str, Any], tmp_path: Path) -> None:
    partial = copy.deepcopy(results)
    partial["policies"]["dynamic"]["ppl_delta_rel"] = None
    partial["policies"]["dynamic"]["kv_fraction_mean"] = math.nan
    partial["policies"]["full"]["passkey_acc"] = None
    partial["long_trace"]["dynamic"]["entropy"][3] = None
    partial["passkey_grid"]["window"] = []
    written = write_report(partial, tmp_path)
    assert {"plane", "trace", "passkey"} <= set(written)
    assert json.loads(written["results"].read_text())["policies"]["dynamic"]["kv_fraction_mean"] is None

    bare = copy.deepcopy(results)
    del bare["long_trace"]
    del bare["passkey_grid"]
    for entry in bare["policies"].values():
        for key in REQUIRED_POLICY_KEYS:
            entry[key] = None
    written = write_report(bare, tmp_path / "bare")
    assert set(written) == {"results", "report"}  # nothing to plot: no plot files, no broken links
    assert "n/a" in written["report"].read_text()


def test_missing_required_key_is_rejected(results: dict[str, Any], tmp_path: Path) -> None:
    del results["policies"]["window"]["kl_mean"]
    with pytest.raises(ValueError, match=r"window.*kl_mean"):
        write_report(results, tmp_path)


def test_bleu4() -> None:
    texts = ["the quick brown fox jumps over the lazy dog", "a b"]
    assert bleu4(texts, texts) == 100.0
    assert bleu4(["ok"], ["ok"]) == 100.0
    assert bleu4(["zebra xylophone quantum lemur violet"], ["the cat sat on the mat"]) < 1.0
    with pytest.raises(ValueError):
        bleu4([], [])
    with pytest.raises(ValueError):
        bleu4(["a"], ["a", "b"])


def test_rouge_l() -> None:
    texts = ["the quick brown fox jumps over the lazy dog", ""]
    assert rouge_l(texts, texts) == 1.0
    assert rouge_l(["zebra xylophone quantum lemur violet"], ["the cat sat on the mat"]) < 0.01
    assert 0.0 < rouge_l(["the cat sat on a mat"], ["the cat sat on the mat"]) < 1.0
    with pytest.raises(ValueError):
        rouge_l([], [])


# ---------------------------------------------------------------------------------- equal-memory comparisons


def _workloads(kv: float, kl: float, acc: float, bleu: float, budget: int | None) -> dict[str, Any]:
    common = {"kv_fraction_peak": min(1.0, 2 * kv), "kv_mean_tokens": 300 * kv, "kv_peak_tokens": 900, "steps": 100}
    common |= {"items": 4, "seconds": 1.0, "budget_tokens": budget, "kv_fraction_mean": kv}
    return {
        "prose": {**common, "kl_mean": kl, "ppl": 12.3 + kl},
        "longgen": {**common, "kl_mean": kl},
        "chat": {**common, "kl_mean": 2 * kl},
        "passkey": {**common, "acc": acc, "acc_by_filler": {"repeat": acc, "prose": acc / 2}},
        "multikey": {**common, "acc": 0.25},
        "longgen_free": {**common, "bleu4_vs_full": bleu, "rougeL_vs_full": bleu / 100},
    }


@pytest.fixture
def matched(results: dict[str, Any]) -> dict[str, Any]:
    """``dynamic`` with two baselines matched to it: ``snapkv`` has the lowest KL (prose, forced long generation,
    chat), ``dynamic`` wins pass-key and free long generation, multi-key ties, and ``window`` used 12% more memory
    on chat."""
    p = results["policies"]
    p["full"]["workloads"] = _workloads(1.0, 0.0, 1.0, 100.0, None)
    p["dynamic"]["workloads"] = _workloads(0.35, 0.05, 0.9, 90.0, None)
    p["window"]["workloads"] = _workloads(0.35, 0.30, 0.3, 60.0, 200)
    p["snapkv"] = _entry("snapkv", 0.35, 12.4, 0.8, workloads=_workloads(0.35, 0.02, 0.8, 85.0, 210))
    p["window"]["workloads"]["chat"]["kv_fraction_mean"] = 0.35 * 1.12
    for name in ("window", "snapkv"):
        p[name]["matched_to"] = "dynamic"
    results["settings"]["baseline_budgets"] = {"dynamic": {"prose": 200, "passkey": 180, "overall": 205}}
    results["settings"]["seconds"] = 2468.0
    results["settings"]["seconds_references"] = 250.0
    results["settings"]["seconds_per_policy"] = {"full": 300.0, "dynamic": 340.0}
    results["passkey_grid"]["snapkv"] = _grid(0.8, random.Random(1))
    return results


def test_equal_memory_verdicts(matched: dict[str, Any]) -> None:
    comp = equal_memory_comparisons(matched)
    assert list(comp) == ["dynamic"] and comp["dynamic"]["baselines"] == ["window", "snapkv"]
    w = comp["dynamic"]["workloads"]
    assert w["prose"]["ahead"] == ["snapkv"] and not w["prose"]["variant_ahead"]
    assert w["passkey"]["ahead"] == ["dynamic"] and w["passkey"]["variant_ahead"]
    assert w["longgen_free"]["ahead"] == ["dynamic"] and w["longgen_free"]["metric"] == "bleu4_vs_full"
    assert w["multikey"]["ahead"] == ["dynamic", "window", "snapkv"]  # a tie
    assert set(w["chat"]["memory_mismatch"]) == {"window"} and abs(w["chat"]["memory_mismatch"]["window"] - 0.12) < 1e-9
    assert not w["prose"]["memory_mismatch"]


def test_report_states_memory_verdicts_and_run_time(matched: dict[str, Any], tmp_path: Path) -> None:
    report = write_report(matched, tmp_path)["report"].read_text()
    assert "Run time: **41 min 08 s** (of which 4 min 10 s loading the model" in report
    assert "## Resident KV per workload (mean % / peak % of the full cache)" in report
    assert "| `dynamic` | 35.0 / 70.0 |" in report
    assert "| `dynamic` | 200 | 180 | 205 |" in report  # the budgets table: measures it has, then suite-wide
    assert "### `dynamic` against `window`, `snapkv`" in report
    rows = {line.split("|")[1].strip(): line for line in report.splitlines() if line.startswith("| ")}
    assert "`snapkv` KL 0.0200" in rows["prose"] and rows["prose"].split("|")[5].strip() == "`snapkv`"
    assert "90% (repeat 90%, prose 45%)" in rows["pass-key"]
    assert "tie: `dynamic`, `window`, `snapkv`" in rows["multi-key"]
    assert "memory differs: `window` +12%" in rows["chat"]
    assert (
        "`dynamic` is ahead at equal memory on 2 of 6 workloads (pass-key, long gen (free)), tied on 1 (multi-key), "
        "behind on 3 (prose, long gen (forced), chat)." in report
    )


def test_report_without_matching_has_no_verdicts(results: dict[str, Any], tmp_path: Path) -> None:
    report = write_report(results, tmp_path)["report"].read_text()
    assert "Who is ahead at equal memory" not in report and "Resident KV per workload" not in report


def test_passkey_plot_with_fillers(matched: dict[str, Any], tmp_path: Path) -> None:
    for grid in matched["passkey_grid"].values():
        for i, cell in enumerate(grid):
            cell["filler"] = ("repeat", "prose")[i % 2]
    assert plot_passkey(matched, tmp_path / "pk.png") is not None
    lengths, _, acc = _grid_cells(matched["passkey_grid"]["dynamic"])
    assert lengths == [
        ("prose", 500),
        ("prose", 1000),
        ("prose", 2000),
        ("repeat", 500),
        ("repeat", 1000),
        ("repeat", 2000),
    ]
    assert acc.shape == (3, 6)
