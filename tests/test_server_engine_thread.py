"""The engine thread in-process over a scripted fake engine (no model): one request failing inside the engine ends
alone, an exception escaping ``step()`` fails only the requests in flight, each failure is counted once, an idle
thread sleeps (and does the session housekeeping when it wakes), and a stopped one writes the sessions out."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from confkv.config import CachePolicy
from confkv.engine.engine import StepOutput as Out
from confkv.engine.params import SamplingParams
from confkv.errors import ConfkvError
from confkv.model_loader import tiny_random_tokenizer
from confkv.server.engine_thread import EngineThread, GenerateRequest
from confkv.server.metrics import ServerMetrics


@dataclass
class Final:
    text: str
    token_ids: list[int]
    finish_reason: str
    kv: dict = field(default_factory=dict)
    error: str | None = None
    cached_tokens: int = 0


@dataclass
class FakeSessions:
    """What the engine thread reads of ``engine.sessions``: no store, no session running, no restores."""

    store: None = None
    active: dict = field(default_factory=dict)

    def drain_restore_seconds(self) -> list[float]:
        return []


class FakeEngine:
    """Each request emits the bytes of "ok" one step at a time; a prompt starting with "fail" errors at step 2,
    one starting with "boom" makes the whole ``step()`` raise once."""

    def __init__(self) -> None:
        self.tokenizer = tiny_random_tokenizer()
        self.max_model_len = 256
        self.policy = CachePolicy(controller="full")
        self.policy_info = {"name": "full", "version": None, "source": "startup"}
        self.reqs: dict[str, dict] = {}
        self.steps = 0
        self.unfinished_calls = 0
        self.errors: Counter[str] = Counter()
        self.sessions = FakeSessions()
        self.housekeeping_calls = 0
        self.flushed = self.closed = False

    def housekeeping(self) -> None:
        self.housekeeping_calls += 1

    def flush_sessions(self, timeout_s: float) -> int:
        self.flushed = True
        return 0

    def close(self) -> None:
        self.closed = True

    def stats(self) -> dict:
        return {
            "running": len(self.reqs),
            "waiting": 0,
            "steps": self.steps,
            "request_errors": sum(self.errors.values()),
            "request_errors_by_kind": dict(self.errors),
        }

    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def session_running(self, session_id: str) -> bool:
        return session_id in self.sessions.active

    def add_request(self, rid: str, prompt, sampling: dict, *, policy_overrides=None, session_id=None, limits=None):
        """What the engine's admission does with what the thread hands it, in short: the limits it was given
        refuse a ``max_tokens`` past them, naming the field."""
        ids = list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        if limits is not None and sampling.get("max_tokens", 0) > limits.max_tokens:
            raise ConfkvError(f"max_tokens is {sampling['max_tokens']}", param="max_tokens")
        text = self.tokenizer.decode(ids)
        if text.startswith("bad"):
            raise ConfkvError("prompt is bad")
        self.reqs[rid] = {"todo": list(self.tokenizer("ok!")["input_ids"]), "done": [], "text": text}
        return SimpleNamespace(prompt_token_ids=ids, params=SamplingParams(**sampling))

    def has_unfinished_requests(self) -> bool:
        self.unfinished_calls += 1
        return bool(self.reqs)

    def abort_request(self, rid: str):
        r = self.reqs.pop(rid, None)
        return None if r is None else Final(self.tokenizer.decode(r["done"]), r["done"], "abort")

    def step(self) -> list[Out]:
        self.steps += 1
        if any(r["text"].startswith("boom") for r in self.reqs.values()):
            for r in self.reqs.values():
                r["text"] = "-"
            raise RuntimeError("kaboom")
        outs = []
        for rid, r in list(self.reqs.items()):
            if r["text"].startswith("fail") and len(r["done"]) == 1:
                del self.reqs[rid]
                self.errors["sampling"] += 1
                outs.append(Out(rid, [], True, Final("", r["done"], "error", error="bad luck"), error="bad luck"))
                continue
            tok = r["todo"].pop(0)
            r["done"].append(tok)
            if not r["todo"]:
                del self.reqs[rid]
                outs.append(Out(rid, [tok], True, Final(self.tokenizer.decode(r["done"]), r["done"], "length")))
            else:
                outs.append(Out(rid, [tok], False))
        return outs


async def collect(et: EngineThread, rid: str, prompt: str) -> tuple[str, str | None, str | None]:
    stream = et.submit(GenerateRequest(rid, {"max_tokens": 8}, prompt=prompt), asyncio.get_running_loop())
    await asyncio.wrap_future(stream.accepted)
    text = ""
    while True:
        ev = await asyncio.wait_for(stream.queue.get(), 5)
        text += ev.text
        if ev.finished:
            return text, ev.finish_reason, ev.error


@pytest.fixture
def thread():
    engine = FakeEngine()
    et = EngineThread(engine)
    et.start()
    yield et, engine
    et.stop()


def test_a_failing_request_fails_alone(thread):
    et, _ = thread

    async def main():
        return await asyncio.gather(collect(et, "a", "fail me"), collect(et, "b", "fine"))

    (_, ra, ea), (tb, rb, eb) = asyncio.run(main())
    assert (ra, ea) == ("error", "bad luck")
    assert (tb, rb, eb) == ("ok!", "length", None)


def test_a_step_exception_fails_the_batch_but_the_thread_serves_on(thread):
    et, _ = thread

    async def main():
        first = await asyncio.gather(collect(et, "x", "boom"), collect(et, "y", "other"))
        again = await collect(et, "z", "after")
        return first, again

    first, again = asyncio.run(main())
    assert all(r == "error" and "kaboom" in e for _, r, e in first)
    assert again == ("ok!", "length", None)
    assert et.alive and et.healthy(60)


def test_each_failure_is_counted_once_by_whoever_saw_it():
    engine = FakeEngine()
    et = EngineThread(engine)
    et.metrics = ServerMetrics(
        snapshot=lambda: et.stats_snapshot, policy_info=lambda: et.policy_snapshot[1], health=lambda: (True, False)
    )
    reg = et.metrics.registry

    def errors() -> dict[str, float]:
        fam = next(m for m in reg.collect() if m.name == "confkv:request_errors")
        return {s.labels["kind"]: s.value for s in fam.samples}

    async def main():
        await collect(et, "a", "fail me")  # the engine fails it and counts it (kind "sampling")
        await collect(et, "b", "boom")  # step() raises: only the thread knows (kind "engine")

    et.start()
    try:
        asyncio.run(main())
        deadline = time.monotonic() + 5
        while errors()["engine_sampling"] != 1:  # the snapshot is taken just after the step's events are sent
            assert time.monotonic() < deadline, errors()
            time.sleep(0.01)
    finally:
        et.stop()
    got = errors()
    assert got["engine_sampling"] == 1 and got["engine"] == 1 and sum(got.values()) == 2, got
    assert got["engine_too_large"] == got["engine_forward"] == got["too_large"] == 0


def test_rejected_requests_raise_before_streaming(thread):
    et, _ = thread

    async def main():
        stream = et.submit(GenerateRequest("r", {"max_tokens": 8}, prompt="bad prompt"), asyncio.get_running_loop())
        await asyncio.wrap_future(stream.accepted)

    with pytest.raises(ConfkvError, match="prompt is bad"):
        asyncio.run(main())

    async def too_many():
        req = GenerateRequest("t", {"max_tokens": 1000}, prompt="fine")
        await asyncio.wrap_future(et.submit(req, asyncio.get_running_loop()).accepted)

    with pytest.raises(ConfkvError) as err:
        asyncio.run(too_many())
    assert err.value.param == "max_tokens"


def test_an_idle_thread_sleeps_on_its_inbox(thread):
    et, engine = thread
    time.sleep(0.2)
    calls, steps, chores = engine.unfinished_calls, engine.steps, engine.housekeeping_calls
    time.sleep(1.5)
    assert engine.steps == steps  # no step without work
    assert engine.unfinished_calls - calls <= 4  # woken about once a second, not spinning
    assert 1 <= engine.housekeeping_calls - chores <= 4  # and each wake moves idle sessions down the tiers
    assert et.healthy(60)


def test_stopping_writes_the_sessions_and_closes_the_engine():
    engine = FakeEngine()
    et = EngineThread(engine)
    et.start()
    et.stop()
    assert not et.alive and engine.flushed and engine.closed


def test_a_thread_that_dies_fails_its_requests_as_errors():
    """A bug that kills the engine thread ends the requests in flight with an error (a 500, an SSE error event, a
    counted failure), not with a clean ``abort`` that reads like a shutdown."""

    class DyingEngine(FakeEngine):
        def stats(self) -> dict:
            if self.steps >= 1:
                raise RuntimeError("stats broke")
            return super().stats()

    et = EngineThread(DyingEngine())
    et.start()
    try:
        _, reason, error = asyncio.run(collect(et, "a", "fine"))
    finally:
        et.stop()
    assert reason == "error" and "engine thread died" in error and "stats broke" in error
    assert not et.alive and not et.healthy(60)


def test_a_policy_put_to_a_stopped_engine_is_a_503():
    from fastapi.testclient import TestClient

    from confkv.server.app import ServerState, create_app
    from confkv.server.settings import ServerSettings

    engine = FakeEngine()
    et = EngineThread(engine)
    metrics = ServerMetrics(snapshot=lambda: et.stats_snapshot, policy_info=lambda: et.policy_snapshot[1],
                            health=lambda: (False, False), device="cpu")  # fmt: skip
    et.start()
    et.stop()
    app = create_app(ServerState(et, ServerSettings(api_key="k\u00e9y"), metrics))
    client = TestClient(app)
    body = {"controller": "window", "max_size": 64}
    for token in (b"\xe9", b"wrong"):  # a header that is not ASCII is a wrong key too, not a 500
        response = client.put("/v1/cache_policy", json=body, headers={"Authorization": b"Bearer " + token})
        assert response.status_code == 401
    key = {"Authorization": b"Bearer " + "k\u00e9y".encode()}  # the key's UTF-8 bytes, as a client sends them
    response = client.put("/v1/cache_policy", json=body, headers=key)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
