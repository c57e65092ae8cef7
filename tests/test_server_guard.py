"""What an attack on the server found (issue 33), each reproduced on a real ``confkv serve`` process on tiny-random:
deep JSON, a non-streamed request whose client left, slow headers and bodies, the HTTP parser's own errors, a
``learned`` policy loaded from any server path, values no operator meant, and the OpenAPI document's statuses."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from confkv.config import CachePolicy
from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import OBS_DIM
from confkv.server.middleware import json_too_deep
from tests.server_proc import ServerProcess

MODEL = "tiny-random"
BODY_LIMIT = 65536
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--model", MODEL, "--kv-cache-memory", "4MiB", "--max-body-bytes", str(BODY_LIMIT))
    yield proc
    assert proc.stop() == 0, proc.log


def metrics(server) -> dict[str, dict[tuple, float]]:
    status, text = server.request("GET", "/metrics")
    assert status == 200
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def gauge(server, name: str) -> float:
    return metrics(server)[name][()]


def request_errors(server, kind: str) -> float:
    return metrics(server)["confkv:request_errors_total"].get((("kind", kind),), 0.0)


def address(server) -> tuple[str, int]:
    host, port = server.url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def raw_request(server, data: bytes, timeout: float = 10.0) -> tuple[int, dict | str, http.client.HTTPResponse]:
    """Send ``data`` as it is on a fresh connection and read one response (parsed as JSON when it is)."""
    with socket.create_connection(address(server), timeout=timeout) as sock:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        body = resp.read()
    try:
        return resp.status, json.loads(body), resp
    except (json.JSONDecodeError, UnicodeDecodeError):
        return resp.status, body.decode("latin-1"), resp


def head(method: str, path: str, *lines: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: test", *lines, "", ""]).encode("latin-1")


def assert_openai_error(doc: object, status: int) -> dict:
    assert isinstance(doc, dict) and set(doc) == {"error"}, doc
    err = doc["error"]
    assert set(err) == ERROR_KEYS and err["message"] and err["type"], err
    assert err["code"] is not None, err  # every error says which kind it is
    if status < 500:
        assert err["type"] != "server_error", err
    return err


# -------------------------------------------------------------------------------- 1. deep JSON, refused early
def nested(shape: str, levels: int) -> bytes:
    if shape == "object":
        return ('{"a":' * levels + "1" + "}" * levels).encode()
    if shape == "array":
        return ("[" * levels + "]" * levels).encode()
    return ("[" * levels).encode()  # never closed: the parser recurses all the same


@pytest.mark.parametrize("levels", [1000, 10_000])
@pytest.mark.parametrize("shape", ["object", "array", "open"])
@pytest.mark.parametrize(("method", "path"), [("PUT", "/v1/cache_policy"), ("POST", "/v1/completions"),
                                              ("POST", "/v1/chat/completions")])  # fmt: skip
def test_deeply_nested_json_is_a_400_before_it_is_parsed(server, method, path, shape, levels):
    internal = request_errors(server, "internal")
    status, doc, _ = raw_request(
        server,
        head(method, path, "Content-Type: application/json", f"Content-Length: {len(nested(shape, levels))}")
        + nested(shape, levels),
    )
    assert status == 400, doc
    err = assert_openai_error(doc, 400)
    assert err["code"] == "invalid_json" and "nested" in err["message"], err
    assert request_errors(server, "internal") == internal
    assert server.request("GET", "/health")[0] == 200


def depth_of(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


TEXT = st.text(alphabet='[]{}"\\ax\u00e9', max_size=8)
JSON = st.recursive(st.none() | st.integers() | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=40)  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True)
@given(JSON, st.integers(0, 6))
def test_the_depth_scan_measures_what_the_parser_would_recurse(value, limit):
    """Strings full of brackets, quotes and backslashes: only the structure counts, exactly."""
    body = json.dumps(value, ensure_ascii=False).encode()
    assert json_too_deep(body, limit) == (depth_of(value) > limit), body


def test_the_depth_scan_counts_unclosed_brackets_and_stops_early():
    assert not json_too_deep(b"[" * 64 + b"]" * 64) and json_too_deep(b"[" * 65 + b"]" * 65)
    assert json_too_deep(b"[" * 65) and json_too_deep(b'{"a":' * 65)
    assert not json_too_deep(b"[]" * 2_000_000)  # wide, not deep: 4 MB of it
    t0 = time.monotonic()
    assert json_too_deep(b"[" * 2_000_000 + b"]" * 2_000_000)
    assert time.monotonic() - t0 < 1.0


def test_brackets_inside_strings_do_not_count_as_nesting(server):
    prompt = "[{" * 300 + '\\"]' + "}]" * 5
    status, doc = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert status == 200, doc
    parts = [{"type": "text", "text": "hi"}]
    ok = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": parts}],
          "cache_policy": {"controller": "window", "max_size": 256},
          "metadata": {"a": {"b": {"c": [[[1]]]}}}}  # fmt: skip
    status, doc = server.request("POST", "/v1/chat/completions", ok)
    assert status == 200, doc


# ------------------------------------------------------------- 2. a non-streamed request whose client leaves
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_non_streamed_request_is_aborted_when_its_client_leaves(server, path):
    aborts = metrics(server)["confkv:request_success_total"][(("finished_reason", "abort"),)]
    body = {"model": MODEL, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    body |= {"messages": [{"role": "user", "content": "go on"}]} if "chat" in path else {"prompt": "go on"}
    data = json.dumps(body).encode()
    sock = socket.create_connection(address(server))
    sock.sendall(head("POST", path, "Content-Type: application/json", f"Content-Length: {len(data)}") + data)
    deadline = time.monotonic() + 10
    while gauge(server, "confkv:num_requests_running") != 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    time.sleep(0.3)
    assert gauge(server, "confkv:kv_cache_used_blocks") > 0
    sock.close()
    t0 = time.monotonic()
    while gauge(server, "confkv:num_requests_running") or gauge(server, "confkv:kv_cache_used_blocks"):
        assert time.monotonic() - t0 < 1.0, "the request kept its blocks after its client left"
        time.sleep(0.02)
    after = metrics(server)["confkv:request_success_total"][(("finished_reason", "abort"),)]
    assert after == aborts + 1


# --------------------------------------------------------------------- 4. the HTTP parser's own errors
HTTP_ERRORS = [
    ("bad chunk size", head("POST", "/v1/completions", "Content-Type: application/json",
                            "Transfer-Encoding: chunked") + b"zz\r\n{}\r\n0\r\n\r\n"),
    ("huge content-length", head("POST", "/v1/completions", "Content-Type: application/json",
                                 "Content-Length: " + "1" + "0" * 30) + b"{}"),
    ("NUL in a header", head("GET", "/v1/models", "X-Bad: a\x00b")),
    ("no request line", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "data"), HTTP_ERRORS, ids=[e[0] for e in HTTP_ERRORS])
def test_the_http_servers_own_errors_are_openai_json_and_counted(server, what, data):
    before = request_errors(server, "bad_request") + request_errors(server, "too_large")
    status, doc, resp = raw_request(server, data)
    assert status in (400, 413), (what, doc)
    assert resp.getheader("content-type", "").startswith("application/json"), (what, doc)
    assert_openai_error(doc, status)
    assert request_errors(server, "bad_request") + request_errors(server, "too_large") == before + 1, what
    assert server.request("GET", "/health")[0] == 200


def test_a_body_that_is_not_utf8_is_named_so(server):
    data = b'{"model": "tiny-random", "prompt": "\xff\xfe", "max_tokens": 2}'
    for path, method in (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/cache_policy", "PUT")):
        status, doc = server.request(method, path, raw=data)
        assert status == 400, (path, doc)
        err = assert_openai_error(doc, 400)
        assert err["code"] == "invalid_json" and "UTF-8" in err["message"], err


# ------------------------------------------------------------------------------ 6. no file probe by policy
def learned_folder(where: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(3, OBS_DIM, generator=g) * 0.3, torch.zeros(3), "none")]
    base = CachePolicy(controller="dynamic", base_size=64, max_size=256, min_recent=32)
    return MLPPolicy(layers=layers, action="knobs").save(where, base)


LEARNED = {"controller": "learned", "base_size": 64, "max_size": 256, "min_recent": 32}


def test_a_learned_policy_from_a_path_no_operator_named_is_refused_without_probing_it(server, tmp_path):
    real = learned_folder(tmp_path / "real")
    probes = ["/etc/passwd", "/etc", "/no/such/folder", str(real), "relative/path"]
    start = server.request("GET", "/v1/cache_policy")[1]
    messages = set()
    for path in probes:
        status, doc = server.request("PUT", "/v1/cache_policy", {**LEARNED, "learned_path": path})
        assert status == 422, (path, doc)
        err = assert_openai_error(doc, 422)
        assert err["param"] == "learned_path", err
        assert path not in err["message"] and "/" not in err["message"].replace("registry://", ""), err
        messages.add(err["message"])
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "cache_policy": {**LEARNED, "learned_path": path}}
        status, doc = server.request("POST", "/v1/completions", body)
        assert status == 400 and doc["error"]["param"] == "cache_policy", (path, doc)
        assert path not in doc["error"]["message"], doc
        messages.add(doc["error"]["message"])
    assert len(messages) == 2, messages  # one answer for PUT, one per request, whatever the path is
    assert server.request("GET", "/v1/cache_policy")[1] == start


def test_a_learned_policy_loads_from_a_folder_the_operator_allowed(tmp_path):
    allowed = tmp_path / "allowed"
    good = learned_folder(allowed / "net")
    outside = learned_folder(tmp_path / "outside")
    (allowed / "link").symlink_to(outside)
    with ServerProcess("--model", MODEL, "--kv-cache-memory", "4MiB", "--allowed-policy-dir", str(allowed)) as proc:
        for path in (str(outside), str(allowed / "link"), str(allowed / ".." / "outside")):
            status, doc = proc.request("PUT", "/v1/cache_policy", {**LEARNED, "learned_path": path})
            assert status == 422 and doc["error"]["param"] == "learned_path", (path, doc)
        status, doc = proc.request("PUT", "/v1/cache_policy", {**LEARNED, "learned_path": str(good)})
        assert status == 200 and doc["policy"]["controller"] == "learned", doc
        status, doc = proc.request("POST", "/v1/completions", {"model": MODEL, "prompt": "learned", "max_tokens": 3})
        assert status == 200, doc
        # the folder served now may be sent back as it is (a client that GETs, edits and PUTs the policy)
        served = proc.request("GET", "/v1/cache_policy")[1]["policy"]
        assert proc.request("PUT", "/v1/cache_policy", {**served, "max_size": 300})[0] == 200


# ------------------------------------------------------------------------- 7. values no operator meant
BIG = 10**30
OUT_OF_BOUNDS = [
    ("POST", "/v1/completions", {"cache_policy": {"max_size": BIG}}, 400, "cache_policy", "max_size"),
    ("POST", "/v1/completions", {"cache_policy": {"min_recent": BIG}}, 400, "cache_policy", "min_recent"),
    ("PUT", "/v1/cache_policy", {"base_size": BIG, "max_size": BIG}, 422, "base_size", "base_size"),
    ("PUT", "/v1/cache_policy", {"max_size": BIG}, 422, "max_size", "max_size"),
    ("PUT", "/v1/cache_policy", {"host_cache_memory": "999999PiB"}, 422, "host_cache_memory", "host_cache_memory"),
    ("PUT", "/v1/cache_policy", {"host_cache_memory": BIG}, 422, "host_cache_memory", "host_cache_memory"),
    ("PUT", "/v1/cache_policy", {"compact_interval": BIG}, 422, "compact_interval", "compact_interval"),
    ("POST", "/v1/completions", {"top_k": 10**20}, 400, "top_k", "top_k"),
    ("POST", "/v1/completions", {"top_k": 10**6}, 400, "top_k", "top_k"),
    ("POST", "/v1/completions", {"stop_token_ids": [10**20]}, 400, "stop_token_ids", "stop_token_ids"),
    ("POST", "/v1/completions", {"stop_token_ids": [10**6]}, 400, "stop_token_ids", "stop_token_ids"),
    ("POST", "/v1/completions", {"stop_token_ids": list(range(1000))}, 400, "stop_token_ids", "stop_token_ids"),
    ("POST", "/v1/completions", {"seed": BIG}, 400, "seed", "seed"),
    ("POST", "/v1/completions", {"max_tokens": BIG}, 400, "max_tokens", "max_tokens"),
    ("POST", "/v1/completions", {"prompt": [1, BIG]}, 400, "prompt", "prompt"),
    ("POST", "/v1/chat/completions", {"max_completion_tokens": BIG}, 400, "max_completion_tokens",
     "max_completion_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "values", "status", "param", "named"), OUT_OF_BOUNDS,
                         ids=[f"{r[1]}-{next(iter(r[2]))}-{i}" for i, r in enumerate(OUT_OF_BOUNDS)])  # fmt: skip
def test_values_past_any_sensible_bound_are_a_4xx_naming_the_field(server, method, path, values, status, param,
                                                                   named):  # fmt: skip
    if method == "POST":
        body = {"model": MODEL, "max_tokens": 2}
        body |= {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
        body |= values
    else:
        body = values
    start = server.request("GET", "/v1/cache_policy")[1]
    code, doc = server.request(method, path, body)
    assert code == status, doc
    err = assert_openai_error(doc, status)
    assert err["param"].split(".")[0] == param and named in err["message"], err  # stop_token_ids.0: its first item
    assert server.request("GET", "/v1/cache_policy")[1] == start


# ------------------------------------------------------------------------ 10. the OpenAPI document
#: every route, and the statuses it answers besides 200 (401 only with --api-key, but the document says so)
STATUSES = {
    ("/health", "get"): {"503"},
    ("/metrics", "get"): set(),
    ("/v1/models", "get"): {"401"},
    ("/v1/completions", "post"): {"400", "401", "404", "408", "409", "413", "500", "503"},
    ("/v1/chat/completions", "post"): {"400", "401", "404", "408", "409", "413", "500", "503"},
    ("/v1/cache_policy", "get"): {"401"},
    ("/v1/cache_policy", "put"): {"400", "401", "408", "413", "422", "503"},
    ("/v1/sessions/{session_id}", "delete"): {"400", "401", "404", "503"},
}


def test_the_openapi_document_describes_every_route_as_it_answers(server):
    status, doc = server.request("GET", "/openapi.json")
    assert status == 200
    ops = {(path, method): op for path, item in doc["paths"].items() for method, op in item.items()}
    assert set(ops) == set(STATUSES)
    error_ref = "#/components/schemas/ErrorResponse"
    for key, errors in STATUSES.items():
        responses = ops[key]["responses"]
        assert set(responses) == {"200", *errors}, (key, sorted(responses))
        for code in errors:
            schema = responses[code]["content"]["application/json"]["schema"]
            expected = "#/components/schemas/HealthStatus" if key[0] == "/health" else error_ref  # not an error
            assert schema == {"$ref": expected}, (key, code, schema)
        assert responses["200"].get("content"), key
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    put = ops[("/v1/cache_policy", "put")]["requestBody"]["content"]["application/json"]["schema"]
    refs = {branch.get("$ref") or branch["properties"]["cache_policy"]["$ref"] for branch in put["anyOf"]}
    assert len(refs) == 1, put  # the policy's keys, bare or under "cache_policy"
    policy = doc["components"]["schemas"][refs.pop().rsplit("/", 1)[1]]
    assert set(policy["properties"]) == set(CachePolicy.model_fields), policy
    assert policy["properties"]["max_size"]["maximum"] == 2**31 - 1
    for key in (("/v1/completions", "post"), ("/v1/chat/completions", "post")):
        assert "text/event-stream" in ops[key]["responses"]["200"]["content"], key


def test_a_405_allows_every_method_the_path_takes(server):
    conn = server.connection()
    try:
        conn.request("PATCH", "/v1/cache_policy")
        resp = conn.getresponse()
        doc = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 405 and doc["error"]["code"] == "method_not_allowed", doc
    assert {m.strip() for m in resp.getheader("allow").split(",")} == {"GET", "PUT"}


# ----------------------------------------------------------------------- 3. header and body read timeouts
def test_slow_headers_and_bodies_are_cut_off_with_a_408(tmp_path):
    with ServerProcess("--model", MODEL, "--kv-cache-memory", "1MiB", "--header-timeout-s", "1",
                       "--body-timeout-s", "1") as proc:  # fmt: skip
        before = request_errors(proc, "timeout")
        partial_head = head("POST", "/v1/completions", "Content-Type: application/json")[:-2]  # no blank line
        short_body = head("POST", "/v1/completions", "Content-Type: application/json", "Content-Length: 100") + b"{"
        results: dict[str, list] = {"head": [], "body": [], "idle": [], "trickle": []}

        def hold(kind: str, data: bytes) -> None:
            t0 = time.monotonic()
            with socket.create_connection(address(proc), timeout=10) as sock:
                if kind == "trickle":  # a byte at a time, each well within the timeout: the head still has one
                    for b in partial_head:
                        if select.select([sock], [], [], 0.1)[0]:  # the server answered (or closed): stop sending
                            break
                        sock.sendall(bytes([b]))
                else:
                    sock.sendall(data)
                received = b""
                try:
                    while chunk := sock.recv(65536):
                        received += chunk
                except (ConnectionResetError, BrokenPipeError, TimeoutError):
                    pass
            results[kind].append((time.monotonic() - t0, received))

        threads = [threading.Thread(target=hold, args=(k, d)) for k, d in
                   [("head", partial_head)] * 8 + [("body", short_body)] * 8 + [("idle", b"")] * 2 +
                   [("trickle", b"")] * 2]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        for kind, runs in results.items():
            assert runs, kind
            for took, received in runs:
                assert took < 3.5, (kind, took)
                if kind == "idle":
                    assert received == b"", received  # a connection that sent nothing is just closed
                    continue
                status_line, _, rest = received.partition(b"\r\n")
                assert status_line.startswith(b"HTTP/1.1 408"), (kind, received)
                doc = json.loads(rest.partition(b"\r\n\r\n")[2])
                assert assert_openai_error(doc, 408)["code"] == "request_timeout", doc
        assert request_errors(proc, "timeout") == before + 18
        assert proc.request("GET", "/health")[0] == 200
