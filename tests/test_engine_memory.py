"""Admission by what a policy keeps (``admission="reserve"``; on demand: ``test_admission``), the circuit breaker's
hysteresis, preemption, and failures that stay with the request that caused them (tiny-random)."""

from __future__ import annotations

import pytest

from confkv import LLM, CachePolicy, SamplingParams
from confkv.errors import ConfkvError

from .conftest import fresh_tiny
from .test_engine import BLOCK_BYTES, PROMPTS, greedy


def _step_all(engine, watch=None):
    """Step until idle; returns the finished outputs by request id and the running count after every step."""
    done, running = {}, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.output
        running.append(len(engine.scheduler.running))
        if watch:
            watch(engine)
    return done, running


def _submit_all(llm, prompts, n_tokens):
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), p, greedy(n_tokens))
    return _step_all(llm.engine)


def test_admission_reserves_whole_length_for_full_so_nothing_is_preempted(tiny):
    """A pool that holds about two of the five requests under ``full``: admission waits for room instead of
    admitting and preempting, and every output equals the one it gets alone."""
    alone = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_memory="8MiB")
    expected = [o.token_ids for o in alone.generate(PROMPTS, greedy(40))]
    small = LLM(
        "tiny-random", "full", loaded=tiny, admission="reserve", kv_cache_memory=40 * BLOCK_BYTES, max_batch_size=5
    )
    outs = small.generate(PROMPTS, greedy(40))
    assert [o.token_ids for o in outs] == expected
    assert small.engine.scheduler.preemptions == 0
    assert small.engine.pool.num_used == 0


@pytest.mark.parametrize("scorer", ["snapkv", "h2o"])
def test_small_budget_runs_many_more_sequences_than_full(tiny, scorer):
    """A pool that fits two full-cache sequences runs at least six dynamic ones at once, none preempted, each
    holding no more than its budget plus one block once its prompt is read."""
    prompts = [f"Request {i}: " + "the pool is shared by every sequence in the batch. " * 6 for i in range(8)]
    n_tokens = 60
    per_full = -(-(len(prompts[0]) + n_tokens) // 16)
    pool_bytes = (2 * per_full + 1) * BLOCK_BYTES
    full = LLM("tiny-random", "full", loaded=fresh_tiny(), admission="reserve", kv_cache_memory=pool_bytes,
               max_batch_size=8, max_num_batched_tokens=32)  # fmt: skip
    _, full_running = _submit_all(full, prompts, n_tokens)
    assert max(full_running) <= 2
    llm = LLM(
        "tiny-random", "dynamic", loaded=tiny, admission="reserve", kv_cache_memory=pool_bytes, max_batch_size=8,
        max_num_batched_tokens=32, base_size=48, max_size=96, min_recent=16, sink_tokens=4, compact_interval=8,
        entropy_threshold=100.0, gap_threshold=0.0, scorer=scorer,
    )  # fmt: skip
    done, running = _submit_all(llm, prompts, n_tokens)
    assert max(running) >= 6
    assert llm.engine.stats()["preemptions"] == 0 and llm.engine.stats()["breaker_trips"] == 0
    for out in done.values():
        assert len(out.token_ids) == n_tokens
        assert max(out.trace.resident[1:]) <= 96 + 16  # the budget (at most max_size) plus one block


@pytest.mark.parametrize("scorer", ["snapkv", "h2o"])
def test_dynamic_comes_down_to_its_budget_once_the_prompt_is_read(tiny, scorer):
    """The first contraction does not wait for the compaction tick: right after the prompt the sequence holds
    its budget plus the new token, not max_size."""
    llm = LLM(
        "tiny-random", "dynamic", loaded=tiny, admission="reserve", max_num_batched_tokens=128, base_size=48,
        max_size=256, min_recent=16, compact_interval=50, entropy_threshold=100.0, gap_threshold=0.0, scorer=scorer,
    )  # fmt: skip
    out = llm.generate(PROMPTS[4] * 2, greedy(10))[0]  # ~820 prompt tokens
    assert out.trace.resident[0] > 256  # the first token still saw max_size plus the last chunk
    assert max(out.trace.resident[1:]) <= 48 + 1


def test_a_preempted_sequence_is_recomputed_to_the_same_output(tiny):
    """Preemption gives back every block and recomputes the request from its tokens: under ``full`` the output is
    exactly the one it gets alone."""
    alone = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_memory="8MiB")
    expected = [o.token_ids for o in alone.generate(PROMPTS[1:], greedy(40))]
    llm = LLM("tiny-random", "full", loaded=tiny, admission="reserve", max_batch_size=4, max_num_batched_tokens=64)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[1:]):
        engine.add_request(str(i), prompt, greedy(40))
    for _ in range(12):
        engine.step()
    engine.scheduler._preempt(engine.sequence("1"))  # what memory pressure does to the newest sequence
    done, _ = _step_all(engine)
    assert [done[str(i)].token_ids for i in range(4)] == expected
    assert done["1"].kv["preemptions"] == 1 and engine.stats()["recomputed_tokens"] > 0
    assert engine.pool.num_used == 0


