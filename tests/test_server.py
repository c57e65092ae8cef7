"""The OpenAI-compatible server, end to end: one real ``confkv serve`` process on tiny-random for the module,
driven with the official ``openai`` client (and the standard library where raw HTTP is the point)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from confkv.model_loader import tiny_random_tokenizer
from confkv.server.detok import IncrementalDetokenizer
from tests.server_proc import ServerProcess

MODEL = "tiny-random"
MAX_PROMPT = 2000
MAX_TOKENS_LIMIT = 1000
BODY_LIMIT = 65536
#: 128 blocks of 16 tokens: the 32 concurrent requests do not all fit at once, so some wait (none may fail)
POOL = "512KiB"

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
    proc = ServerProcess(
        "--model", MODEL, "--kv-cache-memory", POOL, "--max-batch-size", "32",
        "--max-prompt-tokens", str(MAX_PROMPT), "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
        "--max-body-bytes", str(BODY_LIMIT),
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def metrics(server) -> dict[str, dict[tuple, float]]:
    """``{family: {labels: value}}`` of the server's /metrics (parsed by prometheus_client's own parser)."""
    status, text = server.request("GET", "/metrics")
    assert status == 200
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(fam.name, {})[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def value(m: dict, family: str, sample: str | None = None, **labels: str) -> float:
    key = (sample or family, *sorted(labels.items()))
    return m[family][key]


def chat(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": f"Question number {i}: what comes next?"},
        {"role": "assistant", "content": "Let me think."},
        {"role": "user", "content": f"Go on ({i})."},
    ]


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


def _chat_body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


BAD_REQUESTS = [
    ("malformed json", "/v1/chat/completions", b'{"model": "tiny-random", "messages": [', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("wrong type", "/v1/chat/completions", _chat_body(max_tokens="5"), 400, "max_tokens"),
    ("bool as string", "/v1/chat/completions", _chat_body(stream="yes"), 400, "stream"),
    ("out of range", "/v1/chat/completions", _chat_body(temperature=5), 400, "temperature"),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("n > 1", "/v1/chat/completions", _chat_body(n=2), 400, "n"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", _chat_body(messages=[]), 400, "messages"),
    ("bad role", "/v1/chat/completions", _chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, None),
    ("unknown model", "/v1/chat/completions", _chat_body(model="gpt-9"), 404, "model"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": "x" * (MAX_PROMPT + 10)}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": "   "}, 400, "prompt"),
    ("prompt batch", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    ("max_tokens over limit", "/v1/chat/completions", _chat_body(max_tokens=MAX_TOKENS_LIMIT + 1), 400, "max_tokens"),
    ("bad policy override", "/v1/chat/completions", _chat_body(cache_policy={"max_size": -1}), 400, "cache_policy"),
    ("unknown policy key", "/v1/chat/completions", _chat_body(cache_policy={"bogus": 1}), 400, "cache_policy"),
    ("top_logprobs too many", "/v1/chat/completions", _chat_body(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top_logprobs alone", "/v1/chat/completions", _chat_body(top_logprobs=2), 400, "top_logprobs"),
    ("tools", "/v1/chat/completions", _chat_body(tools=[{"type": "function"}]), 400, "tools"),
    ("penalty", "/v1/chat/completions", _chat_body(presence_penalty=1.0), 400, "presence_penalty"),
    ("too many stops", "/v1/chat/completions", _chat_body(stop=[str(i) for i in range(20)]), 400, "stop"),
    ("body too large", "/v1/completions", {"model": MODEL, "prompt": "x" * (BODY_LIMIT + 1)}, 413, None),
    # cache_policy values are as strict as the other fields (CachePolicy itself, for YAML and key=value, is lax)
    ("policy int as string", "/v1/chat/completions", _chat_body(cache_policy={"max_size": "2048"}), 400,
     "cache_policy"),
    ("policy float as string", "/v1/completions",
     {"model": MODEL, "prompt": "x", "max_tokens": 2, "cache_policy": {"scaling_factor": "0.5"}}, 400, "cache_policy"),
    ("policy bool as string", "/v1/chat/completions", _chat_body(cache_policy={"reselect_after_prompt": "yes"}), 400,
     "cache_policy"),
    ("policy bool as int", "/v1/chat/completions", _chat_body(cache_policy={"reselect_after_prompt": 1}), 400,
     "cache_policy"),
    ("policy int as bool", "/v1/chat/completions", _chat_body(cache_policy={"max_size": True}), 400, "cache_policy"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "path", "body", "status", "param"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_style_4xx_and_the_server_keeps_serving(
    server, client, what, path, body, status, param
):
    raw = body if isinstance(body, bytes) else None
    code, doc = server.request("POST", path, None if raw else body, raw=raw)
    assert code == status, (what, doc)
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    ok = client.chat.completions.create(model=MODEL, messages=chat(0), max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_bad_requests_are_counted(server):
    before = value(metrics(server), "confkv:request_errors", "confkv:request_errors_total", kind="bad_request")
    server.request("POST", "/v1/chat/completions", _chat_body(n=3))
    after = value(metrics(server), "confkv:request_errors", "confkv:request_errors_total", kind="bad_request")
    assert after == before + 1


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


def request_errors(server, kind: str) -> float:
    return value(metrics(server), "confkv:request_errors", "confkv:request_errors_total", kind=kind)


def post_chunked(server, path: str, data: bytes, method: str = "POST") -> tuple[int, dict]:
    """Send ``data`` with ``Transfer-Encoding: chunked`` (no Content-Length), in 4 KiB chunks."""
    conn = server.connection()
    try:
        chunks = iter([data[i : i + 4096] for i in range(0, len(data), 4096)])
        conn.request(method, path, body=chunks, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_a_chunked_body_over_the_limit_is_a_413(server, client):
    """With no Content-Length the limit is found while the body is read: the same 413 as by Content-Length."""
    big = json.dumps({"model": MODEL, "prompt": "x" * (BODY_LIMIT + 1), "max_tokens": 2}).encode()
    too_large0, bad0 = request_errors(server, "too_large"), request_errors(server, "bad_request")
    for path, method in (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/cache_policy", "PUT")):
        status, doc = post_chunked(server, path, big, method)
        assert status == 413, (path, doc)
        assert doc["error"]["code"] == "request_too_large" and str(BODY_LIMIT) in doc["error"]["message"]
    assert server.request("POST", "/v1/completions", raw=big)[1]["error"]["code"] == "request_too_large"
    assert request_errors(server, "too_large") == too_large0 + 4  # each counted once, as too_large alone
    assert request_errors(server, "bad_request") == bad0
    small = json.dumps({"model": MODEL, "prompt": "chunked", "max_tokens": 2}).encode()
    status, doc = post_chunked(server, "/v1/completions", small)  # under the limit, chunked is fine
    assert status == 200 and doc["usage"]["completion_tokens"] >= 1
    assert client.chat.completions.create(model=MODEL, messages=chat(0), max_tokens=2).choices


def test_a_wrong_method_is_a_405_counted_as_a_client_error(server):
    internal0, bad0 = request_errors(server, "internal"), request_errors(server, "bad_request")
    for method, path in (("GET", "/v1/completions"), ("PATCH", "/v1/chat/completions"), ("DELETE", "/health")):
        status, doc = server.request(method, path)
        assert status == 405, (method, path, doc)
        assert set(doc["error"]) == {"message", "type", "param", "code"}
        assert doc["error"]["type"] == "invalid_request_error"
    conn = server.connection()
    try:
        conn.request("GET", "/v1/completions")
        resp = conn.getresponse()
        assert resp.status == 405 and resp.getheader("allow") == "POST"
        resp.read()
    finally:
        conn.close()
    assert request_errors(server, "internal") == internal0
    assert request_errors(server, "bad_request") == bad0 + 4


def test_completions_default_max_tokens_is_clamped_to_the_limit(client):
    """OpenAI's default of 16 for completions, within --max-tokens-limit: a value the client never sent is no 400."""
    out = client.completions.create(model=MODEL, prompt="default", temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16  # the limit here is larger
    with ServerProcess("--model", MODEL, "--kv-cache-memory", "1MiB", "--max-tokens-limit", "5") as small:
        for body in ({}, {"max_tokens": None}):
            status, doc = small.request(
                "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "ignore_eos": True, **body}
            )
            assert status == 200, doc
            assert doc["usage"]["completion_tokens"] == 5
        status, doc = small.request("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 6})
        assert status == 400 and doc["error"]["param"] == "max_tokens"  # a value the client did send still is
        assert "max_tokens is 6; this server allows at most 5" in doc["error"]["message"]


def test_null_means_the_default_as_openai_reads_it(server):
    """The ``openai`` client sends ``null`` for any argument given as ``None``; ``n``, ``stream``, ``logprobs``,
    ``echo`` and ``ignore_eos`` then take their defaults (they were a 400)."""
    nulls = {"n": None, "stream": None, "ignore_eos": None}
    status, doc = server.request("POST", "/v1/chat/completions", _chat_body(logprobs=None, **nulls))
    assert status == 200 and doc["choices"][0].get("logprobs") is None, doc
    status, doc = server.request("POST", "/v1/completions",
                                 {"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": None, **nulls})  # fmt: skip
    assert status == 200 and not doc["choices"][0]["text"].startswith("hi"), doc


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


def test_put_cache_policy_values_are_strict(server):
    status, start = server.request("GET", "/v1/cache_policy")
    assert status == 200
    swaps0 = value(metrics(server), "confkv:policy_swaps", "confkv:policy_swaps_total")
    for bad, field in (({"max_size": "2048"}, "max_size"),
                       ({"scaling_factor": "0.5"}, "scaling_factor"),
                       ({"reselect_after_prompt": "yes"}, "reselect_after_prompt"),
                       ({"reselect_after_prompt": 1}, "reselect_after_prompt"),
                       ({"max_size": True}, "max_size"),
                       ({"cache_policy": {"min_recent": "8"}}, "min_recent")):  # fmt: skip
        status, err = server.request("PUT", "/v1/cache_policy", bad)
        assert status == 422 and err["error"]["param"] == field, (bad, err)
        assert err["error"]["code"] == "invalid_value" and field in err["error"]["message"]
    assert server.request("GET", "/v1/cache_policy")[1] == start  # nothing changed, nothing swapped
    assert value(metrics(server), "confkv:policy_swaps", "confkv:policy_swaps_total") == swaps0
    # per request, the right JSON types still pass: an int where a float goes, a real bool
    out = server.request(
        "POST", "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 2, "cache_policy": {"scaling_factor": 1, "max_size": 2048}},
    )  # fmt: skip
    assert out[0] == 200, out


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_says_so(server, content_type):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    conn = server.connection()
    try:
        headers = {"Content-Type": content_type} if content_type else {}  # none: http.client sends none
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        resp = conn.getresponse()
        status, doc = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 400, doc
    assert "Content-Type: application/json" in doc["error"]["message"], doc
    assert (content_type or "no Content-Type") in doc["error"]["message"]
    assert doc["error"]["code"] == "invalid_content_type"
    status, doc = server.request("POST", "/v1/chat/completions", raw=b"[1, 2]")  # JSON, but not an object
    assert status == 400 and doc["error"]["message"] == "the request body must be a JSON object"
    before = server.request("GET", "/v1/cache_policy")[1]
    status, doc = server.request("PUT", "/v1/cache_policy", {"max_size": 64}, headers={"Content-Type": "text/plain"})
    assert status == 400 and doc["error"]["code"] == "invalid_content_type", doc
    assert server.request("GET", "/v1/cache_policy")[1] == before


LONE_SURROGATES = [
    ("/v1/completions", b'{"model": "tiny-random", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"model": "tiny-random", "prompt": ["a\\udfffb"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions",
     b'{"model": "tiny-random", "messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}', "messages"),
    ("/v1/chat/completions",
     b'{"model": "tiny-random", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages"),
    ("/v1/completions", b'{"model": "tiny-random", "prompt": "hi", "max_tokens": 2, "stop": ["\\ud800"]}', "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw", "param"), LONE_SURROGATES)
def test_a_prompt_with_a_lone_surrogate_is_not_valid_unicode_text(server, client, path, raw, param):
    status, doc = server.request("POST", path, raw=raw)
    assert status == 400, doc
    err = doc["error"]
    assert err["param"] == param and "not valid Unicode text" in err["message"], err
    assert "TextEncodeInput" not in err["message"]
    # a surrogate pair (one character, escaped as JSON does) is valid text
    good = raw.replace(b"\\ud800", b"\\ud83d\\ude00").replace(b"\\udfff", b"\\ud83d\\ude00")
    assert server.request("POST", path, raw=good)[0] == 200
