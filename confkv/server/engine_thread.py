"""The one thread that owns the engine.

``LLMEngine`` is synchronous and holds no locks: a request added or aborted while ``step()`` runs would change the
block tables the forward pass is reading. So exactly one thread touches the engine (and its tokenizer, which is not
safe to share either), and everything else talks to it through an inbox that it drains between two steps:

* ``submit`` (add a request), ``abort``, ``abort_all``, ``set_policy``, ``refuse_policy`` and ``delete_session`` are
  commands;
* an added request is admitted on this thread by the engine's own admission (``confkv.engine.intake``: tokenized
  and checked once, against the server's limits too), and its outcome (accepted, or the ``ConfkvError`` naming the
  field at fault that becomes a 4xx) comes back on a ``concurrent.futures`` future, so a bad request is answered
  before any stream starts;
* results flow back per request through its queue (``channel.py``); the requests in flight and the turning of each
  step's outputs into their events and metrics are ``inflight.py``'s.

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
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confkv.config import CachePolicy
from confkv.engine.intake import RequestLimits
from confkv.errors import ConfkvError
from confkv.server.channel import EngineUnavailable, Event, GenerateRequest, RequestStream, TokenLogprob
from confkv.server.inflight import InFlight
from confkv.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from confkv.engine.engine import LLMEngine

__all__ = [
    "EngineThread",
    "EngineUnavailable",
    "Event",
    "GenerateRequest",
    "RequestStream",
    "TokenLogprob",
    "idle_wake_s",
]

log = logging.getLogger(__name__)

_IDLE_WAKE_S = 1.0
_MIN_WAKE_S = 0.05


def idle_wake_s(session_idle_s: float, session_offload_s: float) -> float:
    """How often an idle thread wakes: once a second, or often enough for the session tier times (half the shorter
    one, not below 50 ms), so a session moves down the tiers about when its time is up and not a second later."""
    return max(_MIN_WAKE_S, min(_IDLE_WAKE_S, min(session_idle_s, session_offload_s) / 2))


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
        self.limits = RequestLimits(self.max_prompt_tokens, self.max_tokens_limit)
        self.session_flush_s = session_flush_s
        self.wake_s = wake_s
        #: the engine's object store (thread-safe) or None: the HTTP side deletes a session's record through it
        self.session_store = engine.sessions.store
        self._inbox: queue.Queue[_Cmd] = queue.Queue()
        self._inflight = InFlight(self.tokenizer, metrics)
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
    def metrics(self) -> ServerMetrics | None:
        """Where the requests' metrics go; may be set after construction (the metrics read the thread's snapshots)."""
        return self._inflight.metrics

    @metrics.setter
    def metrics(self, metrics: ServerMetrics | None) -> None:
        self._inflight.metrics = metrics

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

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
                        self._inflight.fail_all(self.engine, f"engine step failed: {type(err).__name__}: {err}")
                        outs = []
                    finally:
                        self.busy_since = None
                    self._beat()  # before the outputs reach clients: a scrape after a response sees it finished
                    self._inflight.dispatch(outs)
                else:
                    self._housekeeping()
                    self._beat()
        except Exception as err:  # a bug in this loop: /health must turn 503 rather than hang
            log.exception("engine thread died")
            self.fatal = f"{type(err).__name__}: {err}"
        finally:
            self._stopping = True
            if self.fatal is not None:  # every request in flight fails as an error (and is counted so), not an abort
                self._inflight.fail_all(self.engine, f"engine thread died: {self.fatal}")
            else:
                self._inflight.fail_all(self.engine, "server shutting down", reason="abort")
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
            self._inflight.abort(self.engine, cmd.payload)
        elif cmd.kind == "abort_all":
            for rid in self._inflight.ids():
                self._inflight.abort(self.engine, rid)
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
            running = self.engine.session_running(sid)
            cmd.future.set_result(bool(self.engine.delete_session(sid)) or running)

    def _add(self, req: GenerateRequest, stream: RequestStream) -> int:
        sampling = dict(req.sampling)
        if req.logprobs is not None:
            sampling["logprobs"] = req.logprobs
        prompt = req.messages if req.messages is not None else req.prompt
        seq = self.engine.add_request(req.request_id, prompt if prompt is not None else [], sampling,
                                      policy_overrides=req.policy_overrides, session_id=req.session_id,
                                      limits=self.limits)  # fmt: skip
        n = len(seq.prompt_token_ids)
        self._inflight.add(req.request_id, stream, seq.params.stop, n, req.logprobs)
        return n

    def _set_policy(self, policy: CachePolicy, source: str, version: str | None, name: str | None) -> None:
        self.engine.set_policy(policy, source=source, version=version, name=name)  # logs the swap
        self.policy_snapshot = (self.engine.policy, dict(self.engine.policy_info))
        self.stats_snapshot = dict(self.engine.stats())
