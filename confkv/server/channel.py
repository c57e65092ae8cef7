"""What passes between the HTTP side and the engine thread: the request handed over (:class:`GenerateRequest`), the
events sent back on its queue (:class:`Event`, through :class:`RequestStream`), and the errors that refuse it before
any stream starts (the engine's ``ConfkvError``, with ``SessionBusy`` for a session whose turn is running, and
:class:`EngineUnavailable`).

Results flow back per request through an ``asyncio.Queue`` owned by the HTTP side's event loop, fed with
``loop.call_soon_threadsafe`` (the only thread-safe way into an asyncio queue); the add's outcome comes back on a
``concurrent.futures`` future, so a bad request is answered before any stream starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from dataclasses import dataclass, field
from typing import Any


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