def test_pressure_after_a_swap_to_full_preempts_and_every_request_finishes(tiny):
    """Commitments made under a small dynamic budget stop holding when the policy becomes ``full`` (sequences then
    grow without trimming): the engine preempts instead of failing, and every request completes."""
    llm = LLM(
        "tiny-random", "dynamic", loaded=tiny, admission="reserve", kv_cache_memory=40 * BLOCK_BYTES, max_batch_size=4,
        base_size=32, max_size=64, min_recent=16, max_num_batched_tokens=64,
    )  # fmt: skip
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[1:]):
        engine.add_request(str(i), prompt, greedy(150))
    for _ in range(20):
        engine.step()
    engine.set_policy(CachePolicy(controller="full"))
    done, _ = _step_all(engine)
    assert sorted(done) == ["0", "1", "2", "3"] and all(len(o.token_ids) == 150 for o in done.values())
    assert engine.stats()["preemptions"] > 0
    assert engine.pool.num_used == 0


def test_breaker_trips_once_under_sustained_pressure_and_never_refills_by_recall(tiny):
    """Lowering the watermarks below the pool use a running batch already has is sustained pressure: the breaker
    trips, shrinks the largest sequences until use is under the low mark, refuses expansions while tripped, and
    does not trip again and again; every request finishes."""
    llm = LLM(
        "tiny-random", "dynamic", loaded=tiny, admission="reserve", kv_cache_memory=200 * BLOCK_BYTES, max_batch_size=4,
        max_num_batched_tokens=64, base_size=64, max_size=256, min_recent=32, sink_tokens=4, compact_interval=8,
        entropy_threshold=0.0,
    )  # fmt: skip
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[1:]):
        engine.add_request(str(i), prompt * 3, greedy(60))
    for _ in range(12):
        engine.step()
    used = engine.pool.usage
    engine.set_policy(engine.policy.replace(memory_high_watermark=used * 0.6, memory_low_watermark=used * 0.4))
    seen = {"recalled": engine.stats()["recalled_blocks"], "while_tripped": 0}

    def watch(e):
        now = e.stats()["recalled_blocks"]
        if e.scheduler.tripped:
            seen["while_tripped"] += now - seen["recalled"]
        seen["recalled"] = now

    done, _ = _step_all(engine, watch)
    stats = engine.stats()
    assert 1 <= stats["breaker_trips"] <= 2
    assert seen["while_tripped"] == 0
    assert stats["refused_expansions"] > 0
    assert sorted(done) == ["0", "1", "2", "3"] and all(len(o.token_ids) == 60 for o in done.values())
    assert stats["pool_used_blocks"] == 0 and stats["host_used_bytes"] == 0


