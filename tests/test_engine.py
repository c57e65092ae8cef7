"""The engine on tiny-random: exactness of ``full``, budget bounds of ``dynamic``, preemption, sampling, stops."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from confkv import LLM, CachePolicy, SamplingParams
from confkv.errors import ConfkvError
from confkv.scoring import ScoreItem, Scorer

from .conftest import fresh_tiny, hf_greedy, hf_logprobs

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "A longer prompt, which is read in several prefill chunks by the engine. " * 6,
    "Short one.",
    "Pack my box with five dozen liquor jugs! " * 10,
]
# tiny-random: 2 layers x 2 KV heads x 16 dims x fp32, K and V, 16 tokens per block
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_full_equals_hf_generate_with_continuous_batching(tiny, tiny_reference):
    llm = LLM("tiny-random", "full", loaded=tiny, max_batch_size=2, max_num_batched_tokens=96, kv_cache_memory="8MiB")
    outs = llm.generate(PROMPTS, [greedy(n) for n in (30, 12, 25, 40, 18)])
    for out, n in zip(outs, (30, 12, 25, 40, 18), strict=True):
        assert out.token_ids == hf_greedy(tiny_reference, out.prompt_token_ids, n)
        assert out.finish_reason == "length"
        assert out.kv["evicted_blocks"] == 0
        assert out.kv["mean_resident_tokens"] == pytest.approx(out.prompt_tokens + (n - 1) / 2)
        assert out.kv["full_tokens"] == out.prompt_tokens + n
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize(("entropy_threshold", "expect_expansion"), [(100.0, False), (0.0, True)])
def test_dynamic_stays_within_bounds(tiny, entropy_threshold, expect_expansion):
    base, max_size, recent, sinks, bs = 48, 128, 32, 4, 16
    llm = LLM(
        "tiny-random",
        "dynamic",
        loaded=tiny,
        max_num_batched_tokens=64,
        base_size=base,
        max_size=max_size,
        min_recent=recent,
        sink_tokens=sinks,
        compact_interval=8,
        entropy_threshold=entropy_threshold,
        gap_threshold=0.0,
        kv_cache_memory="8MiB",
    )
    prompt = "Budgets move with confidence; the cache follows the budget. " * 8  # ~490 tokens
    out = llm.generate(prompt, greedy(120))[0]
    chunk = 64  # the prompt is read in chunks of max_num_batched_tokens and trimmed between them
    assert out.kv["peak_resident_tokens"] <= max_size + chunk + bs
    assert out.kv["peak_device_bytes"] <= ((max_size + chunk) // bs + 2) * BLOCK_BYTES
    assert min(out.trace.resident) >= recent + sinks
    assert max(out.trace.resident[1:]) <= max_size + bs  # after the prompt: never above max_size
    assert out.kv["evicted_blocks"] > 0
    if expect_expansion:
        assert out.kv["expansions"] > 0 and out.kv["recalled_blocks"] > 0
        assert max(out.trace.budget) == pytest.approx(max_size, rel=0.01)
    else:
        assert out.kv["expansions"] == 0 and out.kv["recalled_blocks"] == 0
        assert out.trace.resident[-1] <= base + bs


def test_the_prompts_last_query_reselects_its_blocks_before_the_first_token(tiny):
    """``reselect_after_prompt``: a prompt read chunk by chunk (trimmed to ``max_size`` between chunks) ends with its
    last query choosing what stays among device and host blocks; blocks that come back are seen by the first token,
    whose row is recomputed before it is chosen, and the sequence holds its budget, not ``max_size``, at that token."""
    base, bs = 96, 16
    kw = dict(max_num_batched_tokens=64, base_size=base, max_size=128, min_recent=16, sink_tokens=4, compact_interval=8,
              entropy_threshold=100.0, gap_threshold=0.0, kv_cache_memory="8MiB")  # fmt: skip
    prompt = "Budgets move with confidence; the cache follows the budget. " * 8  # ~490 tokens
    plain = LLM("tiny-random", "dynamic", loaded=tiny, **kw).generate(prompt, greedy(12))[0]
    llm = LLM("tiny-random", "dynamic", loaded=tiny, reselect_after_prompt=True, reselect_share=1.0, **kw)
    out = llm.generate(prompt, greedy(12))[0]
    engine = llm.engine
    assert plain.kv["recalled_blocks"] == 0 and plain.trace.resident[0] > 128  # never expands: nothing comes back
    assert engine.manager.reselections == engine.stats()["reselections"] == 1 and engine.num_reruns == 1
    assert out.kv["recalled_blocks"] > 0 and out.kv["expansions"] == 0
    assert out.trace.resident[0] == base and max(out.trace.resident) <= base + bs
    assert out.token_ids != plain.token_ids  # the first token saw another context
    short = llm.generate("Hi", greedy(4))[0]  # a prompt that fits: nothing to choose, nothing recomputed
    assert engine.manager.reselections == 1 and engine.num_reruns == 1 and short.kv["evicted_blocks"] == 0


def test_a_scored_texts_prompt_reselects_its_blocks_from_the_next_chunk(tiny):
    """Teacher-forced scoring with ``reselect_after_prompt``: the prompt's last query re-picks the blocks (some come
    back from the host tier), nothing is recomputed, so the text's first token is scored as without the key and the
    rest, computed over the re-picked blocks, is not."""
    kw = dict(max_num_batched_tokens=64, base_size=96, max_size=128, min_recent=16, sink_tokens=4, compact_interval=8,
              entropy_threshold=100.0, gap_threshold=0.0, kv_cache_memory="8MiB")  # fmt: skip
    plain_llm = LLM("tiny-random", "dynamic", loaded=tiny, **kw)
    ids = plain_llm.tokenizer("Budgets move with confidence; the cache follows the budget. " * 9)["input_ids"]
    score_from = 480
    (plain,) = Scorer(plain_llm.engine).score([ScoreItem(ids, score_from)])
    llm = LLM("tiny-random", "dynamic", loaded=tiny, reselect_after_prompt=True, reselect_share=1.0, **kw)
    (r,) = Scorer(llm.engine).score([ScoreItem(ids, score_from)])
    engine = llm.engine
    assert engine.manager.reselections == engine.stats()["reselections"] == 1 and engine.num_reruns == 0
    assert plain.kv["recalled_blocks"] == 0 and r.kv["recalled_blocks"] > 0
    assert float(r.token_logprobs[0]) == float(plain.token_logprobs[0])
    assert not torch.equal(r.token_logprobs[1:], plain.token_logprobs[1:])
    assert r.num_tokens == plain.num_tokens == len(ids) - score_from
    assert engine.pool.num_used == 0


def test_dynamic_without_eviction_pressure_equals_full(tiny, tiny_reference):
    """With max_size above the sequence length nothing is evicted, so dynamic must be exact too."""
    llm = LLM("tiny-random", "dynamic", loaded=tiny, base_size=512, max_size=1024, min_recent=128)
    out = llm.generate(PROMPTS[2], greedy(20))[0]
    assert out.token_ids == hf_greedy(tiny_reference, out.prompt_token_ids, 20)


def test_sampling_is_reproducible_by_seed(tiny):
    llm = LLM("tiny-random", "full", loaded=tiny)
    p = lambda seed: SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=seed)  # noqa: E731
    a = llm.generate("Once upon a time", p(1))[0].token_ids
    b = llm.generate("Once upon a time", p(1))[0].token_ids
    c = llm.generate("Once upon a time", p(2))[0].token_ids
    assert a == b and a != c


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_top_token(tiny):
    llm = LLM("tiny-random", "full", loaded=tiny)
    greedy_ids = llm.generate("Once upon a time", greedy(12))[0].token_ids
    for params in (
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=1e-300, seed=3),
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_p=1e-300, seed=3),
    ):
        out = llm.generate("Once upon a time", params)[0]
        assert out.finish_reason == "length" and out.token_ids == greedy_ids


def test_a_context_longer_than_the_models_is_refused_not_clamped(tiny):
    with pytest.raises(ConfkvError, match="more than the model's context"):
        LLM("tiny-random", "full", loaded=tiny, max_model_len=10**8)


def test_stop_strings_and_stop_tokens(tiny):
    llm = LLM("tiny-random", "full", loaded=tiny)
    first = llm.generate("Stop here", greedy(40))[0]
    stop = first.text[10:13]
    assert stop and stop not in first.text[:10]
    cut = llm.generate("Stop here", SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == first.text[:10] and stop not in cut.text
    tok = first.token_ids[5]
    by_id = llm.generate("Stop here", SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[tok]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == tok and len(by_id.token_ids) <= 6


def test_abort_leaves_other_requests_intact(tiny):
    llm = LLM("tiny-random", "full", loaded=tiny)
    expected = llm.generate(PROMPTS[1], greedy(20))[0].token_ids
    engine = llm.engine
    engine.add_request("a", PROMPTS[1], greedy(20))
    engine.add_request("b", PROMPTS[2], greedy(20))
    for _ in range(3):
        engine.step()
    aborted = engine.abort_request("b")
    assert aborted is not None and aborted.finish_reason == "abort"
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.output
    assert done["a"].token_ids == expected
    assert engine.pool.num_used == 0


def test_policy_swap_between_steps(tiny):
    llm = LLM("tiny-random", "full", loaded=tiny)
    engine = llm.engine
    engine.add_request("r", PROMPTS[4] * 2, greedy(60))
    for _ in range(5):
        engine.step()
    engine.set_policy(CachePolicy(controller="window", max_size=64, min_recent=32))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o.output or out
    assert out is not None and len(out.token_ids) == 60
    assert out.trace.resident[-1] <= 64 + 16


@pytest.mark.parametrize(
    ("prompt", "params", "fragment"),
    [
        ("", {}, "prompt is empty"),
        ("   ", {}, "prompt is empty"),
        ("x" * 5000, {}, "context is 4096"),
        ("hello", {"max_tokens": 0}, "max_tokens"),
        ("hello", {"temperature": -1}, "temperature"),
    ],
)
def test_bad_requests_raise_clear_errors(tiny, prompt, params, fragment):
    llm = LLM("tiny-random", "full", loaded=tiny)
    with pytest.raises(ConfkvError, match=fragment):
        llm.generate(prompt, SamplingParams(**params))
    # the engine stays usable
    assert len(llm.generate("fine", greedy(3))[0].token_ids) == 3


def test_request_larger_than_pool_is_refused(tiny):
    llm = LLM("tiny-random", "full", loaded=tiny, kv_cache_memory=4 * BLOCK_BYTES)
    with pytest.raises(ConfkvError, match="KV blocks"):
        llm.generate("y" * 100, greedy(10))


def test_unknown_model_and_policy():
    with pytest.raises(ConfkvError, match="not found"):
        LLM("/nonexistent/model")
    with pytest.raises(ConfkvError, match="unknown policy"):
        LLM("tiny-random", "magic")


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_never_written_pool_memory_cannot_reach_attention(policy):
    """Decode attention reads whole blocks, unfilled tails included: memory never written (which ``torch.empty``
    may hand out as NaN), or left in freed blocks by a request that failed on non-finite values, must not leak into
    any output. The pool is poisoned as a fresh process might find it, then again after a first run has used and
    freed its blocks."""
    # lengths that leave blocks part-filled
    prompts = PROMPTS[:3]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0) for n in (21, 9, 14)]
    clean = LLM("tiny-random", policy, loaded=fresh_tiny(), max_batch_size=3, kv_cache_memory="8MiB")
    expected = [o.token_ids for o in clean.generate(prompts, params)]
    llm = LLM("tiny-random", policy, loaded=fresh_tiny(), max_batch_size=3, kv_cache_memory="8MiB")
    pool = llm.engine.pool
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("nan"))
    for _ in range(2):
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
        assert all(math.isfinite(t.logprob) for o in outs for t in o.logprobs)
        assert pool.num_used == 0
        pool.k.fill_(float("nan"))  # every block freed, as a failed request would leave them
        pool.v.fill_(float("nan"))


def test_allocator_thresholds_are_set_once_on_glibc():
    import platform

    from confkv.engine.allocator import keep_freed_memory

    expected = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is expected
    assert keep_freed_memory() is expected


RERUN = json.loads((Path(__file__).parent / "data" / "rerun_outputs.json").read_text())


@pytest.mark.parametrize("case", sorted(RERUN["cases"]))
def test_a_recall_recomputes_in_the_next_steps_batch_with_the_outputs_of_a_pass_of_its_own(case):
    """After a recall the sequence chooses no token; its last token is computed again as a row of the next step's
    batch. That takes no forward pass of its own (one pass per step), and the outputs equal those recorded when the
    recomputation was a second pass within the step (greedy and seeded sampling, snapkv and h2o ranking)."""
    mode, scorer = case.split("-")
    params = SamplingParams(
        max_tokens=60, ignore_eos=True, **({"temperature": 0.9, "seed": 7} if mode == "seeded" else {})
    )
    llm = LLM("tiny-random", "dynamic", loaded=fresh_tiny(), scorer=scorer, **RERUN["policy"])
    engine = llm.engine
    passes = 0
    run = engine.runner.run

    def counting(*args, **kwargs):
        nonlocal passes
        passes += 1
        return run(*args, **kwargs)

    engine.runner.run = counting
    for i, prompt in enumerate(RERUN["prompts"]):
        engine.add_request(str(i), prompt, params)
    done, steps, silent = {}, 0, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        emitted = {o.request_id for o in outputs if o.new_token_ids}
        for seq in engine.scheduler.running:
            if seq.rerun:  # recalled this step: chose no token
                assert seq.request_id not in emitted
                silent += 1
        done.update((o.request_id, o.output.token_ids) for o in outputs if o.finished)
    expected = RERUN["cases"][case]
    assert passes == steps and silent == expected["reruns"] == engine.num_reruns
    assert [done[str(i)] for i in range(len(RERUN["prompts"]))] == expected["tokens"]


def _peeks_against_full(tiny, tiny_reference, recompute: str) -> tuple[torch.Tensor, int, int]:
    """Greedy decode under a per-token ``dynamic`` rule whose peeks bring the whole context back; returns, at each
    token chosen after such a peek, its log-probability minus the one Hugging Face's forward gives over the same
    text, and the engine's rerun count and recomputed tokens."""
    llm = LLM("tiny-random", "dynamic", loaded=tiny, base_size=32, max_size=256, min_recent=32, sink_tokens=4,
              scaling_factor=0.001, entropy_threshold=4.0358, compact_interval=1, recompute=recompute,
              kv_cache_memory="8MiB")  # fmt: skip
    out = llm.generate("Budgets move with confidence; the cache follows the budget. " * 2,
                       SamplingParams(max_tokens=64, ignore_eos=True, logprobs=0))[0]  # fmt: skip
    n = len(out.prompt_token_ids)
    full = hf_logprobs(tiny_reference, out.prompt_token_ids + out.token_ids)[n - 1 :]
    chosen = torch.tensor([t.logprob for t in out.logprobs])
    tr = out.trace
    peeks = [i for i, e in enumerate(tr.expanded) if e and tr.resident[i] == n + i]
    assert len(peeks) >= 5 and out.kv["evicted_blocks"] > 0
    return (chosen - full)[peeks], llm.engine.num_reruns, llm.engine.rerun_tokens


