"""Sessions through the server, end to end: real ``confkv serve`` processes on tiny-random, driven with the official
``openai`` client, on both kinds of object store: a local folder, and S3 through s3fs against moto's standalone
server (``ThreadedMotoServer`` on a free loopback port, endpoint and credentials in the AWS_* environment the server
inherits, as in production).

Per store, two servers in turn (the tests of a store run in order and share them):

1. default tier times (sessions stay on the device): a three-turn greedy chat with ``session_id`` gives the text of
   the same chat without sessions, token for token under ``full``; later turns report ``cached_tokens`` and compute
   only the new tokens (counted in engine steps: prompts are read 16 tokens per step); the API's errors (400 for a
   bad id, 409 for a second turn while one runs, 404 / 200 on DELETE). Then SIGTERM: the server writes its sessions
   to the store before it exits.
2. restarted on the same store with tiny idle/offload times: the chat resumes from the store with the same answer;
   a new session goes device -> host -> store by time alone and resumes; a truncated record, a record of another
   model (tiny-random with another seed) and, on S3, the S3 server stopped mid-run each fall back to recomputation
   with the same text and are counted in /metrics; S3 coming back is used again without a restart.

Under ``dynamic`` (per-request ``cache_policy``): with a budget above the conversation nothing is evicted and a
session equals recomputation token for token; with a smaller budget it cannot (a session keeps what decoding left,
a recomputation reads the whole history as a prompt: ``confkv.sessions.tiers``), but a session restored from the
store continues exactly as one kept in memory.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from confkv.server import metrics as server_metrics
from confkv.sessions.store import FAULT_KINDS, RECORD_SUFFIX, SessionStore, default_url
from confkv.sessions.tiers import TIERS
from tests.server_proc import ServerProcess
from tests.test_sessions_store import Moto

from .conftest import fresh_tiny

MODEL = "tiny-random"
BATCH = 16  # --max-num-batched-tokens: a prompt is read BATCH tokens per engine step
MAX_TOKENS = 12
TURNS = [
    "Hello! Tell me about the sea and the fish in it, in a few words.",
    "And what lives in it? Say more.",
    "Summarise what you said in one line.",
    "Thanks. One more thing?",
]
SERVER = ("--model", MODEL, "--policy", "full", "--kv-cache-memory", "4MiB", "--max-num-batched-tokens", str(BATCH),
          "--session-store-timeout-s", "1", "--shutdown-grace", "5")  # fmt: skip
FAST_TIERS = ("--session-idle-s", "0.1", "--session-offload-s", "0.2")
#: every session sample the server exports (docs/server.md, docs/sessions.md and deploy/ name them)
SESSION_SAMPLES = {
    "confkv:session_hits_total", "confkv:session_misses_total", "confkv:session_mismatches_total",
    "confkv:session_tokens_reused_total", "confkv:session_offloads_total", "confkv:session_offload_attempts_total",
    "confkv:session_offload_failures_total", "confkv:session_store_tokens_repaired_total",
    "confkv:session_store_faults_total",
    "confkv:sessions", "confkv:session_bytes", "confkv:session_store_written_bytes_total",
    "confkv:session_store_reachable", "confkv:session_restore_seconds_count", "confkv:session_restore_seconds_bucket",
}  # fmt: skip
SMALL_DYNAMIC = {"controller": "dynamic", "base_size": 32, "max_size": 64, "min_recent": 16}


# ------------------------------------------------------------------------------------------------------ helpers


class Backend:
    """One object store (a folder, or a bucket on moto's S3 server), its servers, and the reference chat."""

    def __init__(self, kind: str, tmp: Path, env: pytest.MonkeyPatch) -> None:
        self.kind = kind
        self.moto: Moto | None = None
        if kind == "s3":
            self.moto = Moto()
            env.setenv("AWS_ENDPOINT_URL", self.moto.endpoint)  # for the servers and this process's s3fs alike
            self.url = f"s3://{self.moto.bucket()}/sessions"
        else:
            self.url = str(tmp / "sessions")
        self.store = SessionStore(self.url, timeout_s=1)  # this test's own view of the store
        self.server: ServerProcess | None = None
        self.reference: list[Any] = []  # the chat without sessions: (text, prompt, cached, steps) per turn
        self.dynamic_in_memory: list[Any] = []

    def start(self, *flags: str) -> ServerProcess:
        self.server = ServerProcess(*SERVER, "--session-store", self.url, *flags)
        return self.server

    def client(self) -> openai.OpenAI:
        assert self.server is not None
        return openai.OpenAI(base_url=self.server.base_url, api_key="unused", max_retries=0, timeout=60)

    def record_path(self, session_id: str) -> str:
        return f"{self.store.root}/{session_id}{RECORD_SUFFIX}"

    def close(self) -> None:
        if self.server is not None:
            self.server.kill()
        if self.moto is not None:
            self.moto.stop()


@pytest.fixture(scope="module", params=["folder", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"):  # nothing here can reach real AWS
            mp.delenv(name, raising=False)
        tmp = tmp_path_factory.mktemp(f"sessions-{request.param}")
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", str(tmp / "no-aws-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp / "no-aws-credentials"))
        b = Backend(request.param, tmp, mp)
        try:
            yield b
        finally:
            b.close()


def metrics(server: ServerProcess) -> dict[tuple[str, ...], float]:
    """``{(sample name, *label values): value}`` of the server's /metrics."""
    status, text = server.request("GET", "/metrics")
    assert status == 200
    return {(s.name, *s.labels.values()): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def settled(server: ServerProcess) -> dict[tuple[str, ...], float]:
    """/metrics once the engine thread's snapshot has caught up (it is refreshed just after each step's events)."""
    last = metrics(server)
    while True:
        time.sleep(0.05)
        now = metrics(server)
        if now[("confkv:engine_steps_total",)] == last[("confkv:engine_steps_total",)]:
            return now
        last = now


def turn(
    b: Backend,
    messages: list[dict[str, str]],
    session: str | None,
    *,
    stream: bool = False,
    policy: dict[str, Any] | None = None,
    count_steps: bool = False,
) -> tuple[str, int, int, int]:
    """One greedy turn; returns (text, prompt_tokens, cached_tokens, engine steps it took: -1 unless counted)."""
    assert b.server is not None
    before = settled(b.server)[("confkv:engine_steps_total",)] if count_steps else 0
    extra: dict[str, Any] = {"ignore_eos": True}
    if session is not None:
        extra["session_id"] = session
    if policy is not None:
        extra["cache_policy"] = policy
    kw: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        chunks = list(
            b.client().chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}, extra_body=extra
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        out = b.client().chat.completions.create(**kw, extra_body=extra)
        text, usage = out.choices[0].message.content, out.usage
        if session is not None:
            assert out.model_extra["session_id"] == session
    steps = int(settled(b.server)[("confkv:engine_steps_total",)] - before) if count_steps else -1
    assert usage.prompt_tokens_details is not None
    return text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, steps


def chat(
    b: Backend, session: str | None, turns: range, *, history: list[dict[str, str]] | None = None, **kw: Any
) -> list[tuple[str, int, int, int]]:
    """Turns ``turns`` of the conversation (each prompt is the whole conversation so far, as clients send it)."""
    messages = history if history is not None else []
    outs = []
    for i in turns:
        messages.append({"role": "user", "content": TURNS[i]})
        out = turn(b, messages, session, **kw)
        messages.append({"role": "assistant", "content": out[0]})
        outs.append(out)
    return outs


def conversation(b: Backend, upto: int) -> list[dict[str, str]]:
    """The reference conversation's first ``upto`` turns (user and assistant messages)."""
    messages = []
    for i in range(upto):
        messages += [{"role": "user", "content": TURNS[i]}, {"role": "assistant", "content": b.reference[i][0]}]
    return messages


def next_turn(b: Backend, i: int) -> list[dict[str, str]]:
    """The reference conversation's first ``i`` turns and the user's turn ``i``: what a client sends next."""
    return [*conversation(b, i), {"role": "user", "content": TURNS[i]}]


def prefill_steps(tokens: int) -> int:
    """Engine steps to compute ``tokens`` prompt tokens and generate MAX_TOKENS (the first from the last chunk)."""
    return math.ceil(tokens / BATCH) + MAX_TOKENS - 1


def wait_until(predicate: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def wait_in_store(b: Backend, session_id: str) -> None:
    """Until the session has left memory by time alone and its record is in the store (written whole, atomically)."""
    assert b.server is not None

    def offloaded() -> bool:
        m = metrics(b.server)
        in_memory = m[("confkv:sessions", "device")] + m[("confkv:sessions", "host")]
        return in_memory == 0 and b.store.fs.exists(b.record_path(session_id))

    wait_until(offloaded, f"session {session_id} to reach the store")


# -------------------------------------------------------------------------------------------------------- tests


def test_session_options_from_the_flags(tmp_path: Path) -> None:
    from confkv.server.main import session_options
    from confkv.server.settings import ServerSettings

    opts = session_options(ServerSettings(), str(tmp_path))
    assert opts.store_url == default_url(str(tmp_path)) == str(tmp_path / "sessions")
    assert session_options(ServerSettings(session_store="none"), None).store_url is None
    flags = ServerSettings(
        session_store="s3://b/p", session_idle_s=1, session_offload_s=2, session_ttl_s=3, session_store_timeout_s=4
    )
    opts = session_options(flags, None)
    assert (opts.store_url, opts.idle_s, opts.offload_s, opts.ttl_s, opts.timeout_s) == ("s3://b/p", 1, 2, 3, 4)
    assert server_metrics.SESSION_TIERS == TIERS and server_metrics.SESSION_FAULT_KINDS == FAULT_KINDS


def test_chat_with_a_session_matches_recomputation_and_computes_only_new_tokens(backend: Backend) -> None:
    b = backend
    b.start()
    b.reference = chat(b, None, range(4), count_steps=True)
    for _, prompt, cached, steps in b.reference:
        assert cached == 0 and steps == prefill_steps(prompt)
    outs = chat(b, "chat", range(2), count_steps=True)
    outs += chat(b, "chat", range(2, 3), history=conversation(b, 2), stream=True, count_steps=True)
    assert [o[0] for o in outs] == [r[0] for r in b.reference[:3]]  # greedy under full: token for token
    assert outs[0][2] == 0
    for prev, (_, prompt, cached, steps) in itertools.pairwise(outs):
        assert prev[1] <= cached < prompt  # the previous prompt's KV (at least) was reused, the new turn computed
        assert steps == prefill_steps(prompt - cached)  # and only the new tokens were read
    m = metrics(b.server)
    assert m[("confkv:session_hits_total", "device")] == 2 and m[("confkv:session_misses_total",)] == 1
    assert m[("confkv:session_tokens_reused_total",)] == outs[1][2] + outs[2][2]
    assert m[("confkv:sessions", "device")] == 1 and m[("confkv:session_bytes", "device")] > 0
    assert {key[0] for key in m} >= SESSION_SAMPLES


def test_bad_busy_and_deleted_sessions(backend: Backend) -> None:
    b = backend
    assert b.server is not None
    client = b.client()
    user = [{"role": "user", "content": TURNS[0]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=user, max_tokens=2, extra_body={"session_id": "no spaces"})
    assert err.value.body["param"] == "session_id"
    running = client.chat.completions.create(
        model=MODEL, messages=user, max_tokens=2000, stream=True, extra_body={"session_id": "busy", "ignore_eos": True}
    )
    next(iter(running))  # the first turn is running now
    with pytest.raises(openai.ConflictError) as err:
        client.chat.completions.create(model=MODEL, messages=user, max_tokens=2, extra_body={"session_id": "busy"})
    assert err.value.body["code"] == "session_busy"
    running.close()  # the client goes: its request is aborted (and kept, as far as it got)
    first = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                      extra_body={"session_id": "cmpl"})  # fmt: skip
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt="Once upon a time" + first.choices[0].text + " and then",
                                      max_tokens=4, temperature=0, extra_body={"session_id": "cmpl"})  # fmt: skip
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    turn(b, user, "gone")
    status, doc = b.server.request("DELETE", "/v1/sessions/gone")
    assert status == 200 and doc["deleted"] and doc["memory"]
    assert b.server.request("DELETE", "/v1/sessions/gone")[0] == 404
    assert b.server.request("DELETE", "/v1/sessions/never-seen")[0] == 404
    status, doc = b.server.request("DELETE", "/v1/sessions/.hidden")
    assert status == 400 and doc["error"]["param"] == "session_id"
    m = metrics(b.server)
    assert m[("confkv:request_errors_total", "conflict")] == 1


def test_dynamic_with_room_equals_recomputation(backend: Backend) -> None:
    """Under ``dynamic`` with a budget above the conversation nothing is evicted: a session equals recomputation.
    With a small budget it cannot (see the module docstring); what a session kept in memory says then is kept for
    ``test_dynamic_session_from_the_store_continues_as_in_memory``."""
    b = backend
    if b.moto is not None:
        pytest.skip("the policy does not depend on the store: run on the folder only")
    roomy = {"controller": "dynamic"}  # base_size 1024: above these ~300 tokens
    recomputed = chat(b, None, range(3), policy=roomy)
    kept = chat(b, "dyn-roomy", range(3), policy=roomy)
    assert [o[0] for o in kept] == [o[0] for o in recomputed] and kept[2][2] > 0
    b.dynamic_in_memory = chat(b, "dyn-memory", range(3), policy=SMALL_DYNAMIC)  # default tier times: device hits
    assert metrics(b.server)[("confkv:session_hits_total", "device")] >= 6


def test_sigterm_writes_the_sessions_and_a_restarted_server_resumes_them(backend: Backend) -> None:
    b = backend
    assert b.server is not None
    assert b.server.stop() == 0, b.server.log
    written = re.search(r"confkv: wrote (\d+) sessions to the session store", b.server.log)
    assert written is not None, b.server.log
    stored = b.store.list_sessions()
    assert {"busy", "chat"} <= set(stored) and int(written.group(1)) == len(stored)  # every one in memory
    b.start(*FAST_TIERS)
    (text, prompt, cached, steps) = turn(b, next_turn(b, 3), "chat", count_steps=True)
    assert (
        text == b.reference[3][0] and b.reference[2][1] <= cached < prompt and steps == prefill_steps(prompt - cached)
    )
    m = settled(b.server)
    assert m[("confkv:session_hits_total", "store")] == 1 and m[("confkv:session_restore_seconds_count",)] >= 1
    status, doc = b.server.request("DELETE", "/v1/sessions/busy")  # only in the store now
    assert status == 200 and doc == {"id": "busy", "object": "session.deleted", "deleted": True, "memory": False,
                                     "store": True}  # fmt: skip
    assert not b.store.exists("busy")


def test_an_idle_session_goes_to_the_store_by_time_and_resumes(backend: Backend) -> None:
    b = backend
    assert b.server is not None
    (first,) = chat(b, "timed", range(1))
    wait_in_store(b, "timed")
    m = metrics(b.server)
    assert m[("confkv:session_offloads_total",)] >= 1 and m[("confkv:session_store_written_bytes_total",)] > 0
    hits = m[("confkv:session_hits_total", "store")]
    (text, prompt, cached, steps) = turn(b, next_turn(b, 1), "timed", count_steps=True)
    assert (first[0], text) == (b.reference[0][0], b.reference[1][0])
    assert first[1] <= cached < prompt and steps == prefill_steps(prompt - cached)
    assert metrics(b.server)[("confkv:session_hits_total", "store")] == hits + 1


def _faults(b: Backend, kind: str) -> float:
    assert b.server is not None
    return metrics(b.server)[("confkv:session_store_faults_total", kind)]


def test_a_truncated_record_falls_back_to_recomputation(backend: Backend) -> None:
    b = backend
    chat(b, "trunc", range(1))
    wait_in_store(b, "trunc")
    data = b.store.fs.cat_file(b.record_path("trunc"))
    b.store.fs.pipe_file(b.record_path("trunc"), data[: len(data) // 2])
    before = _faults(b, "corrupt")
    (text, _, cached, _) = turn(b, next_turn(b, 1), "trunc")
    assert text == b.reference[1][0] and cached == 0
    assert _faults(b, "corrupt") == before + 1


def test_a_record_of_another_model_falls_back_to_recomputation(backend: Backend) -> None:
    from confkv import LLM, SamplingParams
    from confkv.sessions.tiers import SessionOptions

    b = backend
    kinds = ("foreign", "corrupt", "unavailable")
    for attempt in ("foreign", "foreign-again"):
        # what `confkv serve --model tiny-random --seed 7` would have written under the same session id
        other = LLM(MODEL, "full", loaded=fresh_tiny(seed=7), kv_cache_memory="4MiB",
                    sessions=SessionOptions(store_url=b.url))  # fmt: skip
        other.chat([[{"role": "user", "content": TURNS[0]}]], SamplingParams(max_tokens=4), session_id=attempt)
        assert other.engine.flush_sessions() == 1
        other.close()
        before = {k: _faults(b, k) for k in kinds}
        (text, _, cached, _) = turn(b, [{"role": "user", "content": TURNS[0]}], attempt)
        assert text == b.reference[0][0] and cached == 0
        counted = {k: _faults(b, k) - before[k] for k in kinds}
        # The server reads the store with a 1 s timeout; on a loaded machine a slow (moto) answer, or the backoff
        # a slow earlier write set, is counted as `unavailable` and the record is never read: try once more, once
        # the backoff that fault set is over.
        if counted["unavailable"] == 0:
            break
        time.sleep(SessionOptions().store_backoff_s + 0.5)
    assert counted == {"foreign": 1, "corrupt": 0, "unavailable": 0}, counted


def test_s3_stopped_mid_run_falls_back_and_is_used_again_when_it_returns(backend: Backend) -> None:
    b = backend
    if b.moto is None:
        pytest.skip("an outage of the S3 server")
    assert b.server is not None
    chat(b, "outage", range(1))
    wait_in_store(b, "outage")
    before = _faults(b, "unavailable")
    b.moto.stop()
    try:
        (text, _, cached, _) = turn(b, next_turn(b, 1), "outage")
        assert text == b.reference[1][0] and cached == 0  # recomputed: the request does not fail
        m = metrics(b.server)
        assert m[("confkv:session_store_faults_total", "unavailable")] >= before + 1
        assert m[("confkv:session_store_reachable",)] == 0
        status, doc = b.server.request("DELETE", "/v1/sessions/outage")  # memory is cleared, the store cannot be
        assert status == 503 and doc["error"]["code"] == "session_store_unavailable"
    finally:
        b.moto.restart()  # same port, objects kept: the outage is over
    chat(b, "back", range(1))
    wait_in_store(b, "back")  # written again, by the same server
    hits = metrics(b.server)[("confkv:session_hits_total", "store")]
    (text, prompt, cached, _) = turn(b, next_turn(b, 1), "back")
    assert text == b.reference[1][0] and 0 < cached < prompt
    m = metrics(b.server)
    assert m[("confkv:session_hits_total", "store")] == hits + 1 and m[("confkv:session_store_reachable",)] == 1


def test_dynamic_session_from_the_store_continues_as_in_memory(backend: Backend) -> None:
    """With a budget that evicts, each turn of this session comes back from the store (offloaded by time), and it
    continues exactly as the same session kept on the device did: same text, same tokens reused."""
    b = backend
    if b.moto is not None:
        pytest.skip("the policy does not depend on the store: run on the folder only")
    messages: list[dict[str, str]] = []
    via_store = []
    for i in range(3):
        via_store += chat(b, "dyn-store", range(i, i + 1), history=messages, policy=SMALL_DYNAMIC)
        wait_in_store(b, "dyn-store")
    assert [o[:3] for o in via_store] == [o[:3] for o in b.dynamic_in_memory]
    assert via_store[2][2] > 0


def test_sigterm_after_the_faults_exits_cleanly(backend: Backend) -> None:
    b = backend
    assert b.server is not None
    assert b.server.stop() == 0, b.server.log