def test_a_failing_forward_fails_only_its_own_request(tiny, monkeypatch):
    """One request whose chunk makes the forward pass raise is finished with an error; the others, batched with
    it (and once hit by a transient failure of the whole pass), give exactly the output they give alone, and the
    engine keeps serving."""
    alone = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_memory="8MiB")
    expected = {str(i): o.token_ids for i, o in enumerate(alone.generate(PROMPTS[:4], greedy(24)))}
    llm = LLM("tiny-random", "full", loaded=tiny, admission="reserve", max_batch_size=8)
    engine = llm.engine
    run = engine.runner.run
    transient = {"left": 1}

    def flaky(chunks, **kw):
        if any(ch.seq.request_id == "bad" for ch in chunks):
            raise RuntimeError("injected fault")
        if len(chunks) > 1 and transient["left"]:  # the whole batched pass fails once
            transient["left"] -= 1
            raise RuntimeError("transient fault")
        return run(chunks, **kw)

    monkeypatch.setattr(engine.runner, "run", flaky)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, greedy(24))
    engine.add_request("bad", PROMPTS[4], greedy(24))
    done, _ = _step_all(engine)
    assert done["bad"].finish_reason == "error" and "injected fault" in done["bad"].error
    assert {k: v.token_ids for k, v in done.items() if k != "bad"} == expected
    assert engine.stats()["request_errors"] == 1
    assert engine.pool.num_used == 0
    monkeypatch.setattr(engine.runner, "run", run)
    assert llm.generate(PROMPTS[0], greedy(24))[0].token_ids == expected["0"]


def test_a_request_that_can_never_fit_fails_alone(tiny):
    """Refused at once when it is added; and if a swap makes a running request too big for the whole pool, it
    alone finishes with an error while the others complete."""
    llm = LLM("tiny-random", "dynamic", loaded=tiny, admission="reserve", kv_cache_memory=24 * BLOCK_BYTES,
              max_batch_size=4, base_size=64, max_size=128, min_recent=32, max_num_batched_tokens=64)  # fmt: skip
    engine = llm.engine
    with pytest.raises(ConfkvError, match="KV blocks"):
        engine.add_request("huge", "x" * 200, SamplingParams(max_tokens=400, ignore_eos=True),
                           policy_overrides={"controller": "full"})  # fmt: skip
    engine.add_request("short", "hi", greedy(40))
    engine.add_request("long", "y" * 380, greedy(40))
    for _ in range(4):
        engine.step()
    engine.set_policy(CachePolicy(controller="full"))
    engine.scheduler._preempt(engine.sequence("long"))  # to be recomputed whole: 27 blocks of a 24-block pool
    done, _ = _step_all(engine)
    assert done["long"].finish_reason == "error" and "KV blocks" in done["long"].error
    assert len(done["short"].token_ids) == 40 and done["short"].finish_reason == "length"
    assert engine.pool.num_used == 0


def test_a_failing_second_pass_fails_only_its_own_request(tiny, monkeypatch):
    """A recall's second pass (a rerun chunk, which reserves nothing) that keeps failing when run alone finishes its
    own request with an error; the request batched with it gives its solo output."""
    kw = dict(base_size=32, max_size=256, min_recent=32, sink_tokens=4, scaling_factor=0.001,
              entropy_threshold=4.0358, compact_interval=1, kv_cache_memory="8MiB")  # fmt: skip
    prompt = "Budgets move with confidence; the cache follows the budget. " * 2
    params = greedy(48)
    alone = LLM("tiny-random", "dynamic", loaded=fresh_tiny(), **kw).generate(prompt, params)[0].token_ids
    llm = LLM("tiny-random", "dynamic", loaded=tiny, admission="reserve", **kw)
    engine = llm.engine
    run = engine.runner.run

    def flaky(chunks, **k):
        if any(ch.rerun and ch.seq.request_id == "bad" for ch in chunks):
            raise RuntimeError("injected fault in a second pass")
        return run(chunks, **k)

    monkeypatch.setattr(engine.runner, "run", flaky)
    engine.add_request("good", prompt, params)
    engine.add_request("bad", prompt, params)
    done, _ = _step_all(engine)
    assert done["bad"].finish_reason == "error" and done["bad"].error.startswith("forward pass failed")
    assert done["good"].token_ids == alone and engine.num_reruns > 0
    assert engine.pool.num_used == 0


