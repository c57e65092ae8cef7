"""Quantised KV (``kv_cache_dtype``): round trips within each format's error, the pool's bytes buying more tokens,
``full`` at int8/fp8/int4 within a stated NLL tolerance of ``full`` at ``auto`` on tiny-random, bad names refused."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from confkv import LLM
from confkv.engine.params import SamplingParams
from confkv.errors import ConfkvError
from confkv.kv.block_keys import ChannelKeyCodec, Fp8KeyCodec
from confkv.kv.kv_format import KVFormat, codec_for
from confkv.kv.pool import BlockPool
from confkv.kv.quant import KV_CACHE_DTYPES, Fp8Codec, Int4Codec

from .conftest import fresh_tiny

QUANTISED = [d for d in KV_CACHE_DTYPES if d != "auto"]
#: Worst-case round-trip error relative to a row's absmax (int4: to its range): half a step plus float16 scale
#: rounding; fp8 relative to each value (3 mantissa bits).
ROW_BOUND = {"int8": 0.5 / 127 + 2e-3, "int4": 0.5 / 15 + 2e-3}


def rows(seed: int = 0) -> torch.Tensor:
    """Rows like real keys: mostly small values, a few outlier channels, some rows all of one sign, one row zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, 64, generator=g)
    x[:, :, 3] *= 20.0  # an outlier channel, as RoPE'd keys have
    x[:8] = x[:8].abs() + 1.0  # rows that lean to one side (where a symmetric int4 grid wastes levels)
    x[9] *= 1e-3
    x[10] = 0.0
    return x


@pytest.mark.parametrize("name", QUANTISED)
def test_round_trip_within_the_formats_error(name: str) -> None:
    codec = codec_for(name)
    assert codec is not None
    x = rows()
    packed = codec.encode(x)
    assert packed.dtype == torch.uint8 and packed.shape == (*x.shape[:-1], codec.row_bytes(x.shape[-1]))
    back = codec.decode(packed, torch.float32)
    err = (back - x).abs()
    assert bool((err <= codec.max_error(x) + 1e-7).all()), f"{name}: worst excess {(err - codec.max_error(x)).max()}"
    if name in ROW_BOUND:
        span = x.abs().amax(-1, keepdim=True) if name == "int8" else x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
        assert bool((err <= ROW_BOUND[name] * span + 1e-7).all())
    else:  # fp8: relative to each value, plus the subnormal floor of the row's scale
        assert bool((err <= x.abs() / 16 + x.abs().amax(-1, keepdim=True) * 2**-9 + 1e-7).all())
    assert torch.equal(back[10], torch.zeros_like(back[10])), "a zero row (a fresh block) must decode to zeros"
    # the rows the decoder returns encode to the same bytes: a block can move between tiers and pools unchanged
    assert torch.equal(codec.encode(back), packed)
    rel = float((back - x).norm() / x.norm())
    assert rel < {"int8": 0.025, "fp8": 0.02, "int4": 0.2}[name], rel  # measured 0.016, 0.011, 0.105


@pytest.mark.parametrize("name", QUANTISED)
def test_non_finite_input_stays_non_finite(name: str) -> None:
    """The engine refuses a request whose KV went non-finite; a quantised pool must not hide it."""
    codec = codec_for(name)
    x = torch.randn(2, 8)
    x[0, 3] = float("nan")
    back = codec.decode(codec.encode(x), torch.float32)
    assert not bool(back[0].isfinite().all()) and bool(back[1].isfinite().all())