def test_recomputing_stale_tokens_makes_a_whole_context_peek_exactly_full(tiny, tiny_reference):
    """Tokens generated while the context was trimmed keep keys and values computed without it. A peek that brings
    the whole context back and recomputes only the uncertain token still differs from ``full`` there; recomputing
    every token computed over a trimmed context since the last peek (``recompute: stale``) gives full's distribution
    at every such token."""
    stale, reruns, recomputed = _peeks_against_full(tiny, tiny_reference, "stale")
    torch.testing.assert_close(stale, torch.zeros_like(stale), atol=1e-4, rtol=0)
    assert recomputed > reruns  # more than the uncertain token alone
    last, reruns, recomputed = _peeks_against_full(tiny, tiny_reference, "last")
    assert recomputed == reruns and last.abs().max() > 1e-3


def test_a_second_pass_longer_than_a_step_is_cut_to_fit_it(tiny):
    """A rerun is scheduled whole or not at all: one longer than ``max_num_batched_tokens`` would never run."""
    llm = LLM("tiny-random", "dynamic", loaded=tiny, base_size=32, max_size=256, min_recent=64, sink_tokens=4,
              scaling_factor=0.001, entropy_threshold=4.0358, compact_interval=1, recompute_tokens=64,
              max_num_batched_tokens=16, kv_cache_memory="8MiB")  # fmt: skip
    out = llm.generate("Budgets move with confidence; the cache follows the budget. " * 2,
                       SamplingParams(max_tokens=32, ignore_eos=True))[0]  # fmt: skip
    assert len(out.token_ids) == 32 and llm.engine.num_reruns > 0
    assert llm.engine.rerun_tokens <= 16 * llm.engine.num_reruns


def test_a_second_pass_as_long_as_a_step_does_not_wait_for_the_others(tiny):
    """A rerun is scheduled before the other running sequences' tokens: one that takes a whole step's tokens would
    otherwise wait until every sequence admitted before it had finished."""
    llm = LLM("tiny-random", "dynamic", loaded=tiny, base_size=32, max_size=256, min_recent=64, sink_tokens=4,
              scaling_factor=0.001, entropy_threshold=4.0358, compact_interval=1, recompute_tokens=64,
              max_num_batched_tokens=16, kv_cache_memory="8MiB")  # fmt: skip
    engine = llm.engine
    engine.add_request("long", "x", SamplingParams(max_tokens=300, ignore_eos=True),
                       policy_overrides={"controller": "full"})  # fmt: skip
    engine.add_request("peeks", "Budgets move with confidence; the cache follows the budget. " * 2,
                       SamplingParams(max_tokens=32, ignore_eos=True))  # fmt: skip
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["peeks", "long"] and engine.num_reruns > 0
