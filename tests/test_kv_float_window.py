"""The float window (``kv_float_window``): the blocks holding each sequence's last R tokens keep exact K and V beside
a quantised pool, attention reads those rows, the copies count against the pool's bytes, and every way a block
leaves the device (eviction, preemption, a parked session) drops its copy without a wrong read."""

from __future__ import annotations

import math

import pytest
import torch

from confkv import LLM
from confkv.cache.manager import CacheManager
from confkv.config import CachePolicy, make_engine_config
from confkv.controllers import make_controller
from confkv.engine.params import SamplingParams
from confkv.errors import ConfkvError
from confkv.kv.host import HostTier
from confkv.kv.pool import BlockPool

from .conftest import fresh_tiny

L, KVH, D, BS = 2, 2, 16, 4
TEXT = "The float window keeps the newest tokens exact while older ones are read from their codes. " * 3


def _held_bytes(pool: BlockPool) -> int:
    """What the pool's budget holds: blocks off the free list plus the bytes kept beside it."""
    return (pool.num_blocks - len(pool._free)) * pool.bytes_per_block + pool.outside_bytes


def _score(dtype: str, window: int, ids: list[int]) -> torch.Tensor:
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype=dtype, kv_float_window=window,
              kv_cache_memory="4MiB", compact_interval=8)  # fmt: skip
    (result,) = llm.score([ids], 1)
    return torch.as_tensor(result.token_logprobs)


def _greedy(dtype: str, window: int, ids: list[int]) -> list[int]:
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype=dtype, kv_float_window=window,
              kv_cache_memory="4MiB")  # fmt: skip
    (out,) = llm.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True))
    return out.token_ids


@pytest.mark.parametrize("dtype", ["int4", "fp8"])
def test_a_window_over_the_whole_sequence_reads_every_row_exactly(dtype: str) -> None:
    """With R at least the sequence's length every row attention reads is the exact one: teacher-forced
    log-probabilities match ``auto`` to float rounding and greedy decoding picks ``auto``'s tokens, where R = 0
    reads the codes and moves the log-probabilities (so the window is what is read)."""
    ids = fresh_tiny().tokenizer(TEXT)["input_ids"]
    exact = _score("auto", 0, ids)
    whole = _score(dtype, 1024, ids)
    codes = _score(dtype, 0, ids)
    assert (whole - exact).abs().max() < 1e-4
    assert (codes - exact).abs().max() > 100 * max(float((whole - exact).abs().max()), 1e-6)
    prompt = ids[:40]
    assert _greedy(dtype, 1024, prompt) == _greedy("auto", 0, prompt)


def test_at_auto_or_zero_there_is_no_window() -> None:
    pool = BlockPool(num_layers=L, num_kv_heads=KVH, head_dim=D, block_size=BS, num_blocks=8, dtype=torch.float32,
                     device="cpu", kv_cache_dtype="auto", float_window=32)  # fmt: skip
    assert pool.window is None
    pool = BlockPool(num_layers=L, num_kv_heads=KVH, head_dim=D, block_size=BS, num_blocks=8, dtype=torch.float32,
                     device="cpu", kv_cache_dtype="int8", float_window=0)  # fmt: skip
    assert pool.window is None


