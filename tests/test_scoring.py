"""Teacher-forced scoring: exact under ``full``, KL zero against its own reference, bounded under eviction, and equal
to decoding when read one token at a time."""

from __future__ import annotations

import pytest
import torch

from confkv import LLM
from confkv.engine.params import SamplingParams
from confkv.errors import ConfkvError
from confkv.scoring import ScoreItem, Scorer, TopK, kl_from_topk

from .conftest import fresh_tiny, hf_logprobs


def texts(tokenizer) -> list[list[int]]:
    return [
        tokenizer("Teacher forcing reads the reference continuation chunk by chunk. " * k)["input_ids"]
        for k in (1, 4, 9)
    ]


def test_full_scoring_matches_hf_forward(tiny, tiny_reference):
    llm = LLM("tiny-random", "full", loaded=tiny, compact_interval=16, max_num_batched_tokens=64)
    ids = texts(llm.tokenizer)
    items = [ScoreItem(x, score_from=s) for x, s in zip(ids, (1, 20, 100), strict=True)]
    results = Scorer(llm.engine).score(items)
    for x, s, r in zip(ids, (1, 20, 100), results, strict=True):
        expected = hf_logprobs(tiny_reference, x)[s - 1 :]
        assert r.num_tokens == len(x) - s
        torch.testing.assert_close(r.token_logprobs, expected, atol=2e-5, rtol=1e-5)
        assert r.kv_fraction == pytest.approx(1.0)
        assert r.kv["evicted_blocks"] == 0
    assert llm.engine.pool.num_used == 0


def test_forced_chunks_longer_than_a_step_are_scored_whole(tiny, tiny_reference):
    """A forced chunk (``compact_interval``) longer than ``max_num_batched_tokens`` is computed in one step: split,
    the rows of all but its last piece were lost (47 of 431 tokens scored)."""
    llm = LLM("tiny-random", "full", loaded=tiny, compact_interval=50, max_num_batched_tokens=48)
    x = texts(llm.tokenizer)[1]
    (r,) = llm.score([x], score_from=1)
    assert r.num_tokens == len(x) - 1
    torch.testing.assert_close(r.token_logprobs, hf_logprobs(tiny_reference, x), atol=2e-5, rtol=1e-5)


def test_full_kl_to_own_reference_is_zero(tiny):
    llm = LLM("tiny-random", "full", loaded=tiny, compact_interval=16)
    ids = texts(llm.tokenizer)
    refs = Scorer(llm.engine).score([ScoreItem(x, 5) for x in ids], keep_topk=32)
    again = Scorer(llm.engine).score([ScoreItem(x, 5, r.topk) for x, r in zip(ids, refs, strict=True)])
    for r in again:
        assert r.kl is not None and float(r.kl.abs().max()) < 1e-5


@pytest.mark.parametrize("scorer", ["snapkv", "h2o", "tova", "decayed"])
def test_evicting_policy_scores_within_budget_and_diverges(tiny, scorer):
    """Every way of recording attention in teacher-forced chunks of output (window, accumulated, replaced, decayed)."""
    ref_llm = LLM("tiny-random", "full", loaded=fresh_tiny(), compact_interval=16)
    x = texts(ref_llm.tokenizer)[2]
    (ref,) = Scorer(ref_llm.engine).score([ScoreItem(x, 40)], keep_topk=32)
    llm = LLM(
        "tiny-random", "dynamic", loaded=tiny, base_size=64, max_size=160, min_recent=32, compact_interval=16,
        entropy_threshold=5.0, scorer=scorer,
    )  # fmt: skip
    (r,) = Scorer(llm.engine).score([ScoreItem(x, 40, ref.topk)])
    assert r.num_tokens == len(x) - 40
    assert int(r.resident.max()) <= 160 + 16 + 16  # max_size + a chunk's own tokens + a block
    assert r.kv_fraction < 0.6
    assert r.kv["evicted_blocks"] > 0
    assert r.kl is not None and float(r.kl.mean()) > 1e-4
    assert r.budget.min() >= 64 and r.budget.max() <= 160


def test_kl_from_topk_matches_exact_kl_when_k_is_the_vocab():
    p = torch.log_softmax(torch.randn(5, 40), -1)
    q = torch.log_softmax(torch.randn(5, 40), -1)
    top = p.topk(40)
    exact = (p.exp() * (p - q)).sum(-1)
    torch.testing.assert_close(kl_from_topk(TopK(top.indices, top.values), q), exact, atol=1e-5, rtol=1e-4)
    partial = kl_from_topk(TopK(*reversed(p.topk(8))), q)  # a lower bound from 8 of 40 tokens
    assert torch.all(partial <= exact + 1e-5)


