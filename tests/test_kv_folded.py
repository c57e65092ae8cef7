"""Decode attention over an int8 or fp8 pool's codes with the scales folded into scores and probabilities
(``confkv/kv/folded.py``): the same attention as decoding every row and running SDPA, to float32 rounding; int4, the
float window and ``auto`` keep SDPA (the Hugging Face parity tests hold ``auto``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from confkv import LLM
from confkv.engine.params import SamplingParams
from confkv.kv import attention, folded
from confkv.kv.pool import BlockPool

from .conftest import fresh_tiny

DTYPES = ["int8", "fp8"]
N, BLOCKS, BS, KVH, D, GROUPS = 3, 5, 4, 2, 64, 3


def _pool(dtype: str) -> tuple[BlockPool, torch.Tensor]:
    """``N`` sequences of ``BLOCKS`` blocks of random keys (some channels ten times the others, as RoPE'd keys have)
    and values in two layers, and the sequences' blocks ``[N, BLOCKS]``."""
    torch.manual_seed(0)
    pool = BlockPool(num_layers=2, num_kv_heads=KVH, head_dim=D, block_size=BS, num_blocks=N * BLOCKS + 2,
                     dtype=torch.float32, device="cpu", kv_cache_dtype=dtype)  # fmt: skip
    ids = pool.allocate(N * BLOCKS)
    blocks = torch.tensor(ids).view(N, BLOCKS)
    slots = pool.slots_of(ids)
    for layer in range(2):
        k = torch.randn(len(slots), KVH, D) * (1 + 9 * (torch.rand(1, 1, D) < 0.1))
        v = torch.randn(len(slots), KVH, D)
        pool.store(layer, slots, k, v)
    return pool, blocks


def _valid() -> torch.Tensor:
    """Rows of different lengths: the last block of row ``i`` holds ``BS - i`` tokens."""
    valid = torch.ones(N, BLOCKS * BS, dtype=torch.bool)
    for i in range(N):
        valid[i, BLOCKS * BS - i :] = False
    return valid


def _dequantised_sdpa(pool: BlockPool, layer: int, blocks: torch.Tensor, qg: torch.Tensor, valid: torch.Tensor):
    """The reference: every gathered row decoded, then SDPA."""
    flat = blocks.reshape(-1)
    by_block = pool.k[layer].view(pool.num_blocks, BS, KVH, -1)[flat]
    keys = pool.dequant_k(by_block)
    values = pool.dequant(pool.v[layer].view(pool.num_blocks, BS, KVH, -1)[flat])
    keys = keys.reshape(N, -1, KVH, D).transpose(1, 2)
    values = values.reshape(N, -1, KVH, D).transpose(1, 2)
    return F.scaled_dot_product_attention(qg, keys, values, attn_mask=valid[:, None, None, :], scale=D**-0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_folded_attention_is_dequantise_then_sdpa(dtype: str) -> None:
    pool, blocks = _pool(dtype)
    valid = _valid()
    for layer in range(2):
        qg = torch.randn(N, KVH, GROUPS, D, generator=torch.Generator().manual_seed(layer))
        ref = _dequantised_sdpa(pool, layer, blocks, qg, valid)
        out = folded.decode_attention(pool, layer, blocks, qg, valid, D**-0.5)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert (out - ref).abs().max() < 2e-5 * ref.abs().max(), (dtype, layer)


def test_only_per_token_formats_on_the_cpu_fold() -> None:
    """int4 (zero points, per-channel keys) keeps decoding and SDPA: folded it measured slower."""
    assert folded.supported(_pool("int8")[0]) and folded.supported(_pool("fp8")[0])
    assert not folded.supported(_pool("int4")[0])


def _generate(dtype: str, window: int) -> tuple[list[int], torch.Tensor]:
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype=dtype, kv_float_window=window,
              kv_cache_memory="4MiB")  # fmt: skip
    prompts = [list(range(5, 45)), list(range(50, 63))]  # one decode batch of rows of different lengths
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0))
    return [t for o in outs for t in o.token_ids], torch.tensor([lp.logprob for o in outs for lp in o.logprobs])


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_generation_through_the_folded_path_is_the_dequantised_one(
    dtype: str, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On tiny-random, greedy decoding reads the same tokens with each token's log-probability within float32
    rounding (carried through the layers and steps), folded or decoding every row; with a float window both take the
    decoded rows, exactly the same. The C++ kernel (``tests/test_kv_kernel.py``), which would serve both, is off."""
    monkeypatch.setattr(attention, "DECODE_KERNEL", False)
    tokens, logprobs = _generate(dtype, window)
    monkeypatch.setattr(attention, "FOLD_DECODE", False)
    ref_tokens, ref_logprobs = _generate(dtype, window)
    assert tokens == ref_tokens
    assert (logprobs - ref_logprobs).abs().max() < 1e-3
    if window:
        assert torch.equal(logprobs, ref_logprobs)
