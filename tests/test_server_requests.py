"""Bad requests against a real ``confkv serve`` on tiny-random: each gets an OpenAI-style 4xx with a JSON body,
is counted, and leaves the server serving the next request."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server_api import BODY_LIMIT, MAX_PROMPT, MAX_TOKENS_LIMIT, MODEL, api_server, chat, metrics, value
from tests.server_proc import ServerProcess


@pytest.fixture(scope="module")
def server():
    proc = api_server()
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


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
