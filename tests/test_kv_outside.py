"""Device bytes kept beside the pool count against its budget: int4's float copies of open blocks' keys and the
demoted copies (``demote_dtype``) take blocks from ``num_free``, admission reserves them ahead, and an engine whose
pool cannot hold them refuses the request or runs fewer at once instead of holding more than ``kv_cache_memory``."""

from __future__ import annotations

import math

import pytest
import torch

from confkv import LLM
from confkv.cache.manager import CacheManager
from confkv.config import CachePolicy
from confkv.controllers import make_controller
from confkv.engine.params import SamplingParams
from confkv.errors import ConfkvError
from confkv.kv.host import HostTier
from confkv.kv.pool import BlockPool

from .conftest import fresh_tiny

L, KVH, D, BS = 2, 2, 16, 4


def _held_bytes(pool: BlockPool) -> int:
    """What the pool's budget holds: blocks off the free list plus the bytes kept beside it."""
    return (pool.num_blocks - len(pool._free)) * pool.bytes_per_block + pool.outside_bytes


def test_an_open_int4_block_takes_its_float_copy_from_the_free_blocks() -> None:
    pool = BlockPool(num_layers=L, num_kv_heads=KVH, head_dim=D, block_size=BS, num_blocks=8, dtype=torch.float32,
                     device="cpu", kv_cache_dtype="int4")  # fmt: skip
    copy_blocks = math.ceil(L * BS * KVH * D * 4 / pool.bytes_per_block)
    assert pool.open_copy_bytes == L * BS * KVH * D * 4 and copy_blocks >= 2  # a float copy outweighs an int4 block
    block = pool.allocate(1)
    x = torch.randn(BS, KVH, D)
    for layer in range(L):
        pool.store(layer, pool.slots_of(block)[:2], x[:2], x[:2])
    assert pool.num_free == 8 - 1 - copy_blocks and pool.num_used == 1 + copy_blocks
    for layer in range(L):
        pool.store(layer, pool.slots_of(block)[2:], x[2:], x[2:])
    assert pool.outside_bytes == 0 and pool.num_free == 7, "a full block keeps no copy"


def test_demoted_copies_take_from_the_free_blocks_and_from_admissions_reservation() -> None:
    policy = CachePolicy(controller="window", max_size=24, min_recent=16, demote_dtype="int4")
    pool = BlockPool(num_layers=L, num_kv_heads=KVH, head_dim=D, block_size=BS, num_blocks=32, dtype=torch.float32,
                     device="cpu")  # fmt: skip
    mgr = CacheManager(pool, HostTier(1 << 20), scaling=D**-0.5)
    kv = mgr.open(0, make_controller(policy), 24)
    per_block = mgr.demoted_block_bytes("int4")
    # the pool's int4 rows: keys 4-bit codes plus the block's channel grid spread over its rows, values 4-bit codes
    # plus one group's scale and zero point
    assert per_block == L * BS * KVH * ((D // 2 + 4 * D // BS) + (D // 2 + 4))
    # 80 tokens, of which eviction may take all but the protected recent ones (16 tokens: four blocks)
    evictable = 20 - math.ceil(mgr.floor_tokens(kv) / BS)
    assert evictable == 16
    extra = math.ceil(evictable * per_block / pool.bytes_per_block)
    plain = CacheManager(pool, HostTier(1 << 20), scaling=D**-0.5)
    evicting = plain.open(1, make_controller(policy.model_copy(update={"demote_dtype": "none"})), 24)
    assert mgr.projected_blocks(kv, 80, 1, 8) == plain.projected_blocks(evicting, 80, 1, 8) + extra
    mgr.reserve(kv, 40)
    pool.k[:, pool.slots_of(kv.table.device_blocks())] = torch.randn(L, 40, KVH, D)
    mgr.evict_to(kv, 24)
    demoted = mgr.demoted.used_bytes
    assert demoted == 4 * per_block
    assert pool.num_free == len(pool._free) - math.ceil(demoted / pool.bytes_per_block)
    mgr.close(kv)
    assert pool.num_free == 32 and pool.outside_bytes == 0


def test_a_pool_that_cannot_hold_the_open_blocks_copy_refuses_the_request() -> None:
    """``full`` at int4: a request whose tokens fill the pool exactly, but whose open block's float copy would not
    fit beside them, is refused in one line; with the copy's blocks added it runs, never past the budget."""
    probe = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int4", kv_cache_memory="1MiB")
    pool = probe.engine.pool
    ids = probe.tokenizer("the open block's copy counts")["input_ids"]
    tokens = len(ids) + 10
    blocks = math.ceil(tokens / pool.block_size)
    copy = math.ceil(pool.open_copy_bytes / pool.bytes_per_block)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    tight = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int4",
                kv_cache_memory=blocks * pool.bytes_per_block)  # fmt: skip
    with pytest.raises(ConfkvError, match="KV") as err:
        tight.generate([ids], params)
    assert "\n" not in str(err.value)
    room = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype="int4",
               kv_cache_memory=(blocks + copy) * pool.bytes_per_block)  # fmt: skip
    engine = room.engine
    engine.add_request("r", ids, params)
    while engine.has_unfinished_requests():
        engine.step()
        assert _held_bytes(engine.pool) <= engine.pool.total_bytes


