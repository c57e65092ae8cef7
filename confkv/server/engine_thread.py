"""The one thread that owns the engine.

``LLMEngine`` is synchronous and holds no locks: a request added or aborted while ``step()`` runs would change the
block tables the forward pass is reading. So exactly one thread touches the engine (and its tokenizer, which is not
safe to share either), and everything else talks to it through an inbox that it drains between two steps:

* ``submit`` (add a request), ``abort``, ``abort_all``, ``set_policy``, ``refuse_policy`` and ``delete_session`` are
  commands;
* results flow back per request through an ``asyncio.Queue`` owned by the HTTP side's event loop, fed with
  ``loop.call_soon_threadsafe`` (the only thread-safe way into an asyncio queue);
* the add's outcome (accepted, or the ``ConfkvError`` that becomes a 400) comes back on a ``concurrent.futures``
  future, so a bad request is answered before any stream starts.

When nothing is running the thread blocks on the inbox (no busy loop), waking once a second (more often when the
session tier times are shorter: ``idle_wake_s``) to refresh its heartbeat, so ``/health`` can tell an idle engine
from a dead one, and to run the engine's session housekeeping (a busy engine does it in every ``step()``), so that
idle sessions move down the tiers (device -> host -> object storage) and expire without any traffic. A request the
engine fails alone (its ``StepOutput.error``, counted by the engine in ``stats()["request_errors_by_kind"]``) ends
alone; an exception escaping ``step()`` (an engine bug) fails the requests in flight, counted here as ``engine``, and
the thread keeps serving new ones.

When the thread ends (after the HTTP side has drained the running requests), it writes every session still in memory
to the object store (``flush_sessions``, bounded by ``session_flush_s``) and closes the engine's background writer,
so a server restarted on the same store loses no session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from confkv.config import CachePolicy
from confkv.engine.params import SamplingParams
from confkv.errors import ConfkvError
from confkv.server.detok import IncrementalDetokenizer
from confkv.server.metrics import ServerMetrics
from confkv.sessions.store import check_session_id

if TYPE_CHECKING:
    from confkv.engine.engine import LLMEngine, StepOutput

log = logging.getLogger(__name__)

_IDLE_WAKE_S = 1.0
_MIN_WAKE_S = 0.05


def idle_wake_s(session_idle_s: float, session_offload_s: float) -> float:
    """How often an idle thread wakes: once a second, or often enough for the session tier times (half the shorter
    one, not below 50 ms), so a session moves down the tiers about when its time is up and not a second later."""
    return max(_MIN_WAKE_S, min(_IDLE_WAKE_S, min(session_idle_s, session_offload_s) / 2))


class RequestRejected(ConfkvError):
    """A request the engine thread refused, with the body field it is about (OpenAI's ``param``) and the HTTP
    status the HTTP side answers with (400 unless a subclass says otherwise)."""

    status = 400
    code = "invalid_value"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SessionBusy(RequestRejected):
    """A turn for a session that already has a request running: 409, the client sends one turn at a time (a second
    turn cannot extend a conversation whose previous answer is not written yet)."""

    status = 409
    code = "session_busy"


class EngineUnavailable(RuntimeError):
    """The engine thread is not running (stopped, or died): the HTTP side answers 503."""


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the top alternatives, as token strings."""

    token: str
    logprob: float
    top: list[tuple[str, float]] | None = None


@dataclass
class Event:
    """What the engine thread sends a request's stream: new text, and once finished, why and how much."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the request's session
    kv: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerateRequest:
    """A request as the HTTP side hands it over; the engine thread tokenizes it (it owns the tokenizer).

    ``prompt`` is text or token ids for completions; ``messages`` a chat's list of ``{"role", "content"}`` turns
    rendered with the model's chat template. ``sampling`` are ``SamplingParams`` keywords; when it lacks
    ``max_tokens`` the rest of the context is used (capped by ``max_tokens_limit``).
    """

    request_id: str
    sampling: dict[str, Any]
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    logprobs: int | None = None
    policy_overrides: dict[str, Any] | None = None
    session_id: str | None = None


class RequestStream:
    """The HTTP side's end of one request: the accept future and the event queue."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.accepted: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.finished = False

    def push(self, event: Event) -> None:
        """Called from the engine thread."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


@dataclass
class _Live:
    stream: RequestStream
    detok: IncrementalDetokenizer
    arrival: float
    prompt_tokens: int
    logprobs: int | None
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0


@dataclass
class _Cmd:
    kind: str
    payload: Any = None
    future: concurrent.futures.Future | None = None


class EngineThread:
    """Owns ``engine`` and steps it; see the module docstring for the protocol."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_prompt_tokens: int | None = None,
        max_tokens_limit: int | None = None,
        metrics: ServerMetrics | None = None,
        session_flush_s: float = 60.0,
        wake_s: float = _IDLE_WAKE_S,
    ) -> None:
        """``session_flush_s`` bounds the writing of sessions to the object store when the thread ends; ``wake_s``
        is how often an idle thread wakes (``idle_wake_s``)."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.max_prompt_tokens = min(max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1)
        self.max_tokens_limit = max_tokens_limit or self.max_model_len
        self.metrics = metrics
        self.session_flush_s = session_flush_s
        self.wake_s = wake_s
        #: the engine's object store (thread-safe) or None: the HTTP side deletes a session's record through it
        self.session_store = engine.sessions.store
        self._inbox: queue.Queue[_Cmd] = queue.Queue()
        self._live: dict[str, _Live] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.heartbeat = time.monotonic()
        self.busy_since: float | None = None
        self.fatal: str | None = None
        self.stats_snapshot: dict[str, Any] = dict(engine.stats())
        self.policy_snapshot: tuple[CachePolicy, dict[str, Any]] = (engine.policy, dict(engine.policy_info))

    # ------------------------------------------------------------------------------------------ HTTP side API
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="confkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Abort everything in flight, write the sessions to the store and end the thread (by default waiting for
        up to ``session_flush_s`` plus 10 seconds)."""
        self._inbox.put(_Cmd("stop"))
        if self._thread is not None:
            self._thread.join(self.session_flush_s + 10.0 if timeout is None else timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal is None

    def healthy(self, stale_after_s: float) -> bool:
        """Alive, and either idle-but-waking or inside a step that has not run for ``stale_after_s``."""
        if not self.alive:
            return False
        now = time.monotonic()
        busy = self.busy_since
        if busy is not None:
            return now - busy < stale_after_s
        return now - self.heartbeat < max(stale_after_s, 5 * _IDLE_WAKE_S)

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def submit(self, req: GenerateRequest, loop: asyncio.AbstractEventLoop) -> RequestStream:
        if not self.alive or self._stopping:
            raise EngineUnavailable(self.fatal or "the engine is not running")
        stream = RequestStream(req.request_id, loop)
        self._inbox.put(_Cmd("add", (req, stream)))
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Cmd("abort", request_id))

    def abort_all(self) -> None:
        self._inbox.put(_Cmd("abort_all"))

    def set_policy(
        self, policy: CachePolicy, *, source: str, version: str | None = None, name: str | None = None
    ) -> concurrent.futures.Future[dict[str, Any]]:
        """Swap the policy between two steps; the future holds the new policy info or the ``ConfkvError``."""
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        if not self.alive or self._stopping:
            fut.set_exception(EngineUnavailable(self.fatal or "the engine is not running"))
            return fut
        self._inbox.put(_Cmd("set_policy", (policy, source, version, name), fut))
        return fut

    def refuse_policy(self, source: str, reason: str) -> None:
        """Count a policy that a watcher could not load (corrupt file or registry version); serving goes on."""
        self._inbox.put(_Cmd("refuse_policy", (source, reason)))

    def delete_session(self, session_id: str) -> concurrent.futures.Future[bool]:
        """Forget a session in the engine's memory tiers (a request of it running now finishes without being kept);
        the future holds whether the engine knew it (kept or running), or the ``ConfkvError`` of a bad id. The
        engine also queues the deletion of its stored record on its background writer."""
        fut: concurrent.futures.Future[bool] = concurrent.futures.Future()
        if not self.alive or self._stopping:
            fut.set_exception(EngineUnavailable(self.fatal or "the engine is not running"))
            return fut
        self._inbox.put(_Cmd("delete_session", session_id, fut))
        return fut

    # ------------------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._drain(block=not busy):
                    break
                if self.engine.has_unfinished_requests():
                    self.busy_since = time.monotonic()
                    try:
                        outs = self.engine.step()
                    except Exception as err:
                        log.exception("engine step failed; failing the requests in flight")
                        self._fail_all(f"engine step failed: {type(err).__name__}: {err}")
                        outs = []
                    finally:
                        self.busy_since = None
                    self._beat()  # before the outputs reach clients: a scrape after a response sees it finished
                    self._dispatch(outs)
                else:
                    self._housekeeping()
                    self._beat()
        except Exception as err:  # a bug in this loop: /health must turn 503 rather than hang
            log.exception("engine thread died")
            self.fatal = f"{type(err).__name__}: {err}"
        finally:
            self._stopping = True
            if self.fatal is not None:  # every request in flight fails as an error (and is counted so), not an abort
                self._fail_all(f"engine thread died: {self.fatal}")
            else:
                self._fail_all("server shutting down", reason="abort")
            self._refuse_pending()
            self._close_engine()

    def _housekeeping(self) -> None:
        """Session tier moves and expiry while idle; a failure here is logged, never fatal to the thread."""
        try:
            self.engine.housekeeping()
        except Exception:
            log.exception("session housekeeping failed")

    def _close_engine(self) -> None:
        """Write every session held in memory to the store (bounded), then stop the engine's background writer.

        Runs after the requests have drained (or been aborted: an aborted turn is kept as far as it got), so the
        sessions written are complete. Tried even after an engine bug: the sessions are worth more than the risk.
        """
        t0 = time.monotonic()
        try:
            faults = sum(self.engine.stats().get("session_faults", {}).values())
            n = self.engine.flush_sessions(self.session_flush_s)
            took = time.monotonic() - t0
            failed = sum(self.engine.stats().get("session_faults", {}).values()) - faults
            if self.session_store is not None:
                notes = [f"{failed} not taken by the store"] if failed else []
                if took >= self.session_flush_s:
                    notes.append("timed out: some writes may not have finished")
                note = f" ({'; '.join(notes)})" if notes else ""
                print(f"confkv: wrote {n - failed} sessions to the session store in {took:.1f}s{note}",
                      file=sys.stderr, flush=True)  # fmt: skip
            elif held := sum(self.engine.stats().get("sessions", {}).values()):
                log.warning("no session store (--session-store none): %d sessions in memory are lost", held)
        except Exception:
            log.exception("writing the sessions to the store failed")
        try:
            self.engine.close()
        except Exception:
            log.exception("closing the engine failed")

    def _refuse_pending(self) -> None:
        """Answer commands that arrived after the end, so no HTTP handler waits forever."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            fut = cmd.payload[1].accepted if cmd.kind == "add" else cmd.future
            if fut is not None and not fut.done():
                fut.set_exception(EngineUnavailable("the engine is shutting down"))

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()
        self.stats_snapshot = dict(self.engine.stats())
        restores = self.engine.sessions.drain_restore_seconds()  # drained even without metrics: it is a list
        if self.metrics is not None:
            for seconds in restores:
                self.metrics.session_restore.observe(seconds)

    def _drain(self, block: bool) -> bool:
        """Run queued commands; block (waking every ``wake_s``) when idle. False once asked to stop."""
        try:
            cmd = self._inbox.get(timeout=self.wake_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd.kind == "stop":
                self._stopping = True
                return False
            try:
                self._handle(cmd)
            except Exception as err:  # never let one command kill the thread
                log.exception("engine thread command %s failed", cmd.kind)
                if cmd.future is not None and not cmd.future.done():
                    cmd.future.set_exception(err)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, cmd: _Cmd) -> None:
        if cmd.kind == "add":
            req, stream = cmd.payload
            try:
                n = self._add(req, stream)
            except ConfkvError as err:
                stream.accepted.set_exception(err)
            except Exception as err:  # tokenizer / template failures are the request's fault, not the server's
                stream.accepted.set_exception(ConfkvError(f"cannot prepare the prompt: {err}"))
            else:
                stream.accepted.set_result(n)
        elif cmd.kind == "abort":
            self._abort(cmd.payload)
        elif cmd.kind == "abort_all":
            for rid in list(self._live):
                self._abort(rid)
        elif cmd.kind == "set_policy":
            policy, source, version, name = cmd.payload
            try:
                self._set_policy(policy, source, version, name)
            except ConfkvError as err:
                cmd.future.set_exception(err)
            else:
                cmd.future.set_result(self.policy_snapshot[1])
        elif cmd.kind == "refuse_policy":
            self.engine.record_refused_policy(*cmd.payload)  # counts and logs it
        elif cmd.kind == "delete_session":
            sid = cmd.payload
            running = sid in self.engine.sessions.active
            cmd.future.set_result(bool(self.engine.delete_session(sid)) or running)

    def _tokenize(self, req: GenerateRequest) -> list[int]:
        if req.messages is not None:
            return list(self.engine.tokenize_messages(req.messages))
        if isinstance(req.prompt, str):
            if not req.prompt.strip():
                raise ConfkvError("prompt is empty")
            return list(self.engine.tokenize(req.prompt))
        return [int(t) for t in req.prompt or []]

    def _add(self, req: GenerateRequest, stream: RequestStream) -> int:
        prompt_param = "messages" if req.messages is not None else "prompt"
        try:
            ids = self._tokenize(req)
        except ConfkvError as err:
            raise RequestRejected(str(err), prompt_param) from None
        if not ids:
            raise RequestRejected("prompt is empty", prompt_param)
        if len(ids) > self.max_prompt_tokens:
            raise RequestRejected(
                f"prompt has {len(ids)} tokens; this server accepts at most {self.max_prompt_tokens} "
                f"(context {self.max_model_len})",
                prompt_param,
            )
        kwargs = dict(req.sampling)
        if "max_tokens" not in kwargs:
            kwargs["max_tokens"] = max(1, min(self.max_tokens_limit, self.max_model_len - len(ids)))
        elif kwargs["max_tokens"] > self.max_tokens_limit:
            raise RequestRejected(
                f"max_tokens is {kwargs['max_tokens']}; this server allows at most {self.max_tokens_limit}",
                "max_tokens",
            )
        if req.logprobs is not None:
            kwargs["logprobs"] = req.logprobs
        try:
            params = SamplingParams(**kwargs)
        except ConfkvError as err:
            field = next((k for k in kwargs if f": {k}:" in f": {err}" or f" {k}:" in str(err)), None)
            raise RequestRejected(str(err), field) from None
        if req.policy_overrides:
            try:
                self.engine.controller_for(req.policy_overrides)
            except ConfkvError as err:
                raise RequestRejected(f"cache_policy: {err}", "cache_policy") from None
        extra: dict[str, Any] = {}
        if req.session_id is not None:
            # checked before the engine sees it: a refused turn must leave nothing behind in the engine
            try:
                check_session_id(req.session_id)
            except ConfkvError as err:
                raise RequestRejected(str(err), "session_id") from None
            if req.session_id in self.engine.sessions.active:
                raise SessionBusy(
                    f"session {req.session_id!r} already has a request running; send one turn at a time",
                    "session_id",
                )
            extra["session_id"] = req.session_id
        self.engine.add_request(req.request_id, ids, params, policy_overrides=req.policy_overrides, **extra)
        self._live[req.request_id] = _Live(
            stream=stream,
            detok=IncrementalDetokenizer(self.tokenizer, params.stop),
            arrival=time.perf_counter(),
            prompt_tokens=len(ids),
            logprobs=req.logprobs,
        )
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(ids))
        return len(ids)

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        out = self.engine.abort_request(request_id)
        if live is None:
            return
        generated = len(out.token_ids) if out is not None else live.generated
        text = live.detok.finish(out.text) if out is not None else ""
        cached = out.cached_tokens if out is not None else 0
        self._finish_metrics(live, "abort")
        live.stream.push(
            Event(
                text,
                finish_reason="abort",
                prompt_tokens=live.prompt_tokens,
                completion_tokens=generated,
                cached_tokens=cached,
            )
        )

    def _set_policy(self, policy: CachePolicy, source: str, version: str | None, name: str | None) -> None:
        self.engine.set_policy(policy, source=source, version=version, name=name)  # logs the swap
        self.policy_snapshot = (self.engine.policy, dict(self.engine.policy_info))
        self.stats_snapshot = dict(self.engine.stats())

    def _token_logprobs(self, out: StepOutput) -> list[TokenLogprob] | None:
        lp = out.logprob
        if lp is None:
            return None
        decode = self.tokenizer.decode
        top = out.top_logprobs
        tok = out.new_token_ids[-1]
        return [
            TokenLogprob(
                token=decode([tok]),
                logprob=float(lp),
                top=[(decode([int(t)]), float(v)) for t, v in top] if top is not None else None,
            )
        ]

    def _dispatch(self, outs: list[StepOutput]) -> None:
        now = time.perf_counter()
        m = self.metrics
        for out in outs:
            live = self._live.get(out.request_id)
            if live is None:  # aborted between the step's start and now, or not a server request
                continue
            ids = list(out.new_token_ids)
            if ids:
                if live.first_token is None:
                    live.first_token = now
                    if m is not None:
                        m.ttft.observe(now - live.arrival)
                elif m is not None and live.last_token is not None:
                    m.itl.observe(now - live.last_token)
                live.last_token = now
                live.generated += len(ids)
                if m is not None:
                    m.generation_tokens.inc(len(ids))
                    for v, hist in ((out.entropy, m.entropy), (out.gap, m.gap), (out.resident, m.resident)):
                        if v is not None:
                            hist.observe(v)
            logprobs = self._token_logprobs(out) if live.logprobs is not None and ids else None
            if not out.finished:
                text = live.detok.add(ids) if ids else ""
                if text or logprobs:
                    live.stream.push(Event(text, ids, logprobs))
                continue
            del self._live[out.request_id]
            res = out.output
            error = out.error
            if res is not None:
                text = live.detok.add(ids)  # what this last token releases, then the rest of the engine's text
                text += live.detok.finish(res.text)
                reason = res.finish_reason or "stop"
                generated, kv, cached = len(res.token_ids), res.kv, res.cached_tokens
            else:
                text, reason, generated, kv, cached = "", "error", live.generated, None, 0
            if error is not None:
                reason = "error"  # the engine failed it and counted it by kind: not counted again here
            self._finish_metrics(live, reason, counted=error is not None)
            live.stream.push(
                Event(
                    text,
                    ids,
                    logprobs,
                    finish_reason=reason,
                    error=error,
                    prompt_tokens=live.prompt_tokens,
                    completion_tokens=generated,
                    cached_tokens=cached,
                    kv=kv,
                )
            )

    def _finish_metrics(self, live: _Live, reason: str, counted: bool = False) -> None:
        """Observe a finished request; an error the engine did not count itself (``counted``) is ``engine`` here."""
        m = self.metrics
        if m is None:
            return
        m.e2e.observe(time.perf_counter() - live.arrival)
        m.request_success.labels(reason).inc()
        if reason == "error" and not counted:
            m.error("engine")

    def _fail_all(self, message: str, reason: str = "error") -> None:
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            self._live.pop(rid, None)
            self._finish_metrics(live, reason)
            live.stream.push(
                Event(
                    finish_reason=reason,
                    error=message if reason == "error" else None,
                    prompt_tokens=live.prompt_tokens,
                    completion_tokens=live.generated,
                )
            )