def test_a_swap_keeps_a_request_whose_overrides_do_not_apply(tiny):
    """A request whose overrides the new policy cannot take (a scorer a preset does not use) finishes under the
    policy it had, with its solo output; the swap itself is applied whole and new requests run under it."""
    params = greedy(24)
    kw = dict(base_size=32, max_size=64, min_recent=16, kv_cache_memory="8MiB")
    alone = LLM("tiny-random", "dynamic", loaded=fresh_tiny(), scorer="h2o", **kw).generate(PROMPTS[0], params)
    llm = LLM("tiny-random", "dynamic", loaded=tiny, admission="reserve", **kw)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], params, policy_overrides={"scorer": "h2o"})
    engine.step()
    swaps = engine.policy_swaps
    engine.set_policy(CachePolicy(controller="window", max_size=64, min_recent=32, host_cache_memory=BLOCK_BYTES))
    assert engine.policy_swaps == swaps + 1 and engine.policy.controller == "window"
    assert engine.host.capacity_bytes == BLOCK_BYTES  # the swapped host size is the one in effect
    engine.add_request("b", PROMPTS[1], params)
    assert engine._seqs["b"].kv.controller.name == "window"
    done, _ = _step_all(engine)
    assert done["a"].token_ids == alone[0].token_ids
    assert engine.pool.num_used == 0


def test_the_breaker_shrink_holds_for_a_sequence_reading_its_prompt(tiny):
    """A sequence shrunk by the breaker while it reads a long prompt stays at its floor until the breaker resets:
    it is not trimmed back only to ``max_size`` between chunks, nor set to its first budget when the prompt ends."""
    llm = LLM("tiny-random", "dynamic", loaded=tiny, admission="reserve", kv_cache_memory=200 * BLOCK_BYTES,
              max_batch_size=4, max_num_batched_tokens=32, base_size=64, max_size=256, min_recent=32,
              sink_tokens=4)  # fmt: skip
    engine = llm.engine
    engine.add_request("long", PROMPTS[1] * 12, greedy(8))
    for _ in range(10):  # part of the prompt read, past max_size
        engine.step()
    seq = engine._seqs["long"]
    assert not seq.prompt_done and seq.kv.table.resident_tokens() > 200
    used = engine.pool.usage
    engine.set_policy(engine.policy.replace(memory_high_watermark=used * 0.5, memory_low_watermark=used * 0.1))
    floor = engine.manager.floor_tokens(seq.kv)
    done, resident = {}, []
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.output) for o in engine.step() if o.finished)
        if engine.scheduler.tripped and not done:
            resident.append(seq.kv.table.resident_tokens())
    assert engine.scheduler.breaker_trips == 1 and resident
    assert max(resident) <= floor + 32 + engine.pool.block_size  # the floor plus the step's chunk
    assert len(done["long"].token_ids) == 8 and engine.pool.num_used == 0


def test_a_sequence_preempted_for_room_loses_the_second_pass_scheduled_for_it(tiny):
    """Second passes are scheduled first; when a later decode must preempt the sequence that has one, its chunk
    goes too (it would run on blocks already given back)."""
    llm = LLM("tiny-random", "full", loaded=tiny, admission="reserve", kv_cache_memory="8MiB", max_batch_size=4)
    engine = llm.engine
    prompt = list(range(3, 19))  # 16 tokens: the first decode needs a new block
    engine.add_request("a", prompt, greedy(8))
    engine.add_request("b", list(range(3, 40)), greedy(8))
    engine.step()
    a, b = engine.sequence("a"), engine.sequence("b")
    assert engine.scheduler.running == [a, b] and engine.manager.blocks_needed(a.kv, 1) == 1
    b.rerun = 1  # as after a recall
    engine.pool._free.clear()  # no free block: a's decode must preempt b
    sched = engine.scheduler.schedule()
    assert [c.seq for c in sched.chunks] == [a] and b in engine.scheduler.waiting and b.rerun == 0