def _most_at_once(demote: str, blocks: int | None = None, admission: str = "reserve") -> tuple[int, int, object]:
    """Four ``window`` requests at ``demote``: the most running at once, the demoted bytes' peak, and the engine;
    with ``blocks`` unset, a pool roomy enough for all (to read the reservations from)."""
    kwargs = {"max_size": 32, "min_recent": 16, "demote_dtype": demote, "max_batch_size": 4, "compact_interval": 8,
              "max_num_batched_tokens": 32, "memory_high_watermark": 1.0, "memory_low_watermark": 1.0,
              "admission": admission}  # fmt: skip
    probe = LLM("tiny-random", "window", loaded=fresh_tiny(), kv_cache_memory="1MiB", **kwargs)
    memory = "1MiB" if blocks is None else blocks * probe.engine.pool.bytes_per_block
    llm = LLM("tiny-random", "window", loaded=fresh_tiny(), kv_cache_memory=memory, **kwargs)
    engine = llm.engine
    ids = llm.tokenizer("Demoted copies count. " * 4)["input_ids"]
    for i in range(4):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=40, ignore_eos=True))
    if blocks is None:
        return 0, 0, engine
    most, demoted, done = 0, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            done += out.finished
        most = max(most, len(engine.scheduler.running))
        demoted = max(demoted, engine.manager.demoted.used_bytes)
        assert _held_bytes(engine.pool) <= engine.pool.total_bytes
    assert done == 4
    return most, demoted, engine


def test_demoting_sequences_run_fewer_at_once_rather_than_overrun_the_pool() -> None:
    """Four demoting ``window`` requests in a pool that holds four of their windows but not also four sets of
    demoted copies: reserving admission runs three at once, where without demotion all four run; on demand they
    all four finish; and at no step do blocks and copies exceed the pool's bytes."""
    _, _, engine = _most_at_once("int4")
    seq = engine.scheduler.waiting[0]
    need = engine.scheduler.committed(seq)
    outside = engine.manager.outside_blocks(seq.kv, engine.scheduler.total_tokens(seq))
    assert outside >= 1
    # three reading their prompts fill the pool; once read, three hold one block fewer each, too few for a fourth
    # reading its prompt with its copies reserved, and plenty for one without (the reservation less the copies)
    most, demoted, _ = _most_at_once("int4", 3 * need)
    assert demoted > 0 and most == 3
    most, demoted, _ = _most_at_once("none", 3 * need)
    assert demoted == 0 and most == 4
    # on demand (no reservation ahead): preemption, not an overrun, answers the copies (checked at every step)
    _, demoted, _ = _most_at_once("int4", 3 * need, admission="on_demand")
    assert demoted > 0
