"""``confkv bench`` end to end on tiny-random (every output file, every required key), and the pieces of the
standard suite that need no model: its sizes and run-time estimate, budget matching, the run's policy plan."""

import json

import torch

from confkv.bench.memory import Usage, fixed_offset, matched_budget
from confkv.bench.report import REQUIRED_POLICY_KEYS, WORKLOAD_KEYS
from confkv.bench.specs import SUITES, estimate_seconds, scaled_dynamic
from confkv.bench.suite import plan_policies
from confkv.cli import main


def test_bench_quick_tiny_writes_everything(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--model", "tiny-random", "--suite", "quick", "--out", str(out)]) == 0
    paths = json.loads(capsys.readouterr().out)
    for name in ("results.json", "report.md", "memory_quality.png", "kv_trace.png", "passkey.png"):
        f = out / name
        assert f.is_file() and f.stat().st_size > 0, name
    assert set(paths) >= {"results", "report", "plane", "trace", "passkey"}
    results = json.loads((out / "results.json").read_text())
    assert {"model", "suite", "commit"} <= results.keys()
    assert set(results["policies"]) == {"full", "window", "streaming", "h2o", "snapkv", "dynamic"}
    for name, entry in results["policies"].items():
        missing = [k for k in REQUIRED_POLICY_KEYS if k not in entry]
        assert not missing, (name, missing)
    full = results["policies"]["full"]
    assert full["kl_mean"] < 1e-5 and abs(full["ppl_delta_rel"]) < 1e-6 and full["bleu4_vs_full"] == 100.0
    for name, entry in results["policies"].items():
        if name != "full":
            assert entry["kv_fraction_mean"] < 0.9, name
    assert "dynamic" in (out / "report.md").read_text()


def test_bench_split_train_measures_the_tuners_items(tmp_path, capsys):
    """``--split train`` scores other text than the default held-out items, and says so in the results."""
    ppl = {}
    for split in ("heldout", "train"):
        out = tmp_path / split
        args = ["bench", "--model", "tiny-random", "--suite", "quick", "--policies", "full", "--out", str(out)]
        assert main([*args, *(["--split", split] if split == "train" else [])]) == 0
        capsys.readouterr()
        results = json.loads((out / "results.json").read_text())
        assert results["settings"]["split"] == split
        ppl[split] = results["policies"]["full"]["ppl"]
    assert ppl["train"] != ppl["heldout"]
    assert "train items" in (tmp_path / "train" / "report.md").read_text()


def test_scaled_defaults():
    p = scaled_dynamic(0.125)
    assert (p.base_size, p.max_size, p.min_recent) == (128, 512, 64)
    assert (p.entropy_threshold, p.gap_threshold, p.scaling_factor) == (3.5, 0.15, 0.8)


def test_bench_rejects_unknown_policy(capsys, tmp_path):
    assert main(["bench", "--model", "tiny-random", "--policies", "full,best", "--out", str(tmp_path)]) == 2
    assert "unknown policy 'best'" in capsys.readouterr().err


THROUGHPUT_KEYS = (
    "requests_per_s", "output_tokens_per_s", "mean_running", "ttft_p50_s", "ttft_p99_s", "latency_p50_s",
    "latency_p99_s", "preemptions", "peak_pool_usage", "kv_fraction_mean", "rougeL_vs_full", "exact_match_vs_full",
)  # fmt: skip


def test_bench_throughput_tiny_writes_everything(tmp_path, capsys):
    out = tmp_path / "tp"
    args = ["bench", "--model", "tiny-random", "--suite", "throughput", "--policies", "full,dynamic", "--out", str(out)]
    assert main(args) == 0
    json.loads(capsys.readouterr().out)
    for name in ("results.json", "report.md", "throughput.png", "running.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    for section in (results, results["poisson"]):
        assert set(section["policies"]) == {"full", "dynamic"}
        for name, entry in section["policies"].items():
            missing = [k for k in THROUGHPUT_KEYS if k not in entry]
            assert not missing, (name, missing)
            assert entry["peak_pool_usage"] <= 1.0  # on demand (the default) it may preempt: answers still match
        full = section["policies"]["full"]
        assert full["rougeL_vs_full"] == 1.0 and full["exact_match_vs_full"] == 1.0
        # the full cache is Hugging Face's own greedy output, batched statically or continuously
        assert section["hf_static"]["exact_match_vs_full"] == 1.0
    assert results["settings"]["requests"] == 8 and results["poisson"]["arrival_rate"] > 0
    assert set(results["running_trace"]) == {"burst", "poisson"}


def test_throughput_max_tokens_keeps_the_prompts_and_sets_every_output(capsys):
    """``--max-tokens 1`` times prompt reading alone: the same prompts as the full run, each generating one token."""
    import dataclasses

    from confkv.bench.streams import TINY_THROUGHPUT, make_requests
    from tests.conftest import fresh_tiny

    tok = fresh_tiny().tokenizer
    drawn = make_requests(tok, TINY_THROUGHPUT)
    fixed = make_requests(tok, dataclasses.replace(TINY_THROUGHPUT, max_tokens=1))
    assert [r.prompt_ids for r in fixed] == [r.prompt_ids for r in drawn]
    assert {r.max_tokens for r in fixed} == {1} and len({r.max_tokens for r in drawn}) > 1
    args = ["bench", "--model", "tiny-random", "--suite", "throughput", "--out", "unused", "--max-tokens", "0"]
    assert main(args) == 2 and "--max-tokens must be positive" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ standard suite

WORKLOAD_MEASURES = ("prose", "longgen", "chat", "passkey", "multikey", "longgen_free")


def test_bench_standard_tiny_writes_everything(tmp_path, capsys):
    """The standard suite's shape on tiny-random: per-workload mean and peak memory, baselines matched to the
    built-in dynamic and re-matched to a policy file's dynamic, verdicts at equal memory, the run time."""
    policy_file = tmp_path / "tuned.yaml"
    policy_file.write_text(
        "cache_policy:\n  controller: dynamic\n  base_size: 48\n  max_size: 160\n  min_recent: 16\n"
        "  entropy_threshold: 2.0\n"
    )
    out = tmp_path / "std"
    args = ["bench", "--model", "tiny-random", "--suite", "standard", "--policies", "full,dynamic,window"]
    assert main([*args, "--policy-file", str(policy_file), "--out", str(out)]) == 0
    paths = json.loads(capsys.readouterr().out)
    assert set(paths) >= {"results", "report", "plane", "trace", "passkey"}
    for name in ("results.json", "report.md", "memory_quality.png", "kv_trace.png", "passkey.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "standard"
    policies = results["policies"]
    assert list(policies) == ["full", "dynamic", "window", "tuned", "window@tuned"]
    for name, entry in policies.items():
        keys = (*REQUIRED_POLICY_KEYS, "kv_mean_tokens", "kv_peak_tokens", "matched_to", "budgets", "seconds")
        missing = [k for k in keys if k not in entry]
        assert not missing, (name, missing)
        assert set(entry["workloads"]) == set(WORKLOAD_MEASURES), name
        for measure, w in entry["workloads"].items():
            assert not [k for k in WORKLOAD_KEYS if k not in w], (name, measure)
            assert w["steps"] > 0 and w["items"] > 0 and 0 < w["kv_fraction_peak"] <= 1.0, (name, measure)
        assert entry["requests_per_s"] is None  # the standard suite leaves serving to --suite throughput

    # baselines are matched to their own variant, measure by measure, and land near its measured mean
    assert policies["window"]["matched_to"] == "dynamic" and policies["window@tuned"]["matched_to"] == "tuned"
    assert policies["dynamic"]["matched_to"] is None and policies["tuned"]["matched_to"] is None
    budgets = results["settings"]["baseline_budgets"]
    assert set(budgets) == {"dynamic", "tuned"}
    for variant, baseline in (("dynamic", "window"), ("tuned", "window@tuned")):
        assert set(budgets[variant]) == {*WORKLOAD_MEASURES, "overall"}
        for measure in WORKLOAD_MEASURES:
            w, v = policies[baseline]["workloads"][measure], policies[variant]["workloads"][measure]
            assert w["budget_tokens"] == budgets[variant][measure] and v["budget_tokens"] is None
            assert abs(w["kv_fraction_mean"] / v["kv_fraction_mean"] - 1) < 0.1, (baseline, measure)
    assert budgets["tuned"]["prose"] > budgets["dynamic"]["prose"]  # the file keeps more, so its baselines do

    # every evicting policy evicts: the long chat is longer than anything a policy keeps
    for name, entry in policies.items():
        if name != "full":
            assert entry["workloads"]["chat"]["kv_fraction_peak"] < 0.9, name
            assert entry["kv_fraction_mean"] < 0.9, name
    assert {r["filler"] for r in results["passkey_grid"]["dynamic"]} == {"repeat", "prose"}
    comparisons = results["comparisons"]
    assert set(comparisons) == {"dynamic", "tuned"} and comparisons["tuned"]["baselines"] == ["window@tuned"]
    for comp in comparisons.values():
        assert set(comp["workloads"]) == set(WORKLOAD_MEASURES)
        assert all(c["ahead"] for c in comp["workloads"].values())
    st = results["settings"]
    assert st["seconds"] > 0 and set(st["seconds_per_policy"]) == set(policies)

    report = (out / "report.md").read_text()
    for text in (
        "Run time: **",
        "Resident KV per workload (mean % / peak % of the full cache)",
        "Baseline budgets (tokens)",
        "Who is ahead at equal memory",
        "### `dynamic` against `window`",
        "### `tuned` against `window@tuned`",
        "is ahead at equal memory on",
    ):
        assert text in report, text


def test_standard_sizes():
    """Items of 2,000-4,000 tokens, long generations of 1,000+, the requirement's sizes divided by 4, and a run
    time near 40 minutes on the 2-core CPU (an hour at most with the references built)."""
    spec = SUITES["standard"]
    p = scaled_dynamic(spec.scale)
    assert (p.base_size, p.max_size, p.min_recent) == (256, 1024, 128)
    assert all(2000 <= n <= 4000 for n in spec.passkey["lengths"])
    assert set(spec.passkey["filler"]) == {"repeat", "prose"} and len(spec.passkey["depths"]) >= 3
    for sizes in (spec.multikey, spec.prose, spec.chat):
        assert 2000 <= sizes["length"] <= 4000
    assert spec.free_tokens >= 1000 and spec.longgen["max_tokens"] >= 1000 and spec.chat["turns"] >= 4
    assert min(spec.passkey["lengths"]) > p.max_size and spec.chat["length"] > p.max_size
    est = estimate_seconds(spec, 6)
    assert 20 * 60 < est["low"] < est["high"] <= 60 * 60
    assert est["calibration"] >= 1.0
    assert "full" not in SUITES  # replaced by standard


def _usage(mode, positions, resident):
    u = Usage(mode)
    p = torch.tensor(positions, dtype=torch.float64)
    u.positions.append(p)
    u.full, u.resident, u.steps, u.items = float(p.sum()), float(resident), len(positions), 1
    return u


def test_matched_budget_inverts_the_fixed_prediction():
    policy = scaled_dynamic(0.25)
    positions = list(range(2, 3001))
    for mode in ("chunked", "decode"):
        off = fixed_offset(mode, policy)
        for budget in (200, 384, 1000):
            held = sum(min(p, budget + off) for p in positions)
            assert abs(matched_budget([_usage(mode, positions, held)], held, policy) - budget) <= 1
    everything = _usage("decode", positions, sum(positions))
    assert matched_budget([everything], everything.resident, policy) >= 3000  # keeps all: no eviction
    tiny = _usage("decode", positions, 10.0)
    assert matched_budget([tiny], tiny.resident, policy) == 2 * policy.block_size  # never below two blocks
    # several measures at once: one budget for their pooled steps
    a, b = _usage("chunked", positions, 0), _usage("decode", list(range(100, 1100)), 0)
    target = sum(min(p, 500 + fixed_offset("chunked", policy)) for p in positions) + sum(
        min(p, 500 + fixed_offset("decode", policy)) for p in range(100, 1100)
    )
    assert abs(matched_budget([a, b], target, policy) - 500) <= 1


def test_plan_policies(tmp_path):
    dyn = scaled_dynamic(0.25)
    tuned = tmp_path / "tuned.yaml"
    tuned.write_text("cache_policy:\n  controller: dynamic\n  base_size: 128\n  max_size: 512\n  min_recent: 64\n")
    fixed = tmp_path / "big-h2o.yaml"
    fixed.write_text("cache_policy:\n  controller: h2o\n  max_size: 900\n")
    clash = tmp_path / "dynamic.yaml"
    clash.write_text("cache_policy:\n  controller: dynamic\n  base_size: 64\n  max_size: 256\n  min_recent: 32\n")
    plan = plan_policies(["full", "dynamic", "h2o", "snapkv"], [str(tuned), str(fixed), str(clash)], dyn)
    assert [(p.name, p.matched_to) for p in plan] == [
        ("full", None),
        ("dynamic", None),
        ("h2o", "dynamic"),
        ("snapkv", "dynamic"),
        ("tuned", None),
        ("h2o@tuned", "tuned"),
        ("snapkv@tuned", "tuned"),
        ("dynamic-2", None),
        ("h2o@dynamic-2", "dynamic-2"),
        ("snapkv@dynamic-2", "dynamic-2"),
        ("big-h2o", None),
    ]
    assert plan[5].policy.controller == "h2o" and plan[5].policy.block_size == dyn.block_size
    # without a variant the baselines run at the default budget, as before matching existed
    alone = plan_policies(["full", "window"], [], dyn)
    assert [(p.name, p.matched_to, p.policy.controller) for p in alone] == [
        ("full", None, "full"),
        ("window", None, "window"),
    ]
    assert alone[1].policy.max_size == 2 * dyn.base_size


def test_throughput_rows_are_unique_and_bad_input_is_refused_before_the_run(tmp_path, capsys):
    """A name given twice is one row and the same policy file twice two rows (they clashed: a result was
    overwritten, and the run ended in a traceback after the whole scenario); an --out that is a file and a rate
    that is not a number are refused before any model loads."""
    policy = tmp_path / "dynamic.yaml"
    policy.write_text("cache_policy: {controller: window, max_size: 64}\n")
    out = tmp_path / "tp"
    args = ["bench", "--model", "tiny-random", "--suite", "throughput", "--policies", "full,full,dynamic",
            "--policy-file", str(policy), "--policy-file", str(policy), "--scenarios", "burst", "--no-hf",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    rows = json.loads((out / "results.json").read_text())["policies"]
    assert list(rows) == ["full", "dynamic", "dynamic-2", "dynamic-3"]
    assert rows["dynamic-2"]["rougeL_vs_full"] <= 1.0 and rows["full"]["exact_match_vs_full"] == 1.0
    taken = tmp_path / "a-file"
    taken.write_text("")
    for bad, says in ((["--out", str(taken)], "is an existing file"),
                      (["--out", str(out), "--arrival-rate", "nan"], "must be positive numbers")):  # fmt: skip
        assert main(["bench", "--model", "tiny-random", "--suite", "throughput", *bad]) == 2
        assert says in capsys.readouterr().err
    assert main(["bench", "--model", "tiny-random", "--suite", "quick", "--out", str(taken)]) == 2
    assert "existing file" in capsys.readouterr().err


def test_a_pass_key_goes_at_a_boundary_before_its_depth():
    from confkv.bench.passkey import _boundary

    assert _boundary("One. Two three", 9) == 5  # after the sentence
    assert _boundary("no sentence\nends here", 16) == 12  # else after the line
    assert _boundary("hard-wrapped words only", 16) == 13  # else after a word
    assert _boundary("unbroken", 5) == 0


def test_bench_throughput_longgen_runs_both_admissions_and_writes_its_section(tmp_path, capsys):
    """The long-generation stream (short asks, long outputs, the pool sized for ``full_fits`` of its longest) runs
    every policy under both admission modes: on-demand ``full`` runs more sequences at once than reserved
    ``full``, with the same answers, and requests/s are against on-demand ``full``."""
    out = tmp_path / "lg"
    args = ["bench", "--model", "tiny-random", "--suite", "throughput", "--policies", "full,dynamic", "--scenarios",
            "longgen", "--admission", "reserve,on_demand", "--ceiling", "8", "--no-hf", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    section = results["longgen"]
    rows = section["policies"]
    assert list(rows) == ["full:reserve", "full:on_demand", "dynamic:reserve", "dynamic:on_demand", "full:8x"]
    assert rows["full:8x"]["max_running"] == 6 and rows["full:8x"]["exact_match_vs_full"] == 1.0  # all at once
    assert section["speed_reference"] == "full:on_demand" and rows["full:on_demand"]["requests_per_s_vs_full"] == 1
    assert rows["full:on_demand"]["exact_match_vs_full"] == 1.0
    assert rows["full:on_demand"]["max_running"] > rows["full:reserve"]["max_running"]
    assert rows["full:reserve"]["preemptions"] == 0
    settings = results["settings"]
    assert settings["stream"] == "longgen" and settings["admissions"] == ["reserve", "on_demand"]
    assert 200 <= settings["prompt_tokens_mean"] <= 300
    assert "## longgen: all requests submitted at the start" in (out / "report.md").read_text()


def test_longgen_requests_are_short_asks_for_long_texts():
    from confkv.bench.streams import TINY_LONGGEN, make_longgen_requests
    from tests.conftest import fresh_tiny

    tok = fresh_tiny().tokenizer
    reqs = make_longgen_requests(tok, TINY_LONGGEN)
    assert len(reqs) == TINY_LONGGEN.requests
    texts = [tok.decode(list(r.prompt_ids)) for r in reqs]
    # notes fill a prompt up to its drawn length, never past the longest (only an ask alone can be longer)
    assert all(
        len(r.prompt_ids) <= TINY_LONGGEN.prompt_tokens[1] or "notes" not in t for r, t in zip(reqs, texts, strict=True)
    )
    assert sum("notes" in t for t in texts) >= len(reqs) // 2
    assert all(TINY_LONGGEN.output_tokens[0] <= r.max_tokens <= TINY_LONGGEN.output_tokens[1] for r in reqs)
    assert all("Aim for about" in t for t in texts)  # the ask survives its length
    assert reqs == make_longgen_requests(tok, TINY_LONGGEN)  # deterministic by seed
    bad = ["bench", "--model", "tiny-random", "--suite", "throughput", "--out", "unused"]
    assert main([*bad, "--scenarios", "longgen,marathon"]) == 2
    assert main([*bad, "--output-tokens", "9,3"]) == 2
    assert main([*bad, "--admission", "reserve,hoard"]) == 2
    assert main([*bad, "--ceiling", "1"]) == 2


def test_bench_longgen_suite_writes_curves_and_summary(tmp_path, capsys):
    """``--suite longgen``: every policy's runs, per-position bands of each metric and the summary beside them;
    ``full`` holds every token (share 1) and matches itself, ``dynamic`` holds less."""
    out = tmp_path / "curves"
    args = ["bench", "--model", "tiny-random", "--suite", "longgen", "--runs", "4", "--policies", "full,dynamic",
            "--admission", "on_demand", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    for name in ("results.json", "report.md", "curves.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["runs"] == 4 and list(results["summary"]) == ["full", "dynamic"]
    full, dyn = results["summary"]["full"], results["summary"]["dynamic"]
    assert full["kv_share_mean"] == 1.0 and full["bleu4_vs_full"] == 100.0
    assert dyn["kv_share_mean"] < 1.0
    longest = len(results["curves"]["full"]["resident"]["p50"])  # the longest run's positions
    assert results["settings"]["output_tokens"][0] <= longest <= results["settings"]["output_tokens"][1]
    for metric in ("resident", "budget", "entropy", "gap", "expanded", "step_s", "kv_share"):
        bands = results["curves"]["dynamic"][metric]
        assert len(bands["p50"]) == len(bands["p10"]) == len(bands["p90"]) == longest, metric
        assert all(lo <= mid <= hi for lo, mid, hi in zip(bands["p10"], bands["p50"], bands["p90"], strict=True)
                   if lo is not None), metric  # fmt: skip
    assert "| `dynamic` |" in (out / "report.md").read_text()
    assert main(["bench", "--model", "tiny-random", "--suite", "longgen", "--runs", "0", "--out", str(out)]) == 2


def test_throughput_repeats_give_every_row_intervals_and_a_sized_baseline_is_a_row(tmp_path, capsys):
    """``--repeats 2``: each row runs twice with the same answers; requests/s is the mean of the two runs with a t
    interval around it, the ratio to on-demand ``full`` has a Bonferroni interval (none for ``full`` itself) and
    the KV share a bootstrap interval over requests. ``h2o@64`` is h2o at 64 tokens, half of them recent."""
    out = tmp_path / "rep"
    args = ["bench", "--model", "tiny-random", "--suite", "throughput", "--policies", "full,dynamic,h2o@64",
            "--scenarios", "longgen", "--repeats", "2", "--no-hf", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    rows = results["longgen"]["policies"]
    assert list(rows) == ["full", "dynamic", "h2o@64"] and results["longgen"]["repeats"] == 2
    h2o = results["policy_settings"]["h2o@64"]
    assert (h2o["controller"], h2o["max_size"], h2o["min_recent"]) == ("h2o", 64, 32)
    for name, m in rows.items():
        runs = m["requests_per_s_runs"]
        assert len(runs) == 2 and m["same_answers_every_run"], name
        assert abs(m["requests_per_s"] - sum(runs) / 2) < 1e-12
        low, high = m["requests_per_s_ci"]
        assert low < min(runs) <= max(runs) < high, name  # two runs: t(1) puts the interval far outside both
        kv_low, kv_high = m["kv_fraction_ci"]
        assert kv_low <= m["kv_fraction_mean"] <= kv_high, name
    assert rows["full"]["requests_per_s_vs_full_ci"] is None and rows["full"]["kv_fraction_ci"] == [1.0, 1.0]
    from confkv.bench.intervals import ratio_interval

    expected = ratio_interval(rows["dynamic"]["requests_per_s_runs"], rows["full"]["requests_per_s_runs"])
    assert rows["dynamic"]["requests_per_s_vs_full_ci"] == (None if expected is None else list(expected))
    assert rows["h2o@64"]["kv_fraction_mean"] < 1.0
    report = (out / "report.md").read_text()
    assert "the mean of 2 runs per row" in report
    assert f"| `dynamic` | {rows['dynamic']['requests_per_s']:.3f} [" in report
    bad = ["bench", "--model", "tiny-random", "--suite", "throughput", "--scenarios", "longgen", "--no-hf"]
    assert main([*bad, "--out", str(out), "--repeats", "0"]) == 2
    assert "--repeats takes" in capsys.readouterr().err
    assert main([*bad, "--out", str(tmp_path / "bad"), "--policies", "full,dynamic@64"]) == 2
    assert "a size goes with a fixed baseline" in capsys.readouterr().err


def test_intervals_are_the_textbook_ones():
    """Student's t for three runs (mean 2, sd 1: half-width t(0.975, 2) / sqrt(3) = 2.484), the ratio bounded by
    the two 97.5% intervals, a bootstrap interval inside the data's range; none from a single value."""
    from confkv.bench.intervals import bootstrap_mean, ratio_interval, t_interval

    low, high = t_interval([1.0, 2.0, 3.0])
    assert abs(low - (2 - 2.4841)) < 1e-3 and abs(high - (2 + 2.4841)) < 1e-3
    a, b = [2.0, 2.1, 1.9], [1.0, 1.05, 0.95]
    (la, ha), (lb, hb) = t_interval(a, 0.975), t_interval(b, 0.975)
    assert ratio_interval(a, b) == (la / hb, ha / lb)
    assert la / hb < (sum(a) / 3) / (sum(b) / 3) < ha / lb
    assert ratio_interval(a, [1.0, 2.0, 3.0]) is None  # the denominator's interval reaches below zero
    values = [0.2, 0.4, 0.6, 0.8]
    lo, hi = bootstrap_mean(values)
    assert 0.2 <= lo < 0.5 < hi <= 0.8
    assert t_interval([1.0]) is None and bootstrap_mean([1.0]) is None and ratio_interval([1.0], b) is None


def test_headline_assembles_throughput_and_fidelity_into_one_table(tmp_path, capsys):
    """``benchmarks/headline.py`` joins a longgen throughput run (with repeats) and ``longgen_fidelity.py``'s JSON
    by policy: every figure is the one its run measured, with its interval, ``full`` is the reference of both, and
    a row only one of them measured (the fidelity's noise floor, here a fixed baseline) keeps the other's cells
    empty; ``--plot`` draws the frontier beside it. A missing file is one line and exit 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "tp"
    args = ["bench", "--model", "tiny-random", "--suite", "throughput", "--policies", "full,dynamic", "--scenarios",
            "longgen", "--requests", "3", "--repeats", "2", "--ceiling", "2", "--no-hf", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    fid = tmp_path / "fidelity.json"
    run = [sys.executable, str(root / "benchmarks/longgen_fidelity.py"), "--model", "tiny-random", "--requests", "2",
           "--output-tokens", "8,12", "--policies", "dynamic,h2o@32", "--paired-against", "h2o@32,dynamic",
           "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    fid.write_text(subprocess.run(run, capture_output=True, text=True, check=True, env=env, cwd=root).stdout)
    head = [sys.executable, str(root / "benchmarks/headline.py"), "--throughput", str(out / "results.json"),
            "--fidelity", str(fid)]  # fmt: skip
    table = json.loads(subprocess.run([*head, "--json"], capture_output=True, text=True, check=True, cwd=root).stdout)
    rows = table["rows"]
    assert list(rows) == ["full", "dynamic", "full:2x", "h2o@32"]
    tp = json.loads((out / "results.json").read_text())["longgen"]["policies"]
    fidelity = json.loads(fid.read_text().splitlines()[-1])["policies"]
    dyn = rows["dynamic"]
    assert dyn["vs_full"][0] == tp["dynamic"]["requests_per_s_vs_full"]
    assert dyn["requests_per_s"] == [tp["dynamic"]["requests_per_s"], *tp["dynamic"]["requests_per_s_ci"]]
    assert dyn["kv_share"] == [tp["dynamic"]["kv_fraction_mean"], *tp["dynamic"]["kv_fraction_ci"]]
    assert dyn["kl"] == fidelity["dynamic"]["kl"] and dyn["bleu4_vs_full"] == fidelity["dynamic"]["bleu4_vs_full"]
    diff, lo, hi = fidelity["dynamic"]["kl_minus_h2o@32"]  # paired: the same requests drawn for both rows
    assert abs(diff - (fidelity["dynamic"]["kl"][0] - fidelity["h2o@32"]["kl"][0])) < 1e-9 and lo <= diff <= hi
    assert "kl_minus_h2o@32" not in fidelity["h2o@32"] and "kl_minus_dynamic" not in fidelity["dynamic"]
    assert fidelity["h2o@32"]["kl_minus_dynamic"][0] == -diff
    assert rows["full"]["reference_of_speed"] and rows["full"]["kl"][0] == 0.0
    assert "requests_per_s" not in rows["h2o@32"] and rows["h2o@32"]["kl"] == fidelity["h2o@32"]["kl"]
    png = tmp_path / "frontier.png"  # the frontier plot beside the table
    md = subprocess.run([*head, "--plot", str(png)], capture_output=True, text=True, check=True, cwd=root).stdout
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "| `full` |" in md and "1.00x (reference)" in md and f"| `dynamic` | {dyn['kv_share'][0]:.2f} [" in md
    unknown = subprocess.run([*run[:-2], "nope", "--json"], capture_output=True, text=True, env=env, cwd=root)
    assert unknown.returncode == 2 and "--paired-against 'nope' is not one of the rows" in unknown.stderr
    bad = subprocess.run([*head[:2], "--fidelity", str(tmp_path / "none.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "is not a file" in bad.stderr