def _window_manager(dtype: str, window: int, blocks: int = 64) -> tuple[BlockPool, CacheManager]:
    pool = BlockPool(num_layers=L, num_kv_heads=KVH, head_dim=D, block_size=BS, num_blocks=blocks,
                     dtype=torch.float32, device="cpu", kv_cache_dtype=dtype, float_window=window)  # fmt: skip
    return pool, CacheManager(pool, HostTier(1 << 20), scaling=D**-0.5)


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_a_small_window_holds_and_reads_exactly_the_blocks_of_the_last_r_tokens(dtype: str) -> None:
    """Token by token (decode's writes, through the calls attention makes): after each step the blocks holding one of
    the last R tokens have copies and no other block has; rows read through the window are exact for exactly those
    blocks' tokens and are the decoded codes for every older token."""
    R = 6
    pool, mgr = _window_manager(dtype, R)
    window = pool.window
    kv = mgr.open(0, make_controller(CachePolicy(controller="full")), math.inf)
    exact_k = torch.randn(30, KVH, D) * 3
    exact_v = torch.randn(30, KVH, D) * 3
    for n in range(1, 31):
        mgr.reserve(kv, 1)
        slot = torch.tensor(kv.table.slots(n - 1, n))
        plan = window.rows_of(slot)
        for layer in range(L):
            pool.store(layer, slot, exact_k[n - 1 : n], exact_v[n - 1 : n])
            if plan is not None:
                window.write(layer, plan, exact_k[n - 1 : n], exact_v[n - 1 : n])
        first = max(0, (n - R) // BS)
        held = [i for i, b in enumerate(kv.table.entries) if window.has(b)]
        assert held == list(range(first, math.ceil(n / BS))), n
        assert window.used_bytes == window.k.nbytes + window.v.nbytes
        assert window.num_blocks == len(held) and window.spare <= len(held) // window.min_blocks
        slots = torch.tensor(kv.table.slots(0, n))
        keys, values = pool.keys_at(L - 1, slots), pool.dequant(pool.v[L - 1][slots])
        codes_k, codes_v = keys.clone(), values.clone()
        window.read_into(L - 1, window.rows_of(slots), keys, values)
        in_window = torch.arange(n) >= first * BS
        assert torch.equal(keys[in_window], exact_k[:n][in_window])
        assert torch.equal(values[in_window], exact_v[:n][in_window])
        assert torch.equal(keys[~in_window], codes_k[~in_window])
        assert torch.equal(values[~in_window], codes_v[~in_window])
        if (~in_window).any():
            assert not torch.allclose(codes_k[~in_window], exact_k[:n][~in_window])
    mgr.close(kv)
    assert window.used_bytes == 0 and pool.num_free == pool.num_blocks


def test_a_decode_run_keeps_the_arena_across_leaves_and_joins() -> None:
    """Sequences at different points of their blocks, decoded token by token: a block that leaves the window gives
    its arena block to the next join, so the arena is copied only when it grows past the most blocks it has held
    (once a sequence at most, at their first coincidence), never shrunk while every window stays whole, and its
    bytes are at every step the arena's own (spare blocks included), within the spare bound."""
    R = 8
    pool, mgr = _window_manager("int4", R)
    window = pool.window
    policy = make_controller(CachePolicy(controller="full"))
    seqs = [mgr.open(i, policy, math.inf) for i in range(3)]
    for i, kv in enumerate(seqs):  # whole windows, each at another offset in its block
        mgr.reserve(kv, R + i)
    settled, peak, arena, kept = window.resizes, window.num_blocks, window.k, 0
    for _ in range(40):
        for kv in seqs:
            leaving = window.num_blocks
            before = (window.resizes, window.k, window.spare)
            mgr.reserve(kv, 1)
            peak = max(peak, window.num_blocks)
            assert window.used_bytes == window.k.nbytes + window.v.nbytes == window.capacity * window.block_bytes
            assert window.capacity <= peak  # grown only by the blocks missing
            assert window.spare <= window.num_blocks // window.min_blocks
            if window.num_blocks > leaving and before[2] > 0:  # a join took a spare block: nothing was copied
                assert window.resizes == before[0] and window.k is before[1]
                kept += 1
        if window.resizes == settled:
            assert window.k is arena
    assert kept >= 10  # 3 sequences cross a block 10 times in 40 tokens each
    assert window.resizes - settled <= len(seqs)
    for kv in seqs:
        mgr.close(kv)
        assert window.spare <= window.num_blocks // window.min_blocks
        assert window.used_bytes == window.k.nbytes + window.v.nbytes
    assert window.used_bytes == 0 and window.capacity == 0 and pool.num_free == pool.num_blocks


def test_spare_arena_blocks_count_as_used_but_cover_the_next_join() -> None:
    """A block that leaves keeps its bytes on the pool's budget (``num_free`` does not rise); the next join takes
    them, so its step needs only its pool block; when the pool needs the bytes, ``trim_window`` gives back the spare
    blocks that step does not take."""
    R = 8
    pool, mgr = _window_manager("int8", R)
    window = pool.window
    kv = mgr.open(0, make_controller(CachePolicy(controller="full")), math.inf)
    mgr.reserve(kv, 9)  # blocks 0, 1, 2: all in the window of the last 8 tokens
    mgr.reserve(kv, 3)  # 12 tokens: block 0 leaves (8 tokens follow it) and nothing joins
    assert window.num_blocks == 2 and window.spare == 1 and window.capacity == 3
    assert pool.outside_bytes == 3 * window.block_bytes
    assert mgr.room_needed(kv, 1) == mgr.blocks_needed(kv, 1) == 1  # block 3 joins in block 0's arena block
    free = pool.num_free
    mgr.trim_window(kv, 1)  # the step's join takes the spare block: it stays
    assert window.spare == 1 and pool.num_free == free
    window.trim()  # nothing to keep it for: the spare block goes back to the pool
    assert pool.num_free > free
    assert window.spare == 0 and window.capacity == 2 and pool.outside_bytes == 2 * window.block_bytes
    arena = window.k
    mgr.reserve(kv, 1)  # now the join grows the arena
    assert window.capacity == 3 and window.k is not arena
    mgr.close(kv)
    assert pool.outside_bytes == 0


def test_an_engine_decode_rebuilds_no_arena_while_every_window_is_whole() -> None:
    """Four sequences decoding in step through several block boundaries (``kv_float_window`` 32, as measured):
    after the prompts' step the arena keeps its storage to the end, though blocks leave and join, and its
    bytes are the pool's count of them at every step."""
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int4", kv_float_window=32,
              kv_cache_memory="8MiB")  # fmt: skip
    engine, window = llm.engine, llm.engine.pool.window
    ids = llm.tokenizer(TEXT)["input_ids"][:40]
    for i in range(4):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=40, ignore_eos=True))
    arenas, spares, done = [], [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            done += out.finished
        assert window.used_bytes == window.k.nbytes + window.v.nbytes
        assert _held_bytes(engine.pool) <= engine.pool.total_bytes
        if not done:
            arenas.append(window.k)
            spares.append(window.spare)
    assert len(arenas) >= 30 and max(spares) >= 4  # every sequence left a block and kept its room at least once
    assert all(a is arenas[0] for a in arenas)  # the prompts' step sized it; decoding never copied it
    assert window.used_bytes == 0


def test_window_copies_take_from_the_free_blocks_and_from_admissions_reservation() -> None:
    R = 8
    pool, mgr = _window_manager("int8", R)
    _, plain = _window_manager("int8", 0)
    policy = make_controller(CachePolicy(controller="full"))
    kv, other = mgr.open(0, policy, math.inf), plain.open(0, policy, math.inf)
    per_seq = pool.window.max_blocks * pool.window.block_bytes
    assert pool.window.max_blocks == 3  # 8 tokens span at most three blocks of four
    assert mgr.projected_blocks(kv, 40, 40, 40) == plain.projected_blocks(other, 40, 40, 40) + math.ceil(
        per_seq / pool.bytes_per_block
    )
    need = mgr.room_needed(kv, 10)
    mgr.reserve(kv, 10)  # tokens 0..9: blocks 0, 1, 2, all holding one of the last 8
    assert pool.outside_bytes == 3 * pool.window.block_bytes
    assert pool.num_free == len(pool._free) - math.ceil(pool.outside_bytes / pool.bytes_per_block)
    assert need == 3 + math.ceil(3 * pool.window.block_bytes / pool.bytes_per_block)
    mgr.reserve(kv, 4)  # 14 tokens: block 0 leaves (8 tokens follow it), block 3 joins in its room
    assert [i for i, b in enumerate(kv.table.entries) if pool.window.has(b)] == [1, 2, 3]
    mgr.close(kv)
    assert pool.outside_bytes == 0


def test_a_pool_that_cannot_hold_the_window_refuses_and_one_that_can_never_overruns() -> None:
    """``full`` at int8: a request whose tokens fit the pool but whose window copies do not is refused in one line;
    with the copies' blocks added it runs to the same tokens, never holding more than the pool's bytes."""
    probe = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int8", kv_float_window=16,
                kv_cache_memory="1MiB")  # fmt: skip
    pool = probe.engine.pool
    ids = probe.tokenizer("the window's copies count")["input_ids"]
    blocks = math.ceil((len(ids) + 12) / pool.block_size)
    copies = math.ceil(min(blocks, pool.window.max_blocks) * pool.window.block_bytes / pool.bytes_per_block)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    tight = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int8", kv_float_window=16,
                kv_cache_memory=blocks * pool.bytes_per_block, admission="reserve")  # fmt: skip
    with pytest.raises(ConfkvError, match="KV") as err:
        tight.generate([ids], params)
    assert "\n" not in str(err.value)
    room = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int8", kv_float_window=16,
               kv_cache_memory=(blocks + copies) * pool.bytes_per_block, admission="reserve")  # fmt: skip
    engine = room.engine
    engine.add_request("r", ids, params)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            tokens.extend(out.new_token_ids)
        assert _held_bytes(engine.pool) <= engine.pool.total_bytes
    assert len(tokens) == 12 and engine.pool.outside_bytes == 0