def test_bad_items():
    with pytest.raises(ConfkvError, match="score_from"):
        ScoreItem([1, 2, 3], score_from=3)
    with pytest.raises(ConfkvError, match="two tokens"):
        ScoreItem([1])


def _forced_decode_policy(tiny, **kw):
    """Tiny-random's entropy sits near 4 nats; a threshold at its median makes about half the steps expand."""
    return LLM("tiny-random", "dynamic", loaded=tiny, base_size=32, max_size=128, min_recent=16, sink_tokens=4,
               scaling_factor=0.5, entropy_threshold=4.0358, max_num_batched_tokens=64, kv_cache_memory="8MiB",
               **kw)  # fmt: skip


@pytest.mark.parametrize("recompute", ["last", "stale"])
def test_scoring_in_chunks_of_one_token_is_decoding_with_the_text_forced(tiny, recompute):
    """A recall set off by a scored row is applied to that row, computed again, as decode applies it to its token:
    scored one token at a time, the model's own greedy text gets exactly decode's log-probabilities, resident keys
    and recomputations (before, the recall waited for the next chunk: 0 reruns and log-probabilities 5 nats apart).
    Under ``recompute: stale`` the second pass covers several rows, and only its last one is scored."""
    llm = _forced_decode_policy(tiny, compact_interval=1, recompute=recompute)
    prompt = "Budgets move with confidence; the cache follows the budget. " * 4
    out = llm.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True, logprobs=0))[0]
    assert llm.engine.num_reruns >= 5 and out.kv["recalled_blocks"] > 0
    assert (llm.engine.rerun_tokens > llm.engine.num_reruns) == (recompute == "stale")
    scoring = _forced_decode_policy(tiny, compact_interval=1, recompute=recompute)
    (r,) = Scorer(scoring.engine).score([ScoreItem(out.prompt_token_ids + out.token_ids, len(out.prompt_token_ids))])
    assert scoring.engine.num_reruns == llm.engine.num_reruns
    assert scoring.engine.rerun_tokens == llm.engine.rerun_tokens
    assert r.resident.tolist() == out.trace.resident
    assert r.token_logprobs.tolist() == [t.logprob for t in out.logprobs]
    assert scoring.engine.pool.num_used == 0


def test_a_session_step_reports_each_one_token_chunk_after_its_second_pass_and_longer_chunks_are_not_recomputed(tiny):
    """A session step reports one scored row per item even when the row is computed twice (an RL step observes
    whole segments); in chunks of several tokens a recall takes effect from the next chunk, nothing is recomputed."""
    ids = _forced_decode_policy(tiny).tokenizer("Budgets move with confidence; the cache follows the budget. " * 6)
    ids, score_from = ids["input_ids"], 200
    for chunk in (1, 4):
        llm = _forced_decode_policy(tiny, compact_interval=chunk)
        with Scorer(llm.engine).session() as session:
            index = session.add(ScoreItem(ids, score_from))
            sizes = []
            while not session.finished:
                sizes.extend(len(st.last["entropy"]) for st in session.step())
            r = session.result(index)
        assert r.num_tokens == len(ids) - score_from == sum(sizes) and set(sizes[1:-1]) == {chunk}
        assert r.kv["recalled_blocks"] > 0
        assert (llm.engine.num_reruns > 0) == (chunk == 1)


@pytest.mark.timeout(60)
def test_an_item_whose_forward_pass_fails_is_an_error_not_a_wait(tiny, monkeypatch):
    """The engine finishes a request whose pass raises with an error and keeps the others; scoring must say so
    instead of waiting for rows that never come (it looped forever), and free what the other items held."""
    llm = LLM("tiny-random", "full", loaded=tiny, compact_interval=16)
    good, bad = texts(llm.tokenizer)[2:0:-1]  # the longer one first: it is still running when the other fails
    run = llm.engine.runner.run

    def failing(chunks, **kw):
        if any(ch.seq.request_id.endswith("-1") and ch.seq.num_computed > 40 for ch in chunks):  # item 1, midway
            raise RuntimeError("injected fault")
        return run(chunks, **kw)

    monkeypatch.setattr(llm.engine.runner, "run", failing)
    with pytest.raises(ConfkvError, match=r"scoring item 1 .*failed: forward pass failed: injected fault"):
        Scorer(llm.engine).score([ScoreItem(good, 5), ScoreItem(bad, 5)])
    assert llm.engine.pool.num_used == 0
    monkeypatch.undo()
    (r,) = Scorer(llm.engine).score([ScoreItem(good, 5)])  # the engine still scores
    assert r.num_tokens == len(good) - 5
