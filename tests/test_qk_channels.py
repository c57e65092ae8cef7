"""``benchmarks/qk_channels.py`` (issue 35): it reads every layer's queries and keys through the model's own attention,
leaves the model's attention as it found it, and its shares are shares."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from confkv.model_loader import load_model
from tests.bench_scripts import ROOT, bench_script


def test_energies_come_from_every_layer_and_the_attention_is_restored() -> None:
    loaded = load_model("tiny-random")
    model, before = loaded.model, loaded.model.config._attn_implementation
    ids = torch.tensor([[5, 17, 42, 9, 3, 77, 21, 8]])
    with torch.no_grad():
        logits = model(ids).logits
    seen = bench_script("qk_channels").channel_energies(model, ids)
    cfg = model.config
    assert len(seen) == cfg.num_hidden_layers
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert seen[0][0].shape == (cfg.num_attention_heads, head_dim)
    assert seen[0][1].shape == (cfg.num_key_value_heads, head_dim)
    assert model.config._attn_implementation == before
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, logits, atol=1e-5), "the capture passes attention through"


def test_runs_on_tiny_random() -> None:
    run = [sys.executable, str(ROOT / "benchmarks/qk_channels.py"), "--model", "tiny-random", "--tokens", "48",
           "--json", "--threads", "1"]  # fmt: skip
    out = json.loads(subprocess.run(run, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    assert out["layer_heads"] > 0 and out["tokens"] == 48
    assert 0.0 < out["query_share_in_keys_top_eighth_min"] <= out["query_share_in_keys_top_eighth_max"] <= 1.0
    assert -1.0 <= out["log_corr_min"] <= out["log_corr_median"] <= out["log_corr_max"] <= 1.0
