"""The OpenAI-compatible server, end to end: one real ``confkv serve`` process on tiny-random for the module,
driven with the official ``openai`` client (and the standard library where raw HTTP is the point). How bad requests
are refused is in ``test_server_requests``."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest

from confkv.model_loader import tiny_random_tokenizer
from confkv.server.detok import IncrementalDetokenizer
from tests.server_api import MAX_TOKENS_LIMIT, MODEL, api_server, chat, metrics, value
from tests.server_proc import ServerProcess

#: Every metric the issue names (family names: the parser drops counters' ``_total``).
REQUIRED_METRICS = {
    "confkv:num_requests_running",
    "confkv:num_requests_waiting",
    "confkv:kv_cache_usage_perc",
    "confkv:host_cache_used_bytes",
    "confkv:kv_cache_tokens",
    "confkv:kv_cache_bytes_per_token",
    "confkv:recall_hits",
    "confkv:recall_queries",
    "confkv:evicted_blocks",
    "confkv:budget_expansions",
    "confkv:budget_contractions",
    "confkv:token_entropy_nats",
    "confkv:token_top1_gap",
    "confkv:resident_kv_tokens",
    "confkv:num_preemptions",
    "confkv:time_to_first_token_seconds",
    "confkv:inter_token_latency_seconds",
    "confkv:e2e_request_latency_seconds",
    "confkv:prompt_tokens",
    "confkv:generation_tokens",
    "confkv:request_success",
    "confkv:request_errors",
    "confkv:breaker_trips",
    "confkv:policy_info",
    "confkv:policy_swaps",
    "confkv:policy_swaps_refused",
}


@pytest.fixture(scope="module")
def server():
    proc = api_server()
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


# -------------------------------------------------------------------------------------------- unit: detokenizer
def test_incremental_detokenizer_matches_full_decode_and_holds_back_stop_prefixes():
    tok = tiny_random_tokenizer()
    text = "héllo wörld → ✓ done, the END is near"
    ids = tok(text)["input_ids"]
    d = IncrementalDetokenizer(tok)
    out = "".join(d.add([t]) for t in ids)
    assert out == tok.decode(ids, skip_special_tokens=True) == text
    d = IncrementalDetokenizer(tok, stop=["END"])
    parts = [d.add([t]) for t in ids]
    sent = "".join(parts)
    assert "E" not in sent.split("the ")[-1]  # "E", "EN" were held back, "END" never sent
    assert text.startswith(sent) and "END" not in sent
    assert d.finish(text[: text.index("END")]) == text[len(sent) : text.index("END")]


def test_serve_flags(capsys):
    from confkv.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--max-num-seqs", "8", "--cache-policy", "full", "--port", "9"])
    assert (args.max_batch_size, args.policy, args.port, args.host) == (8, "full", 9, "127.0.0.1")
    assert main(["serve", "--model", MODEL, "--policy", "clever"]) == 2
    assert "unknown policy 'clever'" in capsys.readouterr().err
    assert main(["serve", "--model", MODEL, "--port", "70000"]) == 2
    assert "port" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the routes
def test_health_models_and_completion(server, client):
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(tiny_random_tokenizer()("The capital of France is")["input_ids"])
    assert 1 <= out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert "peak_resident_tokens" in out.model_extra["kv"]


def test_chat_uses_the_template_over_all_turns_and_echoes_session_id(client):
    msgs = chat(1)
    out = client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0, extra_body={"session_id": "s-42"}
    )
    expected = tiny_random_tokenizer().apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert out.usage.prompt_tokens == len(expected)
    assert out.choices[0].message.role == "assistant"
    assert out.model_extra["session_id"] == "s-42"


def test_streamed_text_equals_non_streamed(client, offline):
    for i in range(3):
        whole = client.chat.completions.create(model=MODEL, messages=chat(i), max_tokens=40, temperature=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=chat(i), max_tokens=40, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [whole.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

        prompt = f"Completion prompt {i}:"
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text == offline[i].text


@pytest.fixture(scope="module")
def offline():
    """The same greedy completions from the offline engine in this process: the server adds and drops nothing."""
    from confkv import LLM, SamplingParams

    llm = LLM(model=MODEL, kv_cache_memory="16MiB")
    return llm.generate([f"Completion prompt {i}:" for i in range(3)], SamplingParams(max_tokens=30))


def test_stop_strings_cut_the_text_streamed_or_not(client):
    base = client.completions.create(model=MODEL, prompt="stop test", max_tokens=40, temperature=0)
    text = base.choices[0].text
    stop = next(text[j : j + 2] for j in range(5, len(text) - 2) if text[j : j + 2].isprintable())
    expected = text[: text.index(stop)]
    whole = client.completions.create(model=MODEL, prompt="stop test", max_tokens=40, temperature=0, stop=[stop])
    streamed = client.completions.create(
        model=MODEL, prompt="stop test", max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=chat(3), max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.logprob == pytest.approx(max(x.logprob for x in t.top_logprobs), abs=1e-4)  # greedy: the top one
    comp = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens
    assert all(1 <= len(d) <= 2 for d in lp.top_logprobs)  # a dict: tokens that decode alike collapse


def test_sampling_is_seeded(client):
    kw = {"model": MODEL, "prompt": "seeded", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


def test_32_concurrent_streams_get_what_each_gets_alone(server, client):
    prompts = [chat(100 + i) for i in range(32)]
    alone = [
        client.chat.completions.create(model=MODEL, messages=p, max_tokens=24, temperature=0).choices[0].message.content
        for p in prompts
    ]
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)

    async def one(p: list[dict[str, str]]) -> str:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=p, max_tokens=24, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all() -> list[str]:
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    peak = {"waiting": 0.0, "usage": 0.0}
    done = threading.Event()

    def sample() -> None:  # the pool holds fewer than 32 of these at once: some must wait, none may fail
        while not done.is_set():
            m = metrics(server)
            peak["waiting"] = max(peak["waiting"], value(m, "confkv:num_requests_waiting"))
            peak["usage"] = max(peak["usage"], value(m, "confkv:kv_cache_usage_perc"))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        together = asyncio.run(run_all())
    finally:
        done.set()
        sampler.join()
    assert together == alone
    assert peak["waiting"] > 0 and peak["usage"] > 0.5, peak


def test_metrics_carry_every_named_metric_and_move(server, client):
    before = metrics(server)
    assert before.keys() >= REQUIRED_METRICS, REQUIRED_METRICS - before.keys()
    assert "confkv:device_memory_used_bytes" not in before  # NVML metrics only with a GPU
    client.chat.completions.create(model=MODEL, messages=chat(7), max_tokens=8, temperature=0)
    after = metrics(server)

    def total(m, fam):
        return value(m, fam, fam + "_total")

    assert total(after, "confkv:prompt_tokens") > total(before, "confkv:prompt_tokens")
    assert total(after, "confkv:generation_tokens") >= total(before, "confkv:generation_tokens") + 1
    assert total(after, "confkv:engine_steps") > total(before, "confkv:engine_steps")
    for fam in (
        "confkv:time_to_first_token_seconds",
        "confkv:e2e_request_latency_seconds",
        "confkv:token_entropy_nats",
    ):
        assert value(after, fam, fam + "_count") > value(before, fam, fam + "_count")
    ok = sum(v for k, v in after["confkv:request_success"].items() if k[0].endswith("_total"))
    ok0 = sum(v for k, v in before["confkv:request_success"].items() if k[0].endswith("_total"))
    assert ok == ok0 + 1
    assert value(after, "confkv:num_requests_running") == 0
    info = after["confkv:policy_info"]
    assert list(info.values()) == [1.0]


def test_disconnected_stream_is_aborted_within_a_second(server):
    before = metrics(server)
    conn = server.connection()
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 3:
        if resp.readline().startswith(b"data: "):
            seen += 1
    assert value(metrics(server), "confkv:num_requests_running") == 1
    conn.sock.shutdown(2)
    conn.close()
    t0 = time.monotonic()
    while value(metrics(server), "confkv:num_requests_running") != 0:
        assert time.monotonic() - t0 < 1.0, "the sequence kept running after its client left"
        time.sleep(0.02)
    after = metrics(server)
    fam = "confkv:request_success"
    key = (fam + "_total", ("finished_reason", "abort"))
    assert after[fam][key] == before[fam][key] + 1
    assert value(after, "confkv:kv_cache_used_blocks") == 0


def test_per_request_cache_policy_overrides(client):
    prompt = "z" * 300
    full = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    small = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
        extra_body={"ignore_eos": True, "cache_policy": {"controller": "window", "max_size": 64}},
    )  # fmt: skip
    # resident KV while generating (a window policy may read the whole prompt before trimming it)
    assert full.model_extra["kv"]["mean_resident_tokens"] >= 300
    assert small.model_extra["kv"]["mean_resident_tokens"] <= 64 + 16


def test_put_cache_policy_changes_what_the_next_requests_use(server, client):
    status, start = server.request("GET", "/v1/cache_policy")
    assert status == 200 and start["name"] == start["policy"]["controller"] == "dynamic"
    swaps0 = value(metrics(server), "confkv:policy_swaps", "confkv:policy_swaps_total")
    try:
        status, doc = server.request("PUT", "/v1/cache_policy", {"controller": "window", "max_size": 64})
        assert status == 200 and doc["policy"]["controller"] == "window" and doc["source"] == "api"
        assert server.request("GET", "/v1/cache_policy")[1] == doc
        m = metrics(server)
        assert value(m, "confkv:policy_swaps", "confkv:policy_swaps_total") == swaps0 + 1
        assert [dict(k[1:]) for k in m["confkv:policy_info"]] == [
            {"name": "window", "source": "api", "version": doc["version"]}
        ]
        out = client.completions.create(
            model=MODEL, prompt="q" * 300, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.model_extra["kv"]["mean_resident_tokens"] <= 64 + 16

        for bad, field in (({"controller": "window", "max_size": -5}, "max_size"),
                           ({"controller": "clever"}, "controller"),
                           ({"controller": "dynamic", "base_size": 200, "max_size": 100}, "max_size"),
                           ({"scaling_factor": "fast"}, "scaling_factor"),
                           ({"nonsense_key": 1}, "nonsense_key"),
                           ({"block_size": 32}, "block_size")):  # fmt: skip
            status, err = server.request("PUT", "/v1/cache_policy", bad)
            assert status == 422 and err["error"]["param"] == field, (bad, err)
        assert server.request("GET", "/v1/cache_policy")[1] == doc  # refused values changed nothing
    finally:
        status, _ = server.request("PUT", "/v1/cache_policy", start["policy"])
        assert status == 200


def test_an_ipv6_listening_line_is_a_url(tmp_path):
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with ServerProcess("--model", MODEL, "--kv-cache-memory", "1MiB", "--host", "::1") as proc:
        assert proc.base_url.startswith("http://[::1]:")
        assert proc.request("GET", "/health")[0] == 200
