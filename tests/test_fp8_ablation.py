"""``benchmarks/fp8_ablation.py`` (issue 35): its roundings are the formats they name, and the script runs."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from confkv.kv.block_keys import Fp8KeyCodec
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
    modes = "fp8,m23,fp8_k_rot,fp8_kmean,fp8_kmid,fp8_kmean_s1,fp8_kmean_w4"
    run = [sys.executable, str(ROOT / "benchmarks/fp8_ablation.py"), "--model", "tiny-random",
           "--modes", modes, "--json", "--threads", "1"]  # fmt: skip
    out = json.loads(subprocess.run(run, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    assert abs(out["m23_ppl"] - out["auto_ppl"]) < 1e-6 * out["auto_ppl"]  # no rounding, the same perplexity
    assert out["fp8_ppl"] != out["auto_ppl"]
    assert set(out) >= {"fp8_ppl_delta_pct", "fp8_k_rot_ppl_delta_pct", "fp8_kmean_ppl", "fp8_kmid_ppl"}
    assert out["fp8_kmean_ppl"] != out["auto_ppl"] and out["suite"] == "quick"
    assert out["fp8_kmean_w4_ppl"] == out["fp8_kmean_ppl"], "the engine's keys search 4 scales, weighted"
    assert "fp8_kmean_s1_ppl" in out  # the plain scale: the engine's keys before the search


def test_means_over_groups_of_rows_are_the_engines_codec_on_smaller_blocks() -> None:
    """``fp8_kmean_gG`` rounds each run of G rows as ``Fp8KeyCodec`` rounds a block of G: with G the block it is the
    engine's rounding, and a partly written block's groups take only their written rows."""
    mod = bench_script("fp8_ablation")
    x = torch.randn(3, 16, 2, 32) + 4.0
    filled = torch.tensor([16, 5, 11])
    whole = Fp8KeyCodec(32, 16)
    assert torch.equal(mod.group_mean_keys(16)(x, filled), whole.decode(whole.encode(x, filled), torch.float32))
    half = Fp8KeyCodec(32, 8)
    got = mod.group_mean_keys(8)(x, filled)
    first = half.decode(half.encode(x[1:2, :8], torch.tensor([5])), torch.float32)
    assert torch.equal(got[1, :5], first[0, :5])
    second = half.decode(half.encode(x[2:3, 8:], torch.tensor([3])), torch.float32)
    assert torch.equal(got[2, 8:11], second[0, :3])


def test_jitter_draws_each_mode_again() -> None:
    run = [sys.executable, str(ROOT / "benchmarks/fp8_ablation.py"), "--model", "tiny-random", "--modes",
           "fp8_kmean_g8", "--jitter", "2", "--jitter-scale", "1e-3", "--json", "--threads", "1"]  # fmt: skip
    out = json.loads(subprocess.run(run, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    draws = out["fp8_kmean_g8_jitter_ppl_delta_pct"]
    assert len(draws) == 2 and draws[0] != draws[1] and out["fp8_kmean_g8_jitter_ppl_delta_pct_mean"] == sum(draws) / 2
