"""The C++ decode-attention kernel over a quantised pool's codes (``confkv/kv/kernel.py``): the same attention as
decoding every row and running SDPA, within float32 rounding, for int8, fp8 and int4 with GQA, rows of different
lengths, partial last blocks, padding blocks and a sliding window; over fp8 and int4 pools with a float window, the
torch window path (codes decoded, then the window's blocks overwritten by their exact copies); the same greedy
tokens in the engine, with and without a float window; the torch path when it is switched off or cannot be built.

The first test builds the kernel into the machine's cache (``$CONFKV_CACHE/kernels``) if it is not there: about a
minute of g++ on the 2-core CI machine, once; later runs import the built module.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from confkv import LLM
from confkv.engine.params import SamplingParams
from confkv.kv import attention, kernel
from confkv.kv.pool import BlockPool

from .conftest import fresh_tiny

DTYPES = ["int8", "fp8", "int4"]
KVH, GROUPS = 2, 3
LENGTHS = [37, 16, 5]  # tokens per row: a partial last block, exactly one full block, less than one block
BS = 16


def _pool(dtype: str, d: int, float_window: int = 0) -> tuple[BlockPool, torch.Tensor, torch.Tensor]:
    """Rows of ``LENGTHS`` tokens of random keys (some channels ten times the others, as RoPE'd keys have) and
    values in two layers, written token by token's slots as the engine writes them; their blocks ``[n, width]``
    (shorter rows padded with their last block, as the runner pads) and the valid slots ``[n, width * BS]``. With
    ``float_window`` R the blocks holding each row's last R tokens join the window and keep exact copies, as the
    cache manager and the runner's window writes leave them."""
    torch.manual_seed(0)
    per_row = [-(-n // BS) for n in LENGTHS]
    pool = BlockPool(num_layers=2, num_kv_heads=KVH, head_dim=d, block_size=BS, num_blocks=sum(per_row) + 3,
                     dtype=torch.float32, device="cpu", kv_cache_dtype=dtype, float_window=float_window)  # fmt: skip
    pool.allocate(2)  # the rows' blocks do not start at block 0
    width = max(per_row)
    rows, valid = [], torch.zeros(len(LENGTHS), width * BS, dtype=torch.bool)
    for i, (n, nb) in enumerate(zip(LENGTHS, per_row, strict=True)):
        ids = pool.allocate(nb)
        slots = pool.slots_of(ids)[:n]
        if pool.window is not None:
            pool.window.update(ids[pool.window.first_block(n) :], [])
        for layer in range(2):
            k = torch.randn(n, KVH, d) * (1 + 9 * (torch.rand(1, 1, d) < 0.1))
            v = torch.randn(n, KVH, d) + 0.5
            pool.store(layer, slots, k, v)
            plan = pool.window.rows_of(slots) if pool.window is not None else None
            if plan is not None:
                pool.window.write(layer, plan, k, v)
        rows.append(ids + ids[-1:] * (width - nb))
        valid[i, :n] = True
    return pool, torch.tensor(rows), valid


def _dequantised_sdpa(pool: BlockPool, layer: int, blocks: torch.Tensor, qg: torch.Tensor, valid: torch.Tensor):
    """The reference: every gathered row decoded, then SDPA (the engine's eager path)."""
    n, d = blocks.shape[0], pool.head_dim
    flat = blocks.reshape(-1)
    keys = pool.dequant_k(pool.k[layer].view(pool.num_blocks, BS, KVH, -1)[flat])
    values = pool.dequant(pool.v[layer].view(pool.num_blocks, BS, KVH, -1)[flat])
    plan = pool.window.blocks_of(flat) if pool.window is not None else None
    if plan is not None:  # attention.py's window path: the window's blocks overwritten by their exact copies
        pool.window.read_into(layer, plan, keys.view(-1, BS, KVH, d), values.view(-1, BS, KVH, d))
    keys = keys.reshape(n, -1, KVH, d).transpose(1, 2)
    values = values.reshape(n, -1, KVH, d).transpose(1, 2)
    return F.scaled_dot_product_attention(qg, keys, values, attn_mask=valid[:, None, None, :], scale=d**-0.5)


@pytest.mark.parametrize("d", [16, 24, 64])  # tiny-random's (one int4 value group), fp8 means padding a row, smollm2's
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_is_dequantise_then_sdpa(dtype: str, d: int) -> None:
    """Within 1e-5 of the output's largest value (float32 rounding of a different summation order), per layer;
    and with a sliding window (the oldest keys masked), equal to the reference under the same mask."""
    pool, blocks, valid = _pool(dtype, d)
    assert kernel.load() is not None, "the kernel did not build"
    windowed = valid.clone()
    windowed[0, :20] = False  # row 0 keeps its last 17 keys only
    for layer in range(2):
        qg = torch.randn(len(LENGTHS), KVH, GROUPS, d, generator=torch.Generator().manual_seed(layer)) * 3
        for mask in (valid, windowed):
            ref = _dequantised_sdpa(pool, layer, blocks, qg, mask)
            out = kernel.decode_attention(pool, layer, blocks, qg, mask, d**-0.5)
            assert out is not None and out.shape == ref.shape and out.dtype == ref.dtype
            err = (out - ref).abs().max()
            assert err < 1e-5 * ref.abs().max(), (dtype, d, layer, float(err))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_returns_each_querys_log_sum_exp(dtype: str) -> None:
    """What a sequence that may recall keeps of its step: the log-sum-exp of each query's scaled scores over the
    decoded keys, within float32 rounding of the reference's (and ``decode_attention``'s output is the same pass's);
    with a sliding window, over the keys it leaves."""
    pool, blocks, valid = _pool(dtype, 64)
    windowed = valid.clone()
    windowed[0, :20] = False
    flat = blocks.reshape(-1)
    for layer in range(2):
        keys = pool.dequant_k(pool.k[layer].view(pool.num_blocks, BS, KVH, -1)[flat])
        keys = keys.reshape(len(LENGTHS), -1, KVH, 64).transpose(1, 2)  # [n, kvh, keys, D]
        qg = torch.randn(len(LENGTHS), KVH, GROUPS, 64, generator=torch.Generator().manual_seed(layer)) * 3
        for mask in (valid, windowed):
            scores = (qg @ keys.transpose(-1, -2)) * 0.125
            ref = scores.masked_fill(~mask[:, None, None, :], float("-inf")).logsumexp(-1)
            both = kernel.decode_attention_lse(pool, layer, blocks, qg, mask, 0.125)
            assert both is not None and both[1].shape == ref.shape and both[1].dtype == torch.float32
            assert (both[1] - ref).abs().max() < 1e-5 * ref.abs().max(), (dtype, layer)
            assert torch.equal(both[0], kernel.decode_attention(pool, layer, blocks, qg, mask, 0.125))


@pytest.mark.parametrize("float_window", [5, BS, 40])  # within the last block, exactly one block, whole rows
@pytest.mark.parametrize("dtype", ["fp8", "int4"])
def test_the_kernel_reads_the_float_window_as_the_torch_path_does(dtype: str, float_window: int) -> None:
    """With a float window the kernel reads each block's exact copy where it has one and its codes otherwise:
    within 1e-5 of the torch window path's output (codes decoded, window blocks overwritten, SDPA) for rows of 37,
    16 and 5 tokens (R = 5 keeps one block per row, R = 16 two of row 0's three, R = 40 every block), per layer;
    and the copies are what it read (reading the codes alone, the output moves by far more than that)."""
    pool, blocks, valid = _pool(dtype, 64, float_window)
    window = pool.window
    assert window is not None and window.num_blocks > 0
    arena = window.index[blocks]
    expected_blocks = {5: 3, BS: 4, 40: 5}[float_window]  # row 0 holds 3 blocks, rows 1 and 2 one each
    assert window.num_blocks == expected_blocks and (arena[0, :3] >= 0).sum() == expected_blocks - 2
    for layer in range(2):
        qg = torch.randn(len(LENGTHS), KVH, GROUPS, 64, generator=torch.Generator().manual_seed(layer)) * 3
        ref = _dequantised_sdpa(pool, layer, blocks, qg, valid)
        out = kernel.decode_attention(pool, layer, blocks, qg, valid, 0.125, arena)
        assert out is not None and out.shape == ref.shape
        err = (out - ref).abs().max()
        assert err < 1e-5 * ref.abs().max(), (dtype, float_window, layer, float(err))
        codes_only = kernel.decode_attention(pool, layer, blocks, qg, valid, 0.125)
        assert (codes_only - ref).abs().max() > 100 * max(float(err), 1e-7)


def test_a_half_precision_window_is_left_to_the_torch_path() -> None:
    """The kernel reads the arena as float32: a bfloat16 model's window is not offered to it (nor read by it)."""
    pool = BlockPool(num_layers=1, num_kv_heads=KVH, head_dim=16, block_size=BS, num_blocks=4,
                     dtype=torch.bfloat16, device="cpu", kv_cache_dtype="fp8", float_window=8)  # fmt: skip
    assert not kernel.supported(pool)
    blocks, valid = torch.tensor([[0]]), torch.ones(1, BS, dtype=torch.bool)
    qg = torch.randn(1, KVH, GROUPS, 16, dtype=torch.bfloat16)
    assert kernel.decode_attention(pool, 0, blocks, qg, valid, 0.25, torch.tensor([[-1]])) is None
    assert kernel.supported(_pool("fp8", 16, 8)[0])


def test_masked_slots_are_not_read() -> None:
    """A NaN in a masked slot (an unfilled tail, a padding block) changes nothing: the kernel never reads its codes
    and scale (its share of the block's fp8 key means belongs to the block, whose written rows read it)."""
    pool, blocks, valid = _pool("fp8", 64)
    qg = torch.randn(len(LENGTHS), KVH, GROUPS, 64)
    before = kernel.decode_attention(pool, 0, blocks, qg, valid, 0.125)
    tail = int(blocks[0, 2]) * BS + LENGTHS[0] % BS  # row 0's first unfilled slot
    pool.k[0, tail, :, : 64 + 2] = 0x7F  # e4m3's NaN code, and a NaN scale
    pool.v[0, tail] = 0xFF
    after = kernel.decode_attention(pool, 0, blocks, qg, valid, 0.125)
    assert torch.isfinite(after).all() and torch.equal(before, after)


def _generate(dtype: str, float_window: int = 0) -> tuple[list[int], torch.Tensor]:
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype=dtype, kv_cache_memory="4MiB",
              kv_float_window=float_window)  # fmt: skip
    prompts = [list(range(5, 45)), list(range(50, 63)), list(range(3, 20))]  # one decode batch of unequal rows
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0))
    return [t for o in outs for t in o.token_ids], torch.tensor([lp.logprob for o in outs for lp in o.logprobs])


