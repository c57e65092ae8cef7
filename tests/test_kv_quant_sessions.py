"""Quantised KV on the lower tiers: evicted blocks and session records keep the pool's packed rows, a session written
under int8 resumes exactly under int8 (the turns it gives are the ones it gives when kept on the device), and it is
foreign to an engine of another KV dtype (recomputed there, as a record of another model is). With ``host_kv_dtype``
the lower tiers hold a more compact form than the pool, and the record's dtype names that form."""

from __future__ import annotations

import pytest

from confkv import LLM
from confkv.errors import ConfkvError
from confkv.sessions.store import SessionStore
from confkv.sessions.tiers import SessionOptions

from .conftest import fresh_tiny
from .test_sessions import PARAMS, TURNS, _chat


def _llm(kv_cache_dtype: str, **kw) -> LLM:
    return LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_dtype=kv_cache_dtype, **kw)


@pytest.fixture(scope="module")
def on_device() -> list[list[int]]:
    """int8 turns whose history stays on the device between turns: what every lower tier must give back."""
    return [o.token_ids for o in _chat(_llm("int8"), "kept")]


def test_host_tier_holds_packed_blocks_and_gives_them_back(on_device):
    llm = _llm("int8")
    outs = _chat(llm, "host", between=lambda llm, i: llm.engine.sessions.reclaim(10**6))
    assert [o.token_ids for o in outs] == on_device
    assert llm.engine.stats()["session_hits"]["host"] == 2
    llm.engine.sessions.reclaim(10**6)
    host = llm.engine.host
    assert len(host) > 0 and llm.engine.pool.num_used == 0
    # the host tier holds the pool's rows, bytes and all: a block costs there what it cost on the device
    assert host.used_bytes == len(host) * llm.engine.pool.bytes_per_block


def test_an_int8_session_resumes_exactly_under_int8_and_is_foreign_under_auto(on_device, tmp_path):
    url = str(tmp_path / "sessions")

    def offload(llm, i):
        assert llm.engine.flush_sessions() == 1
        llm.engine.sessions.parked.clear()  # the process is gone: the next turn reads the store

    first = _llm("int8", sessions=SessionOptions(store_url=url))
    outs = _chat(first, "s", between=offload)
    assert [o.token_ids for o in outs] == on_device
    assert all(o.cached_tokens > 0 for o in outs[1:]) and first.engine.stats()["session_hits"]["store"] == 2
    assert first.engine.flush_sessions() == 1
    first.close()

    store = SessionStore(url)
    record = store.get("s", expect={"dtype": "kv-int8"})
    assert record.dtype == "kv-int8" and record.blocks
    block = next(iter(record.blocks.values()))
    assert block.k.dtype.itemsize == 1 and block.k.shape[-1] == first.engine.pool.k_row
    # the same conversation in a float32 pool: its record's K and V take more than 3x the bytes
    float_llm = _llm("auto", sessions=SessionOptions(store_url=str(tmp_path / "float")))
    _chat(float_llm, "f")
    float_llm.engine.flush_sessions()
    float_llm.close()
    float_record = SessionStore(str(tmp_path / "float")).get("f", expect={"dtype": "float32"})
    assert record.kv_bytes / float_record.kv_bytes <= 0.3  # tiny-random: head_dim 16, 18 bytes a row against 64

    # an engine of another KV dtype refuses the record as foreign and recomputes the conversation
    auto = _llm("auto", sessions=SessionOptions(store_url=url))
    messages = [{"role": "user", "content": TURNS[0]}]
    (out,) = auto.chat([messages], PARAMS, session_id="s")
    assert out.cached_tokens == 0 and auto.engine.stats()["session_faults"]["foreign"] == 1
    auto.close()
    # and so does an engine of another packed dtype: int4 rows are not int8 rows
    int4 = _llm("int4", sessions=SessionOptions(store_url=url))
    (out,) = int4.chat([messages], PARAMS, session_id="s")
    assert out.cached_tokens == 0 and int4.engine.stats()["session_faults"]["foreign"] == 1
    int4.close()


