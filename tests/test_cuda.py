"""The engine on a CUDA device: what runs only there (the pool in device memory and sized from its free memory, the
host tier in pinned memory, NVML metrics) and the exactness of ``full`` against Hugging Face on the same device.

Skipped without CUDA (CI has none). ``CONFKV_TEST_DEVICE`` names another device to run the same checks on (``cpu``
checks the tests themselves on a machine without a GPU; the cross-device comparisons then compare the CPU with
itself). On a GPU: ``CONFKV_TEST_DEVICE=cuda .venv/bin/python -m pytest tests/test_cuda.py``; the tests marked
``slow`` also load smollm2-135m.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import MistralConfig, Qwen2Config

from confkv import LLM, CachePolicy, SamplingParams
from confkv.config import EngineConfig
from confkv.engine.engine import LLMEngine, available_memory
from confkv.model_loader import LoadedModel, load_model, tiny_random_tokenizer

from .conftest import hf_greedy, hf_logprobs
from .test_architectures import COMMON, TEXT, _folder, _hf
from .test_engine import PROMPTS
from .test_sessions import TURNS

DEVICE = torch.device(os.environ.get("CONFKV_TEST_DEVICE", "cuda"))
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device (CONFKV_TEST_DEVICE)"
)


def tiny_on(device: torch.device, dtype: str = "float32") -> LoadedModel:
    return load_model("tiny-random", device=device, dtype=dtype)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_full_equals_hf_generate_on_the_device():
    """Continuous batching, prompts read in several chunks, the pool on the device: token for token in fp32."""
    llm = LLM("tiny-random", "full", loaded=tiny_on(DEVICE), max_batch_size=2, max_num_batched_tokens=96,
              kv_cache_memory="8MiB")  # fmt: skip
    assert llm.engine.device.type == DEVICE.type and llm.engine.pool.k.device.type == DEVICE.type
    reference = tiny_on(DEVICE)
    lengths = (30, 12, 25, 40, 18)
    outs = llm.generate(PROMPTS, [greedy(n) for n in lengths])
    for out, n in zip(outs, lengths, strict=True):
        assert out.token_ids == hf_greedy(reference, out.prompt_token_ids, n)
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 0.15)])
def test_full_scoring_matches_hf_forward_on_the_device(dtype, atol):
    """Teacher-forced log-probabilities against Hugging Face's forward pass in the same dtype on the same device
    (random weights hide attention bugs from greedy tokens). bf16 rounds differently in the two attention paths:
    its tolerance is loose, and the mean error must stay well under it."""
    llm = LLM("tiny-random", "full", loaded=tiny_on(DEVICE, dtype), max_num_batched_tokens=64)
    reference = tiny_on(DEVICE, dtype)
    ids = list(llm.tokenizer(PROMPTS[2])["input_ids"])
    (scored,) = llm.score([ids], score_from=1)
    expected = hf_logprobs(reference, ids)
    diff = (scored.token_logprobs.float().cpu() - expected).abs()
    assert float(diff.max()) < atol and float(diff.mean()) < atol / 5


POLICIES = {
    "window": dict(max_size=96),
    "streaming": dict(max_size=96, sink_tokens=4),
    "h2o": dict(max_size=96),
    "snapkv": dict(max_size=96),
    # confidence never crosses a zero threshold the wrong way: the budget expands, and evicted blocks come back
    # from the host tier (pinned memory on CUDA)
    "dynamic": dict(
        base_size=48, max_size=128, min_recent=32, compact_interval=8, entropy_threshold=0.0, gap_threshold=0.0
    ),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_on_the_device_gives_its_cpu_output(policy):
    """The same greedy tokens and the same cache decisions (evictions, recalls) as on the CPU, in fp32."""
    runs = {}
    for device in (CPU, DEVICE):
        llm = LLM("tiny-random", policy, loaded=tiny_on(device), max_num_batched_tokens=64, kv_cache_memory="8MiB",
                  **POLICIES[policy])  # fmt: skip
        outs = llm.generate(PROMPTS[1:3] + PROMPTS[4:], greedy(60))
        runs[device.type] = [(o.token_ids, o.kv["evicted_blocks"], o.kv["recalled_blocks"]) for o in outs]
        assert llm.engine.pool.num_used == 0
        if device == DEVICE and policy == "dynamic":
            assert llm.engine.host.pin_memory == (DEVICE.type == "cuda")
            assert sum(o.kv["recalled_blocks"] for o in outs) > 0
    assert runs[DEVICE.type] == runs["cpu"]
    assert sum(evicted for _, evicted, _ in runs["cpu"]) > 0


def test_session_kept_on_the_host_tier_continues_as_recomputation():
    """A chat whose KV goes to host memory (pinned) between turns and comes back gives full recomputation's text."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def chat(llm: LLM, session: str | None) -> list[list[int]]:
        messages, tokens = [], []
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            (out,) = llm.chat([messages], params, session_id=session)
            messages.append({"role": "assistant", "content": out.text})
            tokens.append(out.token_ids)
            if session is not None:
                llm.engine.sessions.reclaim(10**6)  # the device copy goes to the host tier
        return tokens

    reference = chat(LLM("tiny-random", "full", loaded=tiny_on(DEVICE)), None)
    llm = LLM("tiny-random", "full", loaded=tiny_on(DEVICE))
    assert chat(llm, "chat") == reference
    stats = llm.engine.stats()
    assert stats["session_hits"]["host"] == 2 and stats["sessions"]["host"] == 1 and llm.engine.pool.num_used == 0


