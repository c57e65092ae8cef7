"""The HTTP side: FastAPI routes in OpenAI's shapes, server-sent events, health, metrics and the policy API.

The request path is one-way: HTTP -> protocol validation (``protocol.py``) -> the engine thread's inbox -> the
scheduler ... -> the request's queue -> SSE or one JSON body. Nothing here touches the engine directly; policy swaps
travel the same inbox, so they always land between two steps.

Every failure a client can cause is a 4xx with OpenAI's error body ``{"error": {"message", "type", "param",
"code"}}``: malformed JSON, a body not sent as JSON, wrong types and out-of-range values (400), a missing or wrong
API key (401), an unknown model or session (404), a method the route does not take (405), a turn for a session that
already has one running (409), a body over the limit (413, by Content-Length or while a chunked body is read), a bad
cache policy on ``PUT /v1/cache_policy`` (422); 503 while draining or when the engine thread is gone. A 500 means a
bug in confkv, never bad input. Every 4xx is counted under a client kind of ``confkv:request_errors`` (one of
``_STATUS_KIND``, else ``bad_request``), never ``internal``.

Sessions: the ``session_id`` body field goes to the engine with the request; ``DELETE /v1/sessions/{id}`` forgets a
session in the engine's memory (through the engine thread's inbox, like everything that touches the engine) and in
the object store (called from a worker thread here: the store is thread-safe, and its answer says whether the
record existed).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from confkv.config import CachePolicy, format_validation_error
from confkv.errors import ConfkvError
from confkv.server import protocol as P
from confkv.server.engine_thread import (
    EngineThread,
    EngineUnavailable,
    Event,
    GenerateRequest,
    RequestRejected,
    RequestStream,
)
from confkv.server.metrics import ServerMetrics
from confkv.server.settings import ServerSettings
from confkv.sessions.errors import SessionStoreError
from confkv.sessions.store import check_session_id

log = logging.getLogger(__name__)

_STATUS_KIND = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "bad_request",
    409: "conflict",
    413: "too_large",
    422: "bad_request",
}
_STATUS_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
}
_DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """Raised anywhere in a route to answer with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ServerState:
    """What the routes share: the engine thread, metrics, settings, and the draining flag SIGTERM sets."""

    def __init__(self, engine_thread: EngineThread, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine_thread = engine_thread
        self.settings = settings
        self.metrics = metrics
        self.draining = False
        self.started = int(time.time())

    def healthy(self) -> bool:
        return not self.draining and self.engine_thread.healthy(self.settings.health_stale_s)


def error_kind(status: int) -> str:
    """The ``confkv:request_errors`` kind of an answer: a client kind for every 4xx, ``internal`` only for a 5xx."""
    if status in _STATUS_KIND:
        return _STATUS_KIND[status]
    if 400 <= status < 500:
        return "bad_request"
    return "unavailable" if status == 503 else "internal"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    etype = _STATUS_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return P.ErrorResponse(error=P.ErrorDetail(message=message, type=etype, param=param, code=code)).model_dump()


class BodyLimitMiddleware:
    """Refuse request bodies over ``limit`` bytes with 413, by Content-Length or while reading a chunked body.

    A chunked body (no Content-Length) is cut off by raising :class:`_BodyTooLarge` from ``receive``: an
    ``HTTPException``, so FastAPI's body parsing passes it on (any other exception there becomes its generic 400
    "There was an error parsing the body") and the app's handler answers the 413. Should it escape the app before
    a response started, it is answered here.
    """

    def __init__(self, app: ASGIApp, limit: int, on_refuse: Callable[[], None]) -> None:
        self.app, self.limit, self.on_refuse = app, limit, on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(send)
                return
        seen = 0
        too_big = False
        started = False

        async def limited_receive() -> Message:
            nonlocal seen, too_big
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    too_big = True
                    raise _BodyTooLarge(self.limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(send)
        except Exception:
            if too_big and not started:
                await self._refuse(send)
            else:
                raise

    async def _refuse(self, send: Send) -> None:
        self.on_refuse()
        body = json.dumps(error_body(413, _BodyTooLarge(self.limit).detail, code="request_too_large")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(StarletteHTTPException):
    """A chunked body went over the limit while it was read (see :class:`BodyLimitMiddleware`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes")


def _not_json(content_type: str | None) -> str | None:
    """Why a body of this Content-Type is refused, or None when FastAPI reads it as JSON (``application/json`` or
    ``application/*+json``)."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return None
    got = content_type[:100] if content_type else "no Content-Type"
    return f"the request body must be JSON, sent with 'Content-Type: application/json' (got {got})"


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts = [str(x) for x in loc if x != "body"]
    return ".".join(parts) or None


def _param_from_message(message: str) -> str | None:
    """Best guess at the request field an engine-side ``ConfkvError`` is about (OpenAI's ``param``)."""
    for key, param in (
        ("cache policy", "cache_policy"),
        ("policy override", "cache_policy"),
        ("max_tokens", "max_tokens"),
        ("logprobs", "logprobs"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop", "stop"),
        ("prompt", "prompt"),
    ):
        if key in message:
            return param
    return None


def create_app(state: ServerState, lifespan: Callable[[FastAPI], Any] | None = None) -> FastAPI:
    """Build the FastAPI app over a started (or about to be started, by ``lifespan``) engine thread."""
    settings, metrics, et = state.settings, state.metrics, state.engine_thread
    app = FastAPI(title="confkv", version="0.1.0", lifespan=lifespan)
    app.state.confkv = state

    def respond_error(
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> JSONResponse:
        metrics.error(error_kind(status))
        return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return respond_error(err.status, err.message, param=err.param, code=err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return respond_error(400, "request body is not valid JSON", code="invalid_json")
        if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
            return respond_error(400, "request body is missing", code="invalid_request")
        if tuple(first.get("loc", ())) == ("body",):  # the body as a whole is not an object
            if (refusal := _not_json(request.headers.get("content-type"))) is not None:
                return respond_error(400, refusal, code="invalid_content_type")
            return respond_error(400, "the request body must be a JSON object", code="invalid_request")
        parts = []
        for e in errors[:5]:
            param = _param_of(tuple(e.get("loc", ())))
            msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
            parts.append(f"{param}: {msg}" if param else msg)
        param = _param_of(tuple(first.get("loc", ())))
        return respond_error(400, "; ".join(parts), param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        if isinstance(err, _BodyTooLarge):  # a chunked body over the limit, cut off while it was read
            return respond_error(413, err.detail, code="request_too_large")
        return respond_error(err.status_code, str(err.detail), headers=err.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return respond_error(500, f"internal error: {type(err).__name__}", code="internal_error")

    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes, on_refuse=lambda: metrics.error("too_large"))

    async def require_key(request: Request) -> None:
        if settings.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        # compared as bytes: compare_digest refuses str with non-ASCII characters (a header is read as latin-1)
        given, key = token.strip().encode("latin-1", "replace"), settings.api_key.encode()
        if scheme.lower() != "bearer" or not secrets.compare_digest(given, key):
            raise APIError(
                401, "missing or incorrect API key (send 'Authorization: Bearer KEY')", code="invalid_api_key"
            )

    auth = [Depends(require_key)]

    # ------------------------------------------------------------------------------------------------ operations
    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not et.healthy(settings.health_stale_s):
            reason = et.fatal or ("engine thread not running" if not et.alive else "engine step is stuck")
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> dict[str, Any]:
        card = P.ModelCard(id=settings.served_model_name, created=state.started, max_model_len=et.max_model_len)
        return P.ModelList(data=[card]).model_dump()

    # ------------------------------------------------------------------------------------------------ policy API
    def policy_doc() -> dict[str, Any]:
        policy, info = et.policy_snapshot
        return {**info, "policy": policy.model_dump(mode="json")}

    @app.get("/v1/cache_policy", dependencies=auth)
    async def get_cache_policy() -> dict[str, Any]:
        return policy_doc()

    @app.put("/v1/cache_policy", dependencies=auth)
    async def put_cache_policy(request: Request) -> dict[str, Any]:
        if (refusal := _not_json(request.headers.get("content-type"))) is not None:  # POST: through the body model
            raise APIError(400, refusal, code="invalid_content_type")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
        if isinstance(body, dict) and set(body) == {"cache_policy"} and isinstance(body["cache_policy"], dict):
            body = body["cache_policy"]
        if not isinstance(body, dict):
            raise APIError(422, "the body must be a JSON object of cache-policy keys", code="invalid_value")
        if (refused := P.policy_type_error(body)) is not None:  # strict types, as every request field
            raise APIError(422, refused[0], param=refused[1], code="invalid_value")
        current = et.policy_snapshot[0]
        values = {"block_size": current.block_size, **body}  # block_size cannot change while serving
        try:
            policy = CachePolicy(**values)
        except ValidationError as err:
            first = err.errors()[0]
            param = _param_of(tuple(first.get("loc", ()))) or _param_from_policy_message(first.get("msg", ""))
            raise APIError(
                422, format_validation_error(err, "cache policy"), param=param, code="invalid_value"
            ) from None
        version = hashlib.sha256(policy.model_dump_json().encode()).hexdigest()[:12]
        if state.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        try:
            await _await(et.set_policy(policy, source="api", version=version))
        except ConfkvError as err:
            raise APIError(422, str(err), param=_param_from_policy_message(str(err)), code="invalid_value") from None
        except EngineUnavailable as err:
            raise APIError(503, f"the engine is not available: {err}", code="engine_unavailable") from None
        except TimeoutError:
            raise APIError(503, "the engine did not answer in time; the policy may still be applied (GET "
                           "/v1/cache_policy says)", code="engine_unavailable") from None  # fmt: skip
        return policy_doc()

    # -------------------------------------------------------------------------------------------- generation
    def check_request(body: P._SamplingFields, unsupported: tuple[str, str] | None) -> None:
        if body.model != settings.served_model_name:
            raise APIError(
                404,
                f"model {body.model!r} is not served here; this server serves {settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        if unsupported is not None:
            param, message = unsupported
            raise APIError(400, message, param=param, code="unsupported_parameter")

    async def admit(req: GenerateRequest) -> RequestStream:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        try:
            stream = et.submit(req, asyncio.get_running_loop())
        except EngineUnavailable as err:
            raise APIError(503, f"the engine is not available: {err}", code="engine_unavailable") from None
        try:
            await asyncio.shield(asyncio.wrap_future(stream.accepted))
        except RequestRejected as err:
            raise APIError(err.status, str(err), param=err.param, code=err.code) from None
        except ConfkvError as err:
            raise APIError(400, str(err), param=_param_from_message(str(err)), code="invalid_value") from None
        except EngineUnavailable as err:
            raise APIError(503, f"the engine is not available: {err}", code="engine_unavailable") from None
        except asyncio.CancelledError:
            et.abort(req.request_id)
            raise
        return stream

    async def next_event(
        stream: RequestStream, getter: asyncio.Future[Event] | None, disconnected: Callable[[], Awaitable[bool]] | None
    ) -> tuple[Event | None, asyncio.Future[Event]]:
        """The next event, or None once the client has gone (checked every quarter second when a probe is given)."""
        if getter is None:
            getter = asyncio.ensure_future(stream.queue.get())
        while True:
            done, _ = await asyncio.wait({getter}, timeout=_DISCONNECT_POLL_S if disconnected else None)
            if done:
                return getter.result(), asyncio.ensure_future(stream.queue.get())
            if disconnected is not None and await disconnected():
                getter.cancel()
                return None, getter

    async def collect(stream: RequestStream, request: Request) -> tuple[str, list[Event], Event] | None:
        """Wait for a whole non-streamed request; abort it (and return None) if the client hangs up meanwhile."""
        parts: list[str] = []
        events: list[Event] = []
        getter = None
        try:
            while True:
                ev, getter = await next_event(stream, getter, request.is_disconnected)
                if ev is None:
                    return None
                parts.append(ev.text)
                events.append(ev)
                if ev.finished:
                    stream.finished = True
                    getter.cancel()
                    return "".join(parts), events, ev
        finally:
            if not stream.finished:
                et.abort(stream.request_id)
                if getter is not None:
                    getter.cancel()

    def engine_failure(ev: Event) -> JSONResponse:
        # already counted: by the engine (kind="engine_<kind>") or, when step() raised, by the thread (kind="engine")
        body = error_body(500, f"the engine failed this request: {ev.error}", code="engine_error")
        return JSONResponse(body, status_code=500)

    def sse(obj: BaseModel | dict[str, Any]) -> str:
        data = obj.model_dump_json(exclude_none=True) if isinstance(obj, BaseModel) else json.dumps(obj)
        return f"data: {data}\n\n"

    async def stream_events(
        stream: RequestStream,
        make_chunk: Callable[[Event], BaseModel],
        usage_chunk: Callable[[Event], BaseModel] | None,
    ) -> AsyncIterator[str]:
        getter = None
        try:
            while True:
                ev, getter = await next_event(stream, getter, None)
                assert ev is not None
                if ev.error is not None:
                    stream.finished = True
                    yield sse(error_body(500, f"the engine failed this request: {ev.error}", code="engine_error"))
                    break
                if ev.text or ev.logprobs or ev.finished:
                    yield sse(make_chunk(ev))
                if ev.finished:
                    stream.finished = True
                    if usage_chunk is not None:
                        yield sse(usage_chunk(ev))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if getter is not None:
                getter.cancel()
            if not stream.finished:  # the client went away mid-stream: free its sequence now
                et.abort(stream.request_id)

    def streaming_response(gen: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def generate(
        body: P.CompletionRequest | P.ChatCompletionRequest,
        request: Request,
        req: GenerateRequest,
        chunk_type: type[P.CompletionChunk] | type[P.ChatCompletionChunk],
        make_chunk: Callable[[dict[str, Any], Event], BaseModel],
        make_response: Callable[[dict[str, Any], str, list[Event], Event], BaseModel],
    ) -> Response:
        """Admit ``req`` and answer it: server-sent ``make_chunk`` chunks (and a usage chunk when asked) if the body
        streams, else one ``make_response`` over the whole text; 499 when the client left, 500 when the engine
        failed the request. Both builders get the fields every chunk and response share (id, created, model,
        session_id)."""
        stream = await admit(req)
        env = {"id": req.request_id, "created": int(time.time()), "model": settings.served_model_name,
               "session_id": body.session_id}  # fmt: skip
        if body.stream:

            def usage(ev: Event) -> BaseModel:
                return chunk_type(**env, choices=[], usage=usage_of(ev))

            chunk = functools.partial(make_chunk, env)
            return streaming_response(stream_events(stream, chunk, usage if body.include_usage else None))
        done = await collect(stream, request)
        if done is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        text, events, last = done
        if last.error is not None:
            return engine_failure(last)
        return JSONResponse(make_response(env, text, events, last).model_dump(exclude_none=True))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        check_request(body, body.unsupported())
        try:
            prompt = body.single_prompt()
        except ValueError as err:
            raise APIError(400, str(err), param="prompt", code="invalid_value") from None
        # OpenAI's default of 16, within --max-tokens-limit: a value the client never sent must not be refused
        max_tokens = body.max_tokens if body.max_tokens is not None else min(16, et.max_tokens_limit)
        req = GenerateRequest(
            request_id=P.new_id("cmpl"),
            sampling=body.sampling_kwargs(max_tokens),
            prompt=prompt,
            logprobs=body.logprobs,
            policy_overrides=body.cache_policy,
            session_id=body.session_id,
        )
        offset = [0]  # the streamed text's length so far, for text_offset

        def chunk(env: dict[str, Any], ev: Event) -> P.CompletionChunk:
            lp = _completion_logprobs(ev, offset) if body.logprobs is not None else None
            choice = P.CompletionChoice(text=ev.text, logprobs=lp, finish_reason=ev.finish_reason)
            return P.CompletionChunk(**env, choices=[choice])

        def response(env: dict[str, Any], text: str, events: list[Event], last: Event) -> P.CompletionResponse:
            lp = None
            if body.logprobs is not None:
                lp, at = P.CompletionLogprobs(top_logprobs=[]), [0]
                for ev in events:
                    part = _completion_logprobs(ev, at)
                    lp.tokens += part.tokens
                    lp.token_logprobs += part.token_logprobs
                    lp.top_logprobs += part.top_logprobs or []
                    lp.text_offset += part.text_offset
            choice = P.CompletionChoice(text=text, logprobs=lp, finish_reason=last.finish_reason)
            return P.CompletionResponse(**env, choices=[choice], usage=usage_of(last), kv=last.kv)

        return await generate(body, request, req, P.CompletionChunk, chunk, response)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        check_request(body, body.unsupported())
        req = GenerateRequest(
            request_id=P.new_id("chatcmpl"),
            sampling=body.sampling_kwargs(body.requested_max_tokens()),
            messages=body.template_messages(),
            logprobs=body.num_logprobs(),
            policy_overrides=body.cache_policy,
            session_id=body.session_id,
        )
        want_lp = body.logprobs
        first = [True]

        def chunk(env: dict[str, Any], ev: Event) -> P.ChatCompletionChunk:
            delta = P.DeltaMessage(role="assistant" if first[0] else None, content=ev.text)
            first[0] = False
            lp = P.ChatLogprobs(content=_chat_logprobs(ev)) if want_lp and ev.logprobs else None
            choice = P.ChatChunkChoice(delta=delta, logprobs=lp, finish_reason=ev.finish_reason)
            return P.ChatCompletionChunk(**env, choices=[choice])

        def response(env: dict[str, Any], text: str, events: list[Event], last: Event) -> P.ChatCompletionResponse:
            lp = P.ChatLogprobs(content=[t for ev in events for t in _chat_logprobs(ev)]) if want_lp else None
            message = P.AssistantMessage(content=text)
            choice = P.ChatChoice(message=message, logprobs=lp, finish_reason=last.finish_reason)
            return P.ChatCompletionResponse(**env, choices=[choice], usage=usage_of(last), kv=last.kv)

        return await generate(body, request, req, P.ChatCompletionChunk, chunk, response)

    # ---------------------------------------------------------------------------------------------- sessions
    @app.delete("/v1/sessions/{session_id}", dependencies=auth)
    async def delete_session(session_id: str) -> dict[str, Any]:
        """Forget a session everywhere: 200 with where it was found, 404 if neither the engine's memory nor the store
        held it, 400 for an id that cannot name a session, 503 if the store could not be reached (the memory tiers
        are cleared by then; DELETE is idempotent, so the client retries)."""
        try:
            check_session_id(session_id)
        except ConfkvError as err:
            raise APIError(400, str(err), param="session_id", code="invalid_session_id") from None
        store = et.session_store
        run = asyncio.get_running_loop().run_in_executor
        in_store, store_error = False, None
        if store is not None:  # asked first: the engine queues a deletion on its own writer, which may run before ours
            try:
                in_store = await run(None, store.exists, session_id)
            except SessionStoreError as err:
                store_error = err
        try:
            in_memory = await _await(et.delete_session(session_id))
        except EngineUnavailable as err:
            raise APIError(503, f"the engine is not available: {err}", code="engine_unavailable") from None
        if store is not None and store_error is None:  # deleted here too: gone from the store when we answer
            try:
                in_store = await run(None, store.delete, session_id) or in_store
            except SessionStoreError as err:
                store_error = err
        if store_error is not None:
            raise APIError(
                503,
                f"session {session_id!r} was removed from memory, but the session store did not answer "
                f"({store_error}): its record may remain there; retry the DELETE",
                code="session_store_unavailable",
            )
        if not (in_memory or in_store):
            raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
        return {"id": session_id, "object": "session.deleted", "deleted": True, "memory": in_memory, "store": in_store}

    return app


def usage_of(ev: Event) -> P.Usage:
    """OpenAI's usage block of a finished request, with the tokens its session supplied as ``cached_tokens``."""
    return P.Usage.of(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)


def _param_from_policy_message(message: str) -> str | None:
    """The policy key mentioned first in a validation message (``max_size (10) must be >= base_size`` -> max_size)."""
    hits = [(message.find(name), name) for name in CachePolicy.model_fields if name in message]
    return min(hits)[1] if hits else None


async def _await(fut: Any, timeout: float = 60.0) -> Any:
    return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)


def _chat_logprobs(ev: Event) -> list[P.ChatTokenLogprob]:
    out = []
    for t in ev.logprobs or []:
        top = [P.TopLogprob(token=s, logprob=v, bytes=list(s.encode())) for s, v in (t.top or [])]
        out.append(P.ChatTokenLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()), top_logprobs=top))
    return out


def _completion_logprobs(ev: Event, offset: list[int]) -> P.CompletionLogprobs:
    lp = P.CompletionLogprobs(top_logprobs=[])
    for t in ev.logprobs or []:
        lp.tokens.append(t.token)
        lp.token_logprobs.append(t.logprob)
        lp.top_logprobs.append(dict(t.top) if t.top else None)  # type: ignore[union-attr]
        lp.text_offset.append(offset[0])
        offset[0] += len(t.token)
    return lp
