"""The server's operational side, on one ``confkv serve`` process with an API key and a watched policy file:
authentication, policy hot reload (and refusal of a broken file), and SIGTERM draining (the module's last test
ends the process)."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_proc import ServerProcess

MODEL = "tiny-random"
KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRACE_S = 2.5


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("policy") / "policy.yaml"
    f.write_text("cache_policy:\n  controller: dynamic\n  base_size: 64\n  max_size: 256\n  min_recent: 32\n")
    return f


@pytest.fixture(scope="module")
def server(policy_file):
    proc = ServerProcess(
        "--model", MODEL, "--kv-cache-memory", "16MiB", "--policy-file", str(policy_file), "--api-key", KEY,
        "--policy-poll-interval", "0.1", "--shutdown-grace", str(GRACE_S), "--served-model-name", "tiny",
    )  # fmt: skip
    yield proc
    proc.stop()


def counter(server, family: str) -> float:
    _, text = server.request("GET", "/metrics")
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            return sum(s.value for s in fam.samples if s.name == family + "_total" or s.name == family)
    raise KeyError(family)


def policy(server) -> dict:
    status, doc = server.request("GET", "/v1/cache_policy", headers=AUTH)
    assert status == 200
    return doc


def test_api_key_is_required_on_v1_only(server):
    for path in ("/v1/models", "/v1/cache_policy"):
        status, doc = server.request("GET", path)
        assert status == 401 and doc["error"]["code"] == "invalid_api_key"
        assert server.request("GET", path, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert server.request("GET", path, headers=AUTH)[0] == 200
    assert server.request("GET", "/health")[0] == 200
    assert server.request("GET", "/metrics")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert out.model == "tiny"


def test_the_key_is_checked_before_the_body_is_read(server):
    """Without the key nothing about the body is answered: not its JSON, its depth, its encoding or its size."""
    bodies = [b'{"model": "tiny", "messages": [', b"[" * 5000, b'{"prompt": "\xff"}', b"x" * (5 * 2**20)]
    for path, method in (("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/cache_policy", "PUT")):
        for raw in bodies:
            status, doc = server.request(method, path, raw=raw)
            assert status == 401 and doc["error"]["code"] == "invalid_api_key", (path, raw[:20], doc)
    status, doc = server.request("POST", "/v1/chat/completions", raw=bodies[0], headers=AUTH)
    assert status == 400 and doc["error"]["code"] == "invalid_json", doc


def test_policy_file_is_watched_and_reloaded(server, policy_file):
    start = policy(server)
    assert start["source"] == f"file:{policy_file}" and start["policy"]["max_size"] == 256
    swaps = counter(server, "confkv:policy_swaps")
    policy_file.write_text("cache_policy:\n  controller: window\n  max_size: 96\n")
    deadline = time.monotonic() + 10
    while policy(server)["policy"]["controller"] != "window":
        assert time.monotonic() < deadline, "the changed policy file was not picked up"
        time.sleep(0.05)
    now = policy(server)
    assert now["policy"]["max_size"] == 96 and now["version"] != start["version"]
    assert counter(server, "confkv:policy_swaps") == swaps + 1


def test_a_broken_policy_file_is_refused_and_counted(server, policy_file):
    before = policy(server)
    refused = counter(server, "confkv:policy_swaps_refused")
    for text in ("cache_policy: [unclosed\n", "cache_policy:\n  controller: window\n  max_size: -3\n"):
        policy_file.write_text(text)
        deadline = time.monotonic() + 10
        while counter(server, "confkv:policy_swaps_refused") == refused:
            assert time.monotonic() < deadline, "the broken policy file was not refused"
            time.sleep(0.05)
        refused += 1
        assert policy(server) == before
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="still serving", max_tokens=3).usage.completion_tokens


def _stream(server, max_tokens: int, out: dict) -> None:
    conn = server.connection(timeout=120)
    body = {"model": "tiny", "prompt": f"drain {max_tokens}", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={**AUTH, "Content-Type": "application/json"})
    resp = conn.getresponse()
    out["status"] = resp.status
    events = []
    for line in resp:
        if line.startswith(b"data: "):
            events.append(line[6:].strip())
            out["started"] = True
    conn.close()
    out["done"] = events[-1:] == [b"[DONE]"]
    chunks = [json.loads(e) for e in events[:-1]]
    out["finish"] = [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and "finish_reason" in c["choices"][0]
    ]
    out["usage"] = chunks[-1].get("usage")


def test_sigterm_drains_running_requests_aborts_the_rest_and_exits_0(server):
    """Last in the module: it ends the server."""
    short, long = {}, {}
    threads = [threading.Thread(target=_stream, args=(server, n, o)) for n, o in ((40, short), (4000, long))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not (short.get("started") and long.get("started")):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    server.terminate()
    time.sleep(0.3)
    status, doc = server.request("GET", "/health")
    assert (status, doc["status"]) == (503, "draining")
    status, doc = server.request("POST", "/v1/completions", {"model": "tiny", "prompt": "late"}, headers=AUTH)
    assert status == 503 and doc["error"]["code"] == "server_shutting_down"
    assert server.wait(GRACE_S + 20) == 0, server.log
    assert time.monotonic() - t0 < GRACE_S + 10
    for t in threads:
        t.join(10)
    assert short["done"] and short["finish"] == ["length"] and short["usage"]["completion_tokens"] == 40
    assert long["done"] and long["finish"] == ["abort"] and long["usage"]["completion_tokens"] < 4000
