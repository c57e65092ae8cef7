"""oneDNN-packed linear layers: same products as ``nn.Linear``, applied once per shared model, skippable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from confkv import LLM
from confkv.engine.linear import PackedLinear, can_pack, pack_linears

from .conftest import fresh_tiny

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 5, 64])
def test_packed_linear_computes_what_nn_linear_does(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        strided = torch.randn(1, 2 * rows, 48)[:, ::2]
        torch.testing.assert_close(packed(strided), linear(strided), rtol=1e-5, atol=1e-5)


def test_pack_linears_replaces_every_linear_once_and_keeps_the_logits():
    loaded = fresh_tiny()
    model = loaded.model
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    ids = torch.tensor([[3, 17, 99, 5, 42]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    assert can_pack(model)
    assert pack_linears(model) == n_linear > 0
    assert pack_linears(model) == 0  # a second engine over the same model packs nothing
    assert not any(type(m) is nn.Linear for m in model.modules())
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-4, atol=1e-4)


def test_engine_packs_by_default_and_can_be_told_not_to():
    packed = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_memory="4MiB")
    assert isinstance(packed.engine.model.lm_head, PackedLinear)
    plain = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_memory="4MiB", pack_weights=False)
    assert type(plain.engine.model.lm_head) is nn.Linear


def test_models_off_cpu_or_in_half_precision_are_left_alone():
    model = nn.Sequential(nn.Linear(4, 4)).half()
    assert not can_pack(model)
    assert pack_linears(model) == 0
