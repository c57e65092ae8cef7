"""``confkv bench`` end to end on tiny-random: every output file, every required key."""

import json

from confkv.bench.report import REQUIRED_POLICY_KEYS
from confkv.bench.suite import scaled_dynamic
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
            assert entry["preemptions"] == 0 and entry["peak_pool_usage"] <= 1.0
        full = section["policies"]["full"]
        assert full["rougeL_vs_full"] == 1.0 and full["exact_match_vs_full"] == 1.0
        # the full cache is Hugging Face's own greedy output, batched statically or continuously
        assert section["hf_static"]["exact_match_vs_full"] == 1.0
    assert results["settings"]["requests"] == 8 and results["poisson"]["arrival_rate"] > 0
    assert set(results["running_trace"]) == {"burst", "poisson"}
