"""OpenAI's routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

A generation request is checked (model, fields confkv cannot honour), handed to the engine thread, which admits or
refuses it before any stream starts (a refusal is a 4xx), then answered as server-sent events or as one JSON body
(``confkv.server.streaming``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from confkv.errors import ConfkvError, SessionBusy
from confkv.server import protocol as P
from confkv.server.engine_thread import EngineUnavailable, Event, GenerateRequest, RequestStream
from confkv.server.errors import APIError
from confkv.server.openapi import errors, ok
from confkv.server.state import ServerState, StateDep
from confkv.server.streaming import collect, engine_failure, stream_events, streaming_response

router = APIRouter()
#: a streamed answer: server-sent events, each ``data: CHUNK`` (a ``*.chunk`` object as JSON, or an error body), then
#: ``data: [DONE]``; the schema describes one event, as OpenAPI does for an event stream
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"type": "string", "description": "a chunk or an error as JSON, or [DONE]"}},
        }
    }
}


@router.get("/v1/models", responses={**ok(P.ModelList), **errors(401)})
async def list_models(state: StateDep) -> dict[str, Any]:
    et = state.engine_thread
    card = P.ModelCard(id=state.settings.served_model_name, created=state.started, max_model_len=et.max_model_len)
    return P.ModelList(data=[card]).model_dump()


@router.post(
    "/v1/completions",
    responses={**ok(P.CompletionResponse, media=_SSE), **errors(400, 401, 404, 408, 409, 413, 500, 503)},
)
async def completions(body: P.CompletionRequest, request: Request, state: StateDep) -> Response:
    check_request(state, body, body.unsupported())
    body.session_id = session_of(body, request)
    try:
        prompt = body.single_prompt()
    except ValueError as err:
        raise APIError(400, str(err), param="prompt", code="invalid_value") from None
    # OpenAI's default of 16, within --max-tokens-limit: a value the client never sent must not be refused
    max_tokens = body.max_tokens if body.max_tokens is not None else min(16, state.engine_thread.max_tokens_limit)
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

    return await generate(state, body, request, req, P.CompletionChunk, chunk, response)


@router.post(
    "/v1/chat/completions",
    responses={**ok(P.ChatCompletionResponse, media=_SSE), **errors(400, 401, 404, 408, 409, 413, 500, 503)},
)
async def chat_completions(body: P.ChatCompletionRequest, request: Request, state: StateDep) -> Response:
    check_request(state, body, body.unsupported())
    body.session_id = session_of(body, request)
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

    return await generate(state, body, request, req, P.ChatCompletionChunk, chunk, response)


def check_request(state: ServerState, body: P._SamplingFields, unsupported: tuple[str, str] | None) -> None:
    """404 for a model not served here, 400 for a field confkv cannot honour."""
    served = state.settings.served_model_name
    if body.model != served:
        raise APIError(
            404,
            f"model {body.model!r} is not served here; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )
    if unsupported is not None:
        param, message = unsupported
        raise APIError(400, message, param=param, code="unsupported_parameter")


#: The header that names a request's session where a router must see it without reading the body: Ray Serve's proxy
#: routes by it (``RAY_SERVE_SESSION_ID_HEADER_KEY``'s default), so ``confkv serve --replicas`` sends each session to
#: one replica (``confkv.scaleout.router``).
SESSION_HEADER = "x-session-id"


def session_of(body: P._SamplingFields, request: Request) -> str | None:
    """The request's session: the body's ``session_id``, else the ``x-session-id`` header (400 when the two differ,
    or when the header's value cannot name a session)."""
    header = request.headers.get(SESSION_HEADER)
    if header is None:
        return body.session_id
    if body.session_id is not None and body.session_id != header:
        raise APIError(400, f"session_id {body.session_id!r} and the {SESSION_HEADER} header {header!r} differ",
                       param="session_id", code="invalid_value")  # fmt: skip
    if not P.SESSION_ID_RE.fullmatch(header):
        raise APIError(400, f"the {SESSION_HEADER} header: use 1-128 letters, digits, '.', '_' or '-', starting with "
                       "a letter or digit", param="session_id", code="invalid_session_id")  # fmt: skip
    return header


async def admit(state: ServerState, req: GenerateRequest) -> RequestStream:
    """Hand ``req`` to the engine thread and wait for its verdict: the stream, or the 4xx/503 of a refusal."""
    if state.draining:
        raise APIError(503, "the server is shutting down", code="server_shutting_down")
    et = state.engine_thread
    try:
        stream = et.submit(req, asyncio.get_running_loop())
    except EngineUnavailable as err:
        raise APIError(503, f"the engine is not available: {err}", code="engine_unavailable") from None
    try:
        await asyncio.shield(asyncio.wrap_future(stream.accepted))
    except SessionBusy as err:  # a second turn cannot extend a conversation whose answer is not written yet
        raise APIError(409, str(err), param=err.param, code="session_busy") from None
    except ConfkvError as err:
        raise APIError(400, str(err), param=err.param, code="invalid_value") from None
    except EngineUnavailable as err:
        raise APIError(503, f"the engine is not available: {err}", code="engine_unavailable") from None
    except asyncio.CancelledError:
        et.abort(req.request_id)
        raise
    return stream


async def generate(
    state: ServerState,
    body: P.CompletionRequest | P.ChatCompletionRequest,
    request: Request,
    req: GenerateRequest,
    chunk_type: type[P.CompletionChunk] | type[P.ChatCompletionChunk],
    make_chunk: Callable[[dict[str, Any], Event], BaseModel],
    make_response: Callable[[dict[str, Any], str, list[Event], Event], BaseModel],
) -> Response:
    """Admit ``req`` and answer it: server-sent ``make_chunk`` chunks (and a usage chunk when asked) if the body
    streams, else one ``make_response`` over the whole text; 499 when the client left, 500 when the engine failed
    the request. Both builders get the fields every chunk and response share (id, created, model, session_id)."""
    et = state.engine_thread
    stream = await admit(state, req)
    env = {"id": req.request_id, "created": int(time.time()), "model": state.settings.served_model_name,
           "session_id": body.session_id}  # fmt: skip
    if body.stream:

        def usage(ev: Event) -> BaseModel:
            return chunk_type(**env, choices=[], usage=usage_of(ev))

        chunk = functools.partial(make_chunk, env)
        return streaming_response(stream_events(et, stream, chunk, usage if body.include_usage else None))
    done = await collect(et, stream, request)
    if done is None:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    text, events, last = done
    if last.error is not None:
        return engine_failure(last)
    return JSONResponse(make_response(env, text, events, last).model_dump(exclude_none=True))


def usage_of(ev: Event) -> P.Usage:
    """OpenAI's usage block of a finished request, with the tokens its session supplied as ``cached_tokens``."""
    return P.Usage.of(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)


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