def _stream(policy: str, memory: int | str, **kwargs) -> tuple[LLM, list]:
    llm = LLM("tiny-random", policy, loaded=fresh_tiny(), kv_cache_dtype="int4", kv_float_window=24,
              kv_cache_memory=memory, max_batch_size=4, max_num_batched_tokens=32, **kwargs)  # fmt: skip
    engine = llm.engine
    ids = llm.tokenizer(TEXT)["input_ids"][:48]
    for i in range(4):
        engine.add_request(str(i), ids[i:], SamplingParams(max_tokens=40, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                outs.append(out)
        assert _held_bytes(engine.pool) <= engine.pool.total_bytes
    assert len(outs) == 4 and engine.pool.window.used_bytes == 0
    return llm, outs


@pytest.mark.parametrize("policy", ["window", "streaming"])
def test_evicting_policies_drop_the_copies_of_evicted_blocks(policy: str) -> None:
    """A window wider than the protected recent tokens: eviction takes blocks that hold copies, which go with them."""
    llm, outs = _stream(policy, "1MiB", max_size=32, min_recent=8, sink_tokens=4, compact_interval=4)
    assert llm.engine.stats()["evicted_blocks"] > 0
    assert all(o.output.kv["float_window_peak_bytes"] > 0 for o in outs)


def test_preemption_under_a_window_finishes_every_request() -> None:
    """A pool too small for four sequences and their windows: on-demand admission preempts (swap or recompute)
    and every request still finishes, never past the pool's bytes."""
    probe = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int4", kv_float_window=24,
                kv_cache_memory="1MiB")  # fmt: skip
    pool = probe.engine.pool
    per_seq = math.ceil(88 / pool.block_size) + math.ceil(
        pool.window.max_blocks * pool.window.block_bytes / pool.bytes_per_block
    )
    llm, _ = _stream("full", int(2.5 * per_seq) * pool.bytes_per_block)
    assert llm.engine.stats()["preemptions"] > 0


@pytest.mark.parametrize("value", [-1, 1.5, "32", True])
def test_bad_windows_are_refused_in_one_line(value: object) -> None:
    with pytest.raises(ConfkvError, match="kv_float_window") as err:
        make_engine_config({"kv_cache_dtype": "int4", "kv_float_window": value})
    assert "\n" not in str(err.value)


def test_the_command_line_refuses_a_negative_window_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    from confkv.cli import main

    assert main(["generate", "--model", "tiny-random", "--prompt", "x", "--kv-cache-dtype", "int4",
                 "--kv-float-window", "-4"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "kv_float_window" in err and "\n" not in err


def test_sessions_keep_the_pools_codes_and_restart_the_window(tmp_path) -> None:
    """A conversation parked between turns (host tier, then the store): the record holds the pool's codes, the
    resumed turns run without error, reuse the cached history, and the window holds no copy once they finish."""
    from confkv.sessions.tiers import SessionOptions

    from .test_sessions import _chat

    def offload(llm: LLM, i: int) -> None:
        llm.engine.sessions.reclaim(10**6)  # parked on the host tier: its blocks and their copies leave the device
        assert llm.engine.pool.window.used_bytes == 0
        assert llm.engine.flush_sessions() == 1
        llm.engine.sessions.parked.clear()  # the next turn reads the store

    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int8", kv_float_window=16,
              sessions=SessionOptions(store_url=str(tmp_path / "s")))  # fmt: skip
    outs = _chat(llm, "w", between=offload)
    assert all(o.cached_tokens > 0 for o in outs[1:])
    assert llm.engine.stats()["session_hits"]["store"] == 2
    llm.close()
