"""Reading a request's events off its queue: server-sent events for a streamed request, one collected answer for a
non-streamed one. Either way a request whose client has gone is aborted in the engine, so its KV blocks are freed
at once rather than when it would have finished."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive

from confkv.server.engine_thread import EngineThread, Event, RequestStream
from confkv.server.errors import error_body


async def next_event(
    stream: RequestStream, getter: asyncio.Future[Event] | None, gone: asyncio.Future[None] | None
) -> tuple[Event | None, asyncio.Future[Event]]:
    """The next event, or None as soon as ``gone`` (the client's disconnect, when given) is done."""
    if getter is None:
        getter = asyncio.ensure_future(stream.queue.get())
    done, _ = await asyncio.wait({getter} if gone is None else {getter, gone}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result(), asyncio.ensure_future(stream.queue.get())
    getter.cancel()
    return None, getter


async def disconnected(receive: Receive) -> None:
    """Return once the client has gone: the body has been read, so the only message left is ``http.disconnect``."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect(et: EngineThread, stream: RequestStream, request: Request) -> tuple[str, list[Event], Event] | None:
    """Wait for a whole non-streamed request; abort it (and return None) the moment its client hangs up.

    The disconnect is watched by a task waiting on ``receive`` rather than polled between events: a request that
    yields a token every few milliseconds would never leave a quiet quarter-second to poll in."""
    parts: list[str] = []
    events: list[Event] = []
    getter = None
    gone = asyncio.ensure_future(disconnected(request.receive))
    try:
        while True:
            ev, getter = await next_event(stream, getter, gone)
            if ev is None:
                return None
            parts.append(ev.text)
            events.append(ev)
            if ev.finished:
                stream.finished = True
                getter.cancel()
                return "".join(parts), events, ev
    finally:
        gone.cancel()
        if not stream.finished:
            et.abort(stream.request_id)
            if getter is not None:
                getter.cancel()


def engine_failure(ev: Event) -> JSONResponse:
    """The 500 of a request the engine failed (already counted: by the engine, kind ``engine_<kind>``, or, when
    ``step()`` raised, by the thread, kind ``engine``)."""
    body = error_body(500, f"the engine failed this request: {ev.error}", code="engine_error")
    return JSONResponse(body, status_code=500)


def sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump_json(exclude_none=True) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


async def stream_events(
    et: EngineThread,
    stream: RequestStream,
    make_chunk: Callable[[Event], BaseModel],
    usage_chunk: Callable[[Event], BaseModel] | None,
) -> AsyncIterator[str]:
    """The request's chunks as server-sent events, a usage chunk when asked, then ``[DONE]``; an engine failure is
    an error event in OpenAI's body."""
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