def test_pool_is_sized_from_the_devices_free_memory():
    """No ``kv_cache_memory``: the pool takes ``kv_cache_fraction`` of the device's free memory (CUDA's, not the
    host's); with it, exactly what was asked for."""
    loaded = tiny_on(DEVICE)
    free = available_memory(DEVICE)
    engine = LLMEngine(EngineConfig(model="tiny-random", kv_cache_fraction=0.01), CachePolicy(controller="full"),
                       loaded=loaded)  # fmt: skip
    pool = engine.pool
    assert pool.k.device.type == DEVICE.type
    assert 0.005 * free < pool.num_blocks * pool.bytes_per_block <= 0.01 * free
    sized = LLM("tiny-random", "full", loaded=loaded, kv_cache_memory="4MiB").engine.pool
    assert sized.num_blocks == (4 << 20) // pool.bytes_per_block


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(Qwen2Config(**COMMON), id="qwen2"),
        pytest.param(MistralConfig(**COMMON, sliding_window=32), id="mistral-sliding-32"),
    ],
)
def test_other_families_match_hugging_face_on_the_device(tmp_path, config):
    folder = _folder(tmp_path, config)
    hf = _hf(folder).to(DEVICE)
    ids = list(tiny_random_tokenizer()(TEXT)["input_ids"])
    llm = LLM(folder, "full", device=str(DEVICE), dtype="float32", max_num_batched_tokens=64)
    out = llm.generate(ids, greedy(24))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()  # fmt: skip
    assert out.token_ids == ref
    (scored,) = llm.score([ids], score_from=1)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids], device=DEVICE)).logits[0, :-1].float(), dim=-1).cpu()
    ref_lp = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(scored.token_logprobs.cpu(), ref_lp, atol=1e-4)


def test_nvml_reports_the_devices_memory():
    if DEVICE.type != "cuda":
        pytest.skip("NVML reads CUDA devices only")
    pytest.importorskip("pynvml")
    from confkv.server.metrics import make_nvml_collector

    collector = make_nvml_collector(DEVICE)
    assert collector is not None
    values = {fam.name: fam.samples[0].value for fam in collector.collect()}
    assert 0 < values["confkv:device_memory_used_bytes"] < values["confkv:device_memory_total_bytes"]
    assert 0.0 <= values["confkv:device_utilization_perc"] <= 1.0


CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "List three uses of a paperclip, briefly."]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_full_equals_hf_generate_on_the_device(dtype):
    """The default model: ``full``'s greedy text is Hugging Face ``generate``'s on the same device and dtype. In
    bf16 the two paths round differently, so there only the teacher-forced log-probabilities are compared."""
    loaded = load_model("smollm2-135m", device=DEVICE, dtype=dtype)
    reference = load_model("smollm2-135m", device=DEVICE, dtype=dtype)
    llm = LLM("smollm2-135m", "full", loaded=loaded, max_batch_size=2, max_num_batched_tokens=48)
    outs = llm.chat(CHAT, greedy(40))
    if dtype == "float32":
        for out in outs:
            assert out.token_ids == hf_greedy(reference, out.prompt_token_ids, 40)
    for out in outs:
        ids = out.prompt_token_ids + out.token_ids
        (scored,) = llm.score([ids], score_from=len(out.prompt_token_ids))
        expected = hf_logprobs(reference, ids)[len(out.prompt_token_ids) - 1 :]
        diff = (scored.token_logprobs.float().cpu() - expected).abs()
        assert float(diff.max()) < (1e-3 if dtype == "float32" else 0.5)
