"""``benchmarks/int4_ablation.py`` (issue 35): its ``engine_vgG`` modes round as the engine's int4 pool does, so
their measurements of other value groups stand beside ``kv_cache_dtype: int4`` itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from confkv.kv.block_keys import ChannelKeyCodec
from tests.bench_scripts import ROOT, bench_script


def _run(script: str, *args: str) -> dict:
    run = [sys.executable, str(ROOT / "benchmarks" / script), "--model", "tiny-random", "--json", "--threads", "1"]
    return json.loads(subprocess.run([*run, *args], check=True, capture_output=True, text=True, cwd=ROOT).stdout)


def test_engine_mode_is_the_engines_int4_and_values_exact_cost_less() -> None:
    fake = _run("int4_ablation.py", "--modes", "engine_vg32,engine_vg0")
    engine = _run("kv_dtypes.py", "--dtypes", "auto,int4", "--no-step")
    assert fake["auto_ppl"] == engine["auto_ppl"]
    assert abs(fake["engine_vg32_ppl"] / engine["int4_ppl"] - 1) < 1e-6, (fake, engine["int4_ppl"])
    assert fake["engine_vg0_ppl"] != fake["engine_vg32_ppl"]


def test_finer_key_modes_reduce_to_the_engines_keys_and_round_closer() -> None:
    """Groups of a whole block and no channel at 8 bits are the engine's int4 keys before its outlier channels, to the
    bit, and a quarter of the channels at 8 bits are its keys now; a finer grid of either kind rounds closer; and the
    modes run, values exact or grouped."""
    mod = bench_script("int4_ablation")
    x = torch.randn(3, 16, 2, 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 8, 64)
    filled = torch.tensor([16, 5, 0])
    engine = mod.block_round(ChannelKeyCodec)(x, filled)
    assert torch.equal(mod.token_group_round(16)(x, filled), engine)
    assert torch.equal(mod.outlier_channel_round(0)(x, filled), engine)
    real = (torch.arange(16) < filled[:, None])[:, :, None, None]

    def err(y: torch.Tensor) -> float:
        return float(((y - x).square() * real).sum())

    assert err(mod.token_group_round(8)(x, filled)) < err(engine)
    assert err(mod.outlier_channel_round(8)(x, filled)) < err(engine)
    pool_keys = mod.block_round(mod.pool_int4_keys)(x, filled)  # the pool's int4: a quarter of channels at 8 bits
    assert (pool_keys - mod.outlier_channel_round(16)(x, filled)).abs().mul(real).max() < 1e-4
    out = _run("int4_ablation.py", "--modes", "engine_vg0,engine_kg16,engine_kt0,engine_kt4,engine_kg8,engine_kt2_vg32")
    assert out["engine_kg16_ppl"] == out["engine_kt0_ppl"] != out["engine_vg0_ppl"]
    assert out["engine_vg0_ppl"] == pytest.approx(out["engine_kt4_ppl"], rel=1e-5)  # tiny-random: head_dim 16
    assert out["engine_kg8_ppl"] != out["engine_kt0_ppl"] and "engine_kt2_vg32_ppl" in out
