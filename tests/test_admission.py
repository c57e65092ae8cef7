"""On-demand admission (vLLM's): blocks taken as tokens are computed, the newest sequence preempted (swapped to the
host tier or recomputed) when the pool runs out, and every request finished with the tokens it gets alone; the
``reserve`` mode it sits beside is left as it was (tiny-random)."""

from __future__ import annotations

import pytest

from confkv import LLM
from confkv.cli import main
from confkv.errors import ConfkvError

from .conftest import fresh_tiny
from .test_engine import BLOCK_BYTES, PROMPTS, greedy
from .test_engine_memory import _step_all

N_TOKENS = 40


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each prompt's greedy tokens under ``full`` with a pool that holds them all (no pressure)."""
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), kv_cache_memory="8MiB")
    return [o.token_ids for o in llm.generate(PROMPTS, greedy(N_TOKENS))]


def _pressed(admission: str, host_bytes: int, loaded=None) -> LLM:
    """``full`` over a pool of 40 blocks: about two of the five requests at their final length."""
    return LLM(
        "tiny-random", "full", loaded=loaded or fresh_tiny(), kv_cache_memory=40 * BLOCK_BYTES, max_batch_size=5,
        admission=admission, host_cache_memory=host_bytes,
    )  # fmt: skip


@pytest.mark.parametrize(("host_bytes", "swapped"), [(8 * 2**20, True), (0, False)], ids=["swap", "recompute"])
def test_on_demand_fills_the_pool_preempts_and_every_answer_is_the_one_it_gets_alone(alone, host_bytes, swapped):
    """Under a pool too small for every request at once, on-demand admission runs more of them than ``reserve``
    does, preempts when they outgrow it (swapping while the host tier has room, recomputing with none), fails no
    request, and each gets exactly its greedy tokens alone."""
    llm = _pressed("on_demand", host_bytes)
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(str(i), p, greedy(N_TOKENS))
    done, running = _step_all(llm.engine)
    stats = llm.engine.stats()
    assert [done[str(i)].token_ids for i in range(len(PROMPTS))] == alone
    assert all(o.finish_reason == "length" for o in done.values())
    assert stats["request_errors"] == 0
    assert stats["preemptions"] > 0 and max(running) > 2
    if swapped:
        assert stats["swap_preemptions"] == stats["preemptions"] and stats["swapped_tokens"] > 0
        assert stats["preempted_recomputed_tokens"] == 0
    else:
        assert stats["swap_preemptions"] == 0 and stats["preempted_recomputed_tokens"] > 0
    assert llm.engine.pool.num_used == 0 and llm.engine.host.used_bytes == 0


def test_a_swapped_sequence_whose_blocks_the_host_dropped_is_recomputed(alone):
    """A sequence swapped out whose blocks the host tier has since dropped is recomputed from its tokens instead
    (its answer is unchanged)."""
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), max_batch_size=5, admission="on_demand")
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[1:]):
        engine.add_request(str(i), prompt, greedy(N_TOKENS))
    for _ in range(12):
        engine.step()
    seq = engine.sequence("3")
    engine.scheduler.running.remove(seq)  # the newest sequence, as memory pressure would preempt it
    engine.scheduler.running.append(seq)
    engine.scheduler._preempt(seq)
    assert seq.swapped and engine.stats()["swap_preemptions"] == 1
    engine.manager.mark_dropped(engine.host.resize(0))  # the host tier gives its blocks up
    done, _ = _step_all(engine)
    assert [done[str(i)].token_ids for i in range(4)] == alone[1:]
    assert engine.stats()["preempted_recomputed_tokens"] > 0


def test_reserve_admits_by_projection_and_never_preempts_full(alone):
    """``reserve`` is the admission before on demand became the default: under the same pool nothing is preempted
    and at most two of the five run at once."""
    llm = _pressed("reserve", 8 * 2**20)
    assert llm.engine.scheduler.admission == "reserve"
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(str(i), p, greedy(N_TOKENS))
    done, running = _step_all(llm.engine)
    assert [done[str(i)].token_ids for i in range(len(PROMPTS))] == alone
    assert llm.engine.stats()["preemptions"] == 0 and max(running) <= 2


def test_on_demand_under_dynamic_finishes_everything_without_errors():
    """An evicting policy under on-demand admission with a pool too small for its prompts at ``max_size``: every
    request finishes with its full length, none fails for memory, and pressure is answered by preemption, never by
    the breaker cutting budgets."""
    llm = LLM(
        "tiny-random", "dynamic", loaded=fresh_tiny(), kv_cache_memory=24 * BLOCK_BYTES, max_batch_size=5,
        max_num_batched_tokens=64, base_size=32, max_size=96, min_recent=16, admission="on_demand",
    )  # fmt: skip
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(str(i), p, greedy(60))
    done, _ = _step_all(llm.engine)
    assert sorted(done) == [str(i) for i in range(len(PROMPTS))]
    assert all(len(o.token_ids) == 60 and o.finish_reason == "length" for o in done.values())
    stats = llm.engine.stats()
    assert stats["request_errors"] == 0 and llm.engine.pool.num_used == 0
    assert stats["preemptions"] > 0 and stats["breaker_trips"] == 0


def test_on_demand_is_the_default_and_a_bad_mode_is_one_clear_error(capsys):
    assert LLM("tiny-random", "full", loaded=fresh_tiny()).engine.scheduler.admission == "on_demand"
    with pytest.raises(ConfkvError, match="admission"):
        LLM("tiny-random", "full", loaded=fresh_tiny(), admission="greedy")
    assert main(["generate", "--model", "tiny-random", "--prompt", "Hi", "--admission", "lazy"]) == 2
    assert "--admission takes reserve or on_demand" in capsys.readouterr().err