def test_host_kv_dtype_keeps_the_lower_tiers_more_compact_than_the_pool(tmp_path):
    """A float32 pool with the host tier and records at int8: a session resumes from the host tier and from the
    store alike, its record is ``kv-int8``, and engines whose lower tiers hold another form refuse it as foreign."""
    url = str(tmp_path / "sessions")

    def to_host(llm, i):
        llm.engine.sessions.reclaim(10**6)

    def to_store(llm, i):
        assert llm.engine.flush_sessions() == 1
        llm.engine.sessions.parked.clear()

    host_llm = _llm("auto", host_kv_dtype="int8")
    via_host = [o.token_ids for o in _chat(host_llm, "h", between=to_host)]
    host_llm.engine.sessions.reclaim(10**6)
    host, pool = host_llm.engine.host, host_llm.engine.pool
    int8_block = pool.bytes_per_block_for(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size,
                                          pool.compute_dtype, "int8")  # fmt: skip
    assert len(host) > 0 and host.used_bytes == len(host) * int8_block < len(host) * pool.bytes_per_block

    first = _llm("auto", host_kv_dtype="int8", sessions=SessionOptions(store_url=url))
    outs = _chat(first, "s", between=to_store)
    assert [o.token_ids for o in outs] == via_host  # the history crossed int8 once either way
    assert all(o.cached_tokens > 0 for o in outs[1:]) and first.engine.stats()["session_hits"]["store"] == 2
    assert first.engine.flush_sessions() == 1
    first.close()
    record = SessionStore(url).get("s", expect={"dtype": "kv-int8"})
    assert record.dtype == "kv-int8" and next(iter(record.blocks.values())).k.dtype.itemsize == 1

    messages = [{"role": "user", "content": TURNS[0]}]
    for kv_dtype, host_dtype in (("auto", None), ("auto", "int4")):
        other = _llm(kv_dtype, host_kv_dtype=host_dtype, sessions=SessionOptions(store_url=url))
        (out,) = other.chat([messages], PARAMS, session_id="s")
        assert out.cached_tokens == 0 and other.engine.stats()["session_faults"]["foreign"] == 1, host_dtype
        other.close()
    # the record names its rows, not the settings: a pool at int8 holds the same rows and resumes it
    same_rows = _llm("int8", sessions=SessionOptions(store_url=url))
    (out,) = same_rows.chat([messages], PARAMS, session_id="s")
    assert out.cached_tokens > 0 and same_rows.engine.stats()["session_hits"]["store"] == 1
    same_rows.close()


def test_a_bad_host_kv_dtype_is_a_one_line_error():
    with pytest.raises(ConfkvError, match="host_kv_dtype") as err:
        _llm("auto", host_kv_dtype="int3")
    assert "\n" not in str(err.value)


def test_a_host_kv_dtype_less_compact_than_the_pool_is_refused():
    with pytest.raises(ConfkvError, match="less compact") as err:
        _llm("int8", host_kv_dtype="auto")
    assert "\n" not in str(err.value)


def test_a_preempted_sequence_swaps_when_the_host_has_room_in_its_own_form():
    """Room on the host tier is counted in the host's form: a float32 pool with host int8 swaps a preempted
    sequence out into exactly its int8 bytes (where float32 blocks would not fit)."""
    from confkv.engine.params import SamplingParams

    llm = _llm("auto", host_kv_dtype="int8", host_cache_memory=2**20)
    engine = llm.engine
    engine.add_request("a", "Tell me a long story about the sea and the fish that live in it.",
                       SamplingParams(max_tokens=24, temperature=0.0))  # fmt: skip
    for _ in range(8):
        engine.step()
    (seq,) = engine.scheduler.running
    blocks = len(seq.kv.table.resident_indices())
    per_block = engine.manager.host_bytes_per_block
    assert blocks > 0 and per_block * 3 < engine.pool.bytes_per_block  # int8 rows against float32 ones
    engine.host.capacity_bytes = blocks * per_block
    assert engine.scheduler._swap_out(seq) and engine.host.used_bytes == blocks * per_block


def test_an_fp8_session_keeps_its_block_means_and_names_its_rows(tmp_path):
    """fp8 keys carry their block's means inside the rows, so a record holds them as bytes like any other row: it is
    ``kv-fp8m``, resumes from the store under fp8 with its history reused, and an int8 engine refuses it."""
    url = str(tmp_path / "sessions")

    def to_store(llm, i):
        assert llm.engine.flush_sessions() == 1
        llm.engine.sessions.parked.clear()

    first = _llm("fp8", sessions=SessionOptions(store_url=url))
    outs = _chat(first, "s", between=to_store)
    assert all(o.cached_tokens > 0 for o in outs[1:]) and first.engine.stats()["session_hits"]["store"] == 2
    assert first.engine.flush_sessions() == 1
    pool = first.engine.pool
    first.close()
    record = SessionStore(url).get("s", expect={"dtype": "kv-fp8m"})
    block = next(iter(record.blocks.values()))
    assert block.k.shape[-1] == pool.k_row == pool.head_dim + 2 + -(-pool.head_dim // pool.block_size)
    messages = [{"role": "user", "content": TURNS[0]}]
    int8 = _llm("int8", sessions=SessionOptions(store_url=url))
    (out,) = int8.chat([messages], PARAMS, session_id="s")
    assert out.cached_tokens == 0 and int8.engine.stats()["session_faults"]["foreign"] == 1
    int8.close()
