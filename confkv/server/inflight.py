"""The requests in flight on the engine thread, and how each step's outputs become their events.

Each admitted request is held here with its incremental detokenizer and timings until it finishes, is aborted, or
fails; the per-token and per-request metrics (TTFT, inter-token and end-to-end latency, signals, finish reasons) are
observed here as the outputs are turned into :class:`~confkv.server.channel.Event` s. Used only from the engine
thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confkv.server.channel import Event, RequestStream, TokenLogprob
from confkv.server.detok import IncrementalDetokenizer
from confkv.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from confkv.engine.engine import LLMEngine, StepOutput

log = logging.getLogger("confkv.server.engine_thread")


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


class InFlight:
    """The engine thread's requests in flight, keyed by request id."""

    def __init__(self, tokenizer: Any, metrics: ServerMetrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._live: dict[str, _Live] = {}

    def __len__(self) -> int:
        return len(self._live)

    def ids(self) -> list[str]:
        return list(self._live)

    def add(self, request_id: str, stream: RequestStream, stop: list[str], prompt_tokens: int,
            logprobs: int | None) -> None:  # fmt: skip
        """Hold a request the engine has just taken."""
        self._live[request_id] = _Live(
            stream=stream,
            detok=IncrementalDetokenizer(self.tokenizer, stop),
            arrival=time.perf_counter(),
            prompt_tokens=prompt_tokens,
            logprobs=logprobs,
        )
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(prompt_tokens)

    def abort(self, engine: LLMEngine, request_id: str) -> None:
        """Abort a request in the engine and end its stream with ``finish_reason: "abort"`` and what it got."""
        live = self._live.pop(request_id, None)
        out = engine.abort_request(request_id)
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

    def dispatch(self, outs: list[StepOutput]) -> None:
        """Turn one step's outputs into events on their requests' streams (a finished request leaves)."""
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

    def fail_all(self, engine: LLMEngine, message: str, reason: str = "error") -> None:
        """End every request in flight: as errors (``message``) after an engine bug, as aborts at shutdown."""
        for rid, live in list(self._live.items()):
            try:
                engine.abort_request(rid)
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