@pytest.mark.parametrize(("dtype", "float_window"), [(d, 0) for d in DTYPES] + [("fp8", 20), ("int4", 20)])
def test_generation_through_the_kernel_is_the_torch_path(
    dtype: str, float_window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On tiny-random, greedy decoding reads the same tokens, each token's log-probability within float32 rounding
    carried through the layers and steps, with the kernel and with it switched off; the kernel is what ran, and
    under a float window of 20 tokens (rows of 13 to 52 tokens: some blocks read from codes, some from copies) it
    read the window."""
    calls, windowed = [], []
    real = kernel.decode_attention_lse  # what attention.py calls (the output and the log-sum-exp of one pass)

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        arena = args[6] if len(args) > 6 else kwargs.get("arena")
        windowed.append(arena is not None and bool((arena >= 0).any()) and bool((arena < 0).any()))
        return out

    monkeypatch.setattr(kernel, "decode_attention_lse", counted)
    monkeypatch.setattr(attention, "DECODE_KERNEL", True)
    tokens, logprobs = _generate(dtype, float_window)
    assert calls and all(calls)
    assert any(windowed) if float_window else not any(windowed)
    calls.clear()
    monkeypatch.setattr(attention, "DECODE_KERNEL", False)
    ref_tokens, ref_logprobs = _generate(dtype, float_window)
    assert not calls  # switched off: the torch path only
    assert tokens == ref_tokens
    assert (logprobs - ref_logprobs).abs().max() < 1e-3


def _generate_recalling() -> tuple[list[int], list[int], torch.Tensor]:
    """A confidence rule that expands on every token (thresholds 0) and scores blocks without recording decode
    attention (SnapKV), over an int8 pool: its decode rows capture their query for recalls."""
    llm = LLM("tiny-random", "dynamic", loaded=fresh_tiny(), kv_cache_dtype="int8", kv_cache_memory="8MiB",
              max_num_batched_tokens=64, base_size=48, max_size=128, min_recent=32, compact_interval=8,
              entropy_threshold=0.0, gap_threshold=0.0, scorer="snapkv")  # fmt: skip
    prompts = [list(range(5, 205)), list(range(50, 190)), list(range(3, 120))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0))
    recalled = [o.kv["recalled_blocks"] for o in outs]
    return (
        [t for o in outs for t in o.token_ids],
        recalled,
        torch.tensor([lp.logprob for o in outs for lp in o.logprobs]),
    )


def test_a_recalling_rule_takes_the_kernel_and_recalls_as_the_torch_path_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows that may recall keep their query and log-sum-exp (``Captures``): the kernel gives both in its
    one pass, so such a batch no longer falls back to decoding every row. On tiny-random the rule recalls the same
    blocks and reads the same greedy tokens, each log-probability within float32 rounding carried through the
    steps, with the kernel and with it switched off; the kernel served the capturing steps."""
    captured = []
    real = kernel.decode_attention_lse

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        captured.append(out is not None)
        return out

    monkeypatch.setattr(kernel, "decode_attention_lse", counted)
    monkeypatch.setattr(attention, "DECODE_KERNEL", True)
    tokens, recalled, logprobs = _generate_recalling()
    assert captured and all(captured) and sum(recalled) > 0
    captured.clear()
    monkeypatch.setattr(attention, "DECODE_KERNEL", False)
    ref_tokens, ref_recalled, ref_logprobs = _generate_recalling()
    assert not captured
    assert tokens == ref_tokens and recalled == ref_recalled
    assert (logprobs - ref_logprobs).abs().max() < 1e-3


def test_the_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in [("0", False), ("off", False), ("False", False), ("no", False), ("1", True), ("", True)]:
        monkeypatch.setenv(kernel.ENV, value)
        assert kernel.enabled_by_env() is on, value
    monkeypatch.delenv(kernel.ENV)
    assert kernel.enabled_by_env()


def test_a_failed_build_warns_once_and_the_torch_path_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that refuses the build (here an unknown flag, which g++ rejects before compiling): one warning,
    no exception, the engine generates through the torch path, and the pool is no longer offered to the kernel."""
    monkeypatch.setenv("CONFKV_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel, "CFLAGS", [*kernel.CFLAGS, "-fconfkv-no-such-flag"])
    monkeypatch.setattr(kernel, "_module", None)
    monkeypatch.setattr(kernel, "_failed", False)
    monkeypatch.setattr(attention, "DECODE_KERNEL", True)
    with caplog.at_level(logging.WARNING, logger=kernel.__name__):
        tokens, _ = _generate("fp8")
        pool, blocks, valid = _pool("fp8", 16)
        assert not kernel.supported(pool)
        assert kernel.decode_attention(pool, 0, blocks, torch.randn(3, KVH, GROUPS, 16), valid, 0.25) is None
    warnings = [r for r in caplog.records if "could not be built" in r.getMessage()]
    assert len(warnings) == 1
    monkeypatch.setattr(attention, "DECODE_KERNEL", False)
    assert _generate("fp8")[0] == tokens


def test_the_engine_builds_the_kernel_when_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantised CPU pool's kernel is loaded (compiled, on a machine's first start) while the engine starts, so
    the half minute of a first build falls before any request rather than inside one; an ``auto`` pool, or the
    switch off, does not load it."""
    loads = []
    monkeypatch.setattr(kernel, "load", lambda: loads.append(1))
    monkeypatch.setattr(attention, "DECODE_KERNEL", True)
    LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_memory="4MiB")
    assert loads == []
    LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int4", kv_cache_memory="4MiB")
    assert loads == [1]
    monkeypatch.setattr(attention, "DECODE_KERNEL", False)
    LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int4", kv_cache_memory="4MiB")
    assert loads == [1]