@pytest.mark.parametrize("name", QUANTISED)
def test_pool_bytes_buy_more_tokens_and_blocks_move_as_stored(name: str) -> None:
    geometry = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}
    per_fp32 = BlockPool.bytes_per_block_for(**geometry, dtype=torch.float32)
    per_q = BlockPool.bytes_per_block_for(**geometry, dtype=torch.float32, kv_cache_dtype=name)
    # int4: a key row is 32 bytes of data, 8 of its 16 outlier channels' low nibbles and 17 of its block's
    # per-channel grid and outlier indices, a value row 32 and 4 per 32 channels; fp8: a key row is 66 bytes and 4 of
    # its block's mean per channel (one e4m3 byte a channel over 16 rows)
    ratio = {"int8": 256 / 66, "fp8": 512 / (70 + 66), "int4": 512 / (57 + 40)}[name]
    assert per_fp32 / per_q == pytest.approx(ratio)
    budget = 40 * per_fp32
    pool = BlockPool(**geometry, num_blocks=budget // per_q, dtype=torch.float32, device="cpu", kv_cache_dtype=name)
    assert pool.total_bytes <= budget and pool.num_tokens >= int(ratio) * 40 * 4
    assert pool.total_bytes == pool.k.nbytes + pool.v.nbytes and pool.bytes_per_block == per_q
    ids = pool.allocate(2)
    slots = pool.slots_of(ids)
    k, v = torch.randn(len(slots), 2, 64), torch.randn(len(slots), 2, 64)
    for layer in range(2):
        pool.store(layer, slots, k, v)
    codec = codec_for(name)
    assert torch.equal(pool.dequant(pool.v[1, slots]), codec.decode(codec.encode(v), torch.float32))
    fmt = pool.fmt
    blocks = k.reshape(2, 16, 2, 64)
    assert torch.equal(pool.keys_at(1, slots), fmt.decode_k(fmt.encode_k(blocks), torch.float32).reshape(k.shape))
    # blocks leave the pool as their stored bytes (the host tier, session records) and come back unchanged
    rk, rv, rs = pool.read_blocks(ids)
    assert rk.dtype == torch.uint8 and rk.shape[-1] == fmt.k_row and rv.shape[-1] == codec.row_bytes(64)
    other = pool.allocate(2, zero=False)
    pool.write_blocks(other, rk, rv, rs)
    assert torch.equal(pool.k[:, pool.slots_of(other)], pool.k[:, slots])


#: ``full`` at each dtype against ``full`` at ``auto`` on tiny-random (random weights, head_dim 16: a worse case for
#: per-token scales than a trained model): the most the mean NLL may move, relative. Measured: int8 0.01%, fp8 0.3%,
#: int4 0.6%.
NLL_TOLERANCE = {"int8": 0.005, "fp8": 0.01, "int4": 0.03}


def test_full_at_quantised_dtypes_stays_within_nll_tolerance_of_auto() -> None:
    text = "Teacher forcing reads the reference continuation chunk by chunk. " * 9

    def score(dtype: str) -> tuple[torch.Tensor, LLM]:
        llm = LLM("tiny-random", "full", loaded=fresh_tiny(), compact_interval=16, max_num_batched_tokens=64,
                  kv_cache_dtype=dtype, kv_cache_memory="4MiB")  # fmt: skip
        (r,) = llm.score([text], score_from=16)
        return r.token_logprobs, llm

    ref, auto = score("auto")
    nll_auto = -float(ref.mean())
    for name in QUANTISED:
        lp, llm = score(name)
        assert llm.engine.pool.num_tokens > 3 * auto.engine.pool.num_tokens
        assert not torch.equal(lp, ref), f"{name}: the scores did not change, so the pool was not quantised"
        nll = -float(lp.mean())
        assert math.isfinite(nll) and abs(nll / nll_auto - 1) <= NLL_TOLERANCE[name], (name, nll, nll_auto)


def test_generation_reports_bytes_beside_tokens() -> None:
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int8", kv_cache_memory="4MiB")
    out = llm.generate("bytes as well as tokens", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    kv, pool = out.kv, llm.engine.pool
    assert kv["bytes_per_token"] == pool.bytes_per_token
    assert kv["full_bytes"] == kv["full_tokens"] * pool.bytes_per_token
    assert kv["peak_resident_bytes"] == kv["peak_resident_tokens"] * pool.bytes_per_token
    stats = llm.engine.stats()
    assert stats["kv_cache_dtype"] == "int8" and stats["pool_tokens"] == pool.num_blocks * pool.block_size
    assert stats["pool_bytes_per_token"] * stats["pool_tokens"] == stats["pool_total_bytes"]


def test_bad_dtype_names_are_refused() -> None:
    with pytest.raises(ConfkvError, match="kv_cache_dtype") as err:
        LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="fp4")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int2'"):
        codec_for("int2")


@pytest.mark.parametrize(
    ("command", "flag"),
    [("generate", "--kv-cache-dtype"), ("bench", "--kv-cache-dtype"), ("serve", "--kv-cache-dtype"),
     ("generate", "--host-kv-dtype")],
)  # fmt: skip
def test_cli_refuses_a_bad_kv_cache_dtype_in_one_line(command: str, flag: str, tmp_path) -> None:
    extra = {"generate": ["--prompt", "x"], "bench": ["--out", str(tmp_path / "b")], "serve": []}[command]
    proc = subprocess.run(
        [sys.executable, "-m", "confkv.cli", command, "--model", "tiny-random", flag, "e5m2", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    setting = flag.removeprefix("--").replace("-", "_")
    assert len(lines) == 1 and setting in lines[0] and "e5m2" in lines[0], proc.stderr


def test_fp8_decodes_every_byte_as_pytorch_converts_it() -> None:
    """The CPU decoder moves e4m3 bits into float16's place instead of PyTorch's (slow) float8 conversion."""
    codec = codec_for("fp8")
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    data = data[(data & 0x7F) != 0x7F]  # NaN: only a NaN input makes one, and its scale is NaN as well
    scale = torch.tensor([0.37], dtype=torch.float16).view(torch.uint8)
    rows = torch.cat([data, scale])[None]
    expected = data.view(torch.float8_e4m3fn).float() * float(torch.tensor(0.37, dtype=torch.float16))
    assert torch.equal(codec.decode(rows, torch.float32)[0], expected)


def key_blocks(seed: int = 0) -> torch.Tensor:
    """Keys of 8 blocks ``[8, 16, 4, 64]``: the rows of ``rows()``, whose outlier channel sets a per-token range."""
    return rows(seed).reshape(4, 16, 4, 64).repeat(2, 1, 1, 1) * torch.linspace(0.5, 2.0, 8)[:, None, None, None]


def test_int4_keys_per_channel_round_trip_within_each_channels_step() -> None:
    """KIVI's keys: one grid per channel of a block, so the outlier channel no longer sets every row's step."""
    codec = ChannelKeyCodec(64, 16)
    x = key_blocks()
    packed = codec.encode(x)
    assert packed.dtype == torch.uint8 and packed.shape == (*x.shape[:-1], 48)
    back = codec.decode(packed, torch.float32)
    err = (back - x).abs()
    assert bool((err <= codec.max_error(x) + 1e-7).all()), f"worst excess {(err - codec.max_error(x)).max()}"
    span = x.amax(-3, keepdim=True) - x.amin(-3, keepdim=True)
    assert bool((err <= (0.5 / 15 + 2e-3) * span + 1e-6).all())
    assert torch.equal(codec.encode(back), packed), "a block re-encodes to the same bytes"
    per_token = Int4Codec()
    rel = float((back - x).norm() / x.norm())
    rel_token = float((per_token.decode(per_token.encode(x), torch.float32) - x).norm() / x.norm())
    assert rel < rel_token / 2, (rel, rel_token)  # measured 0.065 against 0.151
    zero = codec.decode(codec.encode(torch.zeros(16, 4, 64)), torch.float32)
    assert torch.equal(zero, torch.zeros(16, 4, 64)), "a fresh (zeroed) block decodes to zeros"
    nan = x[:1].clone()
    nan[0, 2, 1, 5] = float("nan")
    assert not bool(codec.decode(codec.encode(nan), torch.float32)[0, :, 1, 5].isfinite().all())


def test_an_open_block_is_re_encoded_from_exact_keys_as_it_fills() -> None:
    """A block written token by token ends as the bytes of the same block written whole (no error compounds), its
    grid covers only its written rows meanwhile, and a block that left the device open restarts from its rows."""
    geometry = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 64, "block_size": 16}
    pool = BlockPool(**geometry, num_blocks=6, dtype=torch.float32, device="cpu", kv_cache_dtype="int4")
    x = key_blocks()[:2]  # [2 blocks, 16, 4, 64]
    whole, step = pool.allocate(1), pool.allocate(1)
    for layer in range(2):
        pool.store(layer, pool.slots_of(whole), x[0], x[0])
    for t in range(16):
        slot = pool.slots_of(step)[t : t + 1]
        for layer in range(2):
            pool.store(layer, slot, x[0, t : t + 1], x[0, t : t + 1])
        if t == 4:  # open: only the 5 written rows set the grid, so they are within their own step
            got = pool.keys_at(1, pool.slots_of(step)[:5])
            part = x[0, :5]
            assert bool(((got - part).abs() <= (part.amax(0) - part.amin(0)) * (0.5 / 15 + 2e-3) + 1e-6).all())
    assert torch.equal(pool.k[:, pool.slots_of(step)], pool.k[:, pool.slots_of(whole)])
    assert not pool._open, "a full block keeps no float copy"
    # a block leaves open (a parked session) and comes back: later tokens join the grid of its decoded rows
    half = pool.allocate(1)
    for layer in range(2):
        pool.store(layer, pool.slots_of(half)[:8], x[1, :8], x[1, :8])
    rk, rv, rs = pool.read_blocks(half)
    pool.free(half)
    back = pool.allocate(1, zero=False)
    pool.write_blocks(back, rk, rv, rs)
    for layer in range(2):
        pool.store(layer, pool.slots_of(back)[8:], x[1, 8:], x[1, 8:])
    got = pool.keys_at(1, pool.slots_of(back))
    assert bool(((got - x[1]).abs() <= (x[1].amax(0) - x[1].amin(0)) * (1.0 / 15 + 4e-3) + 1e-6).all())


def offset_key_blocks(seed: int = 0) -> torch.Tensor:
    """Keys of 4 blocks ``[4, 16, 4, 64]`` as RoPE leaves them: small channels, and a few large ones that keep
    nearly their value across a block's tokens (its slow pairs), one of each sign."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, 4, 64, generator=g)
    x[..., 3] += 24.0
    x[..., 40] -= 9.0
    x[..., 41] += 5.0 * torch.linspace(0.8, 1.2, 16)[None, :, None]
    return x


def test_fp8_keys_less_their_block_mean_round_trip_closer_than_plain_fp8() -> None:
    """fp8 keys keep their block's mean per channel in e4m3 and the residual against it in e4m3: the large steady
    channels no longer carry e4m3's relative error of 2^-4 in every token."""
    codec = Fp8KeyCodec(64, 16)
    x = offset_key_blocks()
    packed = codec.encode(x)
    assert packed.dtype == torch.uint8 and packed.shape == (*x.shape[:-1], 64 + 2 + 4)
    back = codec.decode(packed, torch.float32)
    err = (back - x).abs()
    assert bool((err <= codec.max_error(x) + 1e-6).all()), f"worst excess {(err - codec.max_error(x)).max()}"
    plain = Fp8Codec()
    back_plain = plain.decode(plain.encode(x), torch.float32)
    steady = [40, 41]  # large and steady, but not a row's largest (which plain fp8's scale holds exactly)
    rel = float((back - x)[..., steady].norm() / x[..., steady].norm())
    rel_plain = float((back_plain - x)[..., steady].norm() / x[..., steady].norm())
    assert rel < rel_plain / 4, (rel, rel_plain)  # measured 0.0034 against 0.025
    assert float((back - x).norm()) < float((back_plain - x).norm())
    means = x.mean(1).to(torch.float8_e4m3fn).float()
    assert torch.equal(codec.block_means(packed), means), "the means are e4m3, spread over the rows"
    zero = codec.decode(codec.encode(torch.zeros(16, 4, 64)), torch.float32)
    assert torch.equal(zero, torch.zeros(16, 4, 64)), "a fresh (zeroed) block decodes to zeros"
    assert torch.equal(codec.decode(torch.zeros(1, 16, 4, 70, dtype=torch.uint8), torch.float32), zero[None])
    nan = x[:1].clone()
    nan[0, 2, 1, 5] = float("nan")
    assert not bool(codec.decode(codec.encode(nan), torch.float32)[0, :, 1, 5].isfinite().all())


def test_fp8_searched_scales_round_rows_no_worse_and_only_full_blocks_pay_for_them() -> None:
    """``Fp8Codec(search=n)`` tries n scales over one octave, the plain one among them, and keeps the one that
    rounds the row best (its squared error, each channel weighted when weights are given): no row is worse than under
    the plain scale, and the rows decode as any fp8 row does. The pool's fp8 keys search only when their block is
    full, weighing each channel by its mean square over the block; an open block, re-encoded at every write, keeps
    the plain scale."""
    x = torch.randn(64, 4, 64, generator=torch.Generator().manual_seed(3))  # like a residual: no outlier channel
    x[10] = 0.0
    plain, searched = Fp8Codec(), Fp8Codec(search=4)
    err_plain = (plain.decode(plain.encode(x), torch.float32) - x).square().sum(-1)
    err = (plain.decode(searched.encode(x), torch.float32) - x).square().sum(-1)
    assert bool((err <= err_plain).all())
    assert float(err.sum()) < 0.9 * float(err_plain.sum()), (float(err.sum()), float(err_plain.sum()))  # 0.85
    w = torch.rand(1, 4, 64, generator=torch.Generator().manual_seed(4)).square() * 10  # per channel, as a block's
    weighed = {n: ((plain.decode(c.encode(x, w), torch.float32) - x).square() * w).sum(-1)
               for n, c in (("plain", plain), ("searched", searched))}  # fmt: skip
    assert bool((weighed["searched"] <= weighed["plain"]).all())
    assert bool(
        (weighed["searched"] <= ((plain.decode(searched.encode(x), torch.float32) - x).square() * w).sum(-1)).all()
    )
    scale = searched.encode(x)[..., 64:].contiguous().view(torch.float16).float()
    base = (x.abs().amax(-1, keepdim=True) / 448).half().float()
    assert bool(((scale >= base) & (scale < 2 * base) | (base == 0)).all()), "within one octave above the plain"
    codec = Fp8KeyCodec(64, 16)
    blocks = offset_key_blocks()[:2]
    mixed = codec.encode(blocks, torch.tensor([16, 5]))
    assert torch.equal(mixed[:1], codec.encode(blocks[:1])), "a full block: the searched rows"
    assert torch.equal(mixed[1:], codec.encode(blocks[1:], torch.tensor([5])))
    residual = blocks[:1] - codec.block_means(mixed[:1]).unsqueeze(1)
    weight = blocks[:1].square().mean(1, keepdim=True)
    expected = Fp8Codec(search=Fp8KeyCodec.SEARCH).encode(residual, weight)
    assert torch.equal(mixed[:1, ..., :66], expected), "searched against the block's mean square per channel"
    open_scales = mixed[1, :5, :, 64:66].contiguous().view(torch.float16).float()
    residual = blocks[1, :5] - codec.block_means(mixed[1:])[0]
    assert torch.equal(open_scales, (residual.abs().amax(-1, keepdim=True) / 448).half().float()), "open: plain"


def test_the_pool_tells_fp8_keys_which_blocks_are_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's write plan knows in Python which blocks a write fills, and passes their positions down, so the codec
    does not look for them in every layer (``nonzero``, a host sync per layer on CUDA). Given or found, the bytes are
    the same."""
    codec = Fp8KeyCodec(64, 16)
    blocks = offset_key_blocks()[:3]
    filled = torch.tensor([16, 5, 16])
    found = codec.encode(blocks, filled)
    assert torch.equal(codec.encode(blocks, filled, torch.tensor([0, 2])), found)
    geometry = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 64, "block_size": 16}
    pool = BlockPool(**geometry, num_blocks=4, dtype=torch.float32, device="cpu", kv_cache_dtype="fp8")
    seq = pool.allocate(2)
    keys = blocks[:2].reshape(32, 4, 64)

    def no_nonzero(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the write looked for full blocks itself")

    monkeypatch.setattr(torch.Tensor, "nonzero", no_nonzero)
    for layer in range(2):  # a write that fills the first block and leaves the second open at 5 rows
        pool.store(layer, pool.slots_of(seq)[:21], keys[:21], keys[:21])
    monkeypatch.undo()
    by_block = pool.k[1, pool.slots_of(seq)].view(2, 16, 4, -1)
    assert torch.equal(by_block[0], found[0]) and torch.equal(by_block[1, :5], found[1, :5])


def test_fp8_keys_of_a_partly_written_block_take_the_mean_of_its_written_rows() -> None:
    """What the unwritten rows of an open block hold does not move its written rows' codes, and the pool's fp8 block
    written token by token ends as the bytes of the same block written whole."""
    codec = Fp8KeyCodec(64, 16)
    x = offset_key_blocks()[:1]
    other = x.clone()
    other[:, 5:] = 100.0
    filled = torch.tensor([5])
    a, b = codec.encode(x, filled), codec.encode(other, filled)
    assert torch.equal(a[:, :5], b[:, :5])
    got = codec.decode(a, torch.float32)[:, :5]
    assert bool(((got - x[:, :5]).abs() <= codec.max_error(x[:, :5]) + 1e-6).all())
    k, _ = KVFormat("auto", 64, 16, torch.float32).convert_to(KVFormat("fp8", 64, 16, torch.float32), x, x, filled)
    assert torch.equal(k, a), "a partly filled block goes to an fp8 tier with its mean over the written rows"
    geometry = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 64, "block_size": 16}
    pool = BlockPool(**geometry, num_blocks=4, dtype=torch.float32, device="cpu", kv_cache_dtype="fp8")
    whole, step = pool.allocate(1), pool.allocate(1)
    for layer in range(2):
        pool.store(layer, pool.slots_of(whole), x[0], x[0])
    for t in range(16):
        for layer in range(2):
            pool.store(layer, pool.slots_of(step)[t : t + 1], x[0, t : t + 1], x[0, t : t + 1])
    assert torch.equal(pool.k[:, pool.slots_of(step)], pool.k[:, pool.slots_of(whole)])
    assert not pool._open, "a full block keeps no float copy"


@pytest.mark.parametrize(("head_dim", "block_size"), [(8, 16), (64, 128), (24, 16)])
def test_fp8_keys_whose_means_do_not_divide_the_block_pad_its_last_rows(head_dim: int, block_size: int) -> None:
    """A block's ``head_dim`` mean bytes spread over ``ceil(head_dim / block_size)`` bytes a row, zeros after them:
    any geometry round trips, and a pool of it takes fp8."""
    codec = Fp8KeyCodec(head_dim, block_size)
    x = torch.randn(2, block_size, 2, head_dim) + 3.0
    packed = codec.encode(x)
    assert packed.shape[-1] == head_dim + 2 + -(-head_dim // block_size)
    back = codec.decode(packed, torch.float32)
    assert bool(((back - x).abs() <= codec.max_error(x) + 1e-6).all())
    assert torch.equal(codec.block_means(packed), x.mean(1).to(torch.float8_e4m3fn).float())
    pool = BlockPool(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=block_size, num_blocks=2,
                     dtype=torch.float32, device="cpu", kv_cache_dtype="fp8")  # fmt: skip
    assert pool.k_row == packed.shape[-1]


def test_int4_keys_per_channel_need_a_grid_that_fits_the_block() -> None:
    with pytest.raises(ConfkvError, match="4 x head_dim a multiple of the block size") as err:
        BlockPool(num_layers=1, num_kv_heads=1, head_dim=6, block_size=16, num_blocks=2, dtype=torch.float32,
                  device="cpu", kv_cache_dtype="int4")  # fmt: skip
    assert "\n" not in str(err.value)


def test_a_partly_filled_block_converted_to_int4_keys_keeps_its_grid_over_written_rows() -> None:
    """A sequence's last block goes to an int4 host tier with its empty rows (zeros) left out of the channel grid:
    the same bytes as the pool's own encoding of the open block, each written row within its own step."""
    x = key_blocks()[:1].clone()  # [1 block, 16, 4, 64]
    x[:, 5:] = 0.0  # five rows written; the rest is what a zeroed block holds
    auto, int4 = (KVFormat(name, 64, 16, torch.float32) for name in ("auto", "int4"))
    filled = torch.tensor([5])
    k, _ = auto.convert_to(int4, x, x, filled)
    assert torch.equal(k, ChannelKeyCodec(64, 16, outliers=16).encode(x, filled))
    got, part = int4.decode_k(k, torch.float32)[0, :5], x[0, :5]
    assert bool(((got - part).abs() <= (part.amax(0) - part.amin(0)) * (0.5 / 15 + 2e-3) + 1e-6).all())


def test_a_block_cut_mid_way_takes_its_grid_over_the_rows_kept() -> None:
    """A session cut inside an open int4 block (its next prompt departs there) and written on ends as the bytes of
    a block that only ever held the kept rows and the new ones: the cut rows leave the channel grid."""
    geometry = {"num_layers": 1, "num_kv_heads": 4, "head_dim": 64, "block_size": 16}
    pool = BlockPool(**geometry, num_blocks=4, dtype=torch.float32, device="cpu", kv_cache_dtype="int4")
    x, y = key_blocks()[0], key_blocks(seed=1)[0] * 3.0
    cut, fresh = pool.allocate(1), pool.allocate(1)
    for t in range(10):
        pool.store(0, pool.slots_of(cut)[t : t + 1], x[t : t + 1], x[t : t + 1])
    pool.forget_from(cut[0], 5)
    for t in range(5):
        pool.store(0, pool.slots_of(fresh)[t : t + 1], x[t : t + 1], x[t : t + 1])
    for t in (5, 6):
        for block in (cut, fresh):
            pool.store(0, pool.slots_of(block)[t : t + 1], y[t : t + 1], y[t : t + 1])
    assert torch.equal(pool.k[:, pool.slots_of(cut)[:7]], pool.k[:, pool.slots_of(fresh)[:7]])
