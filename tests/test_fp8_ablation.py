"""``benchmarks/fp8_ablation.py`` (issue 35): its roundings are the formats they name, and the script runs."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.bench_scripts import ROOT, bench_script


def test_three_mantissa_bits_round_as_e4m3_in_its_normal_range() -> None:
    mantissa_round = bench_script("fp8_ablation").mantissa_round
    x = torch.randn(4096) * 20
    x = x[(x.abs() > 2**-6) & (x.abs() < 448)]
    assert torch.equal(mantissa_round(x, 3), x.to(torch.float8_e4m3fn).float())
    assert torch.equal(mantissa_round(x, 23), x)  # float32's own mantissa: nothing to round


def test_rotation_is_orthonormal_and_undone() -> None:
    mod = bench_script("fp8_ablation")
    h = mod.hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    x = torch.randn(5, 3, 64)
    assert torch.allclose(mod.rotated(lambda y: y)(x), x, atol=1e-5)


def test_runs_on_tiny_random() -> None:
    run = [sys.executable, str(ROOT / "benchmarks/fp8_ablation.py"), "--model", "tiny-random",
           "--modes", "fp8,m23,fp8_k_rot,fp8_kmean,fp8_kmid", "--json", "--threads", "1"]  # fmt: skip
    out = json.loads(subprocess.run(run, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    assert abs(out["m23_ppl"] - out["auto_ppl"]) < 1e-6 * out["auto_ppl"]  # no rounding, the same perplexity
    assert out["fp8_ppl"] != out["auto_ppl"]
    assert set(out) >= {"fp8_ppl_delta_pct", "fp8_k_rot_ppl_delta_pct", "fp8_kmean_ppl", "fp8_kmid_ppl"}
    assert out["fp8_kmean_ppl"] != out["auto_ppl"] and out["suite"] == "quick"
