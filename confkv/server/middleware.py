"""What stands between a parsed request head and the routes: :class:`RequestGuard`, one ASGI middleware that answers,
in this order and before any route or body parser runs:

1. 401 on ``/v1/*`` without the API key (``--api-key``): nothing about the body is answered to a client without it;
2. 413 for a body over ``--max-body-bytes``, by Content-Length or while a chunked body is read;
3. 408 for a body not complete ``--body-timeout-s`` after the head (the connection then closes);
4. 400 for a JSON body that is not UTF-8, or that nests arrays and objects deeper than :data:`MAX_JSON_DEPTH`
   (``json.loads`` recurses once per level and raises ``RecursionError`` near 1,000: found by a scan of the raw
   bytes, :func:`json_too_deep`, before anything parses it).

The whole body is read here (it is at most ``--max-body-bytes``) and replayed to the app, so every route sees a body
that is complete, bounded and safe to parse; after the body, ``receive`` is the server's own, and tells the route
when its client disconnects. The HTTP parser's own errors and the request head's timeout are answered a layer below,
by ``http11.py``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import TYPE_CHECKING

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from confkv.server.errors import error_body, error_kind, not_json

if TYPE_CHECKING:
    from confkv.server.state import ServerState

#: The deepest nesting of arrays and objects a JSON body may have. Every request confkv serves nests 5 levels or
#: fewer (a chat message's content parts); the rest of the room is for what clients send and confkv ignores.
MAX_JSON_DEPTH = 64

_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``body`` opens more than ``limit`` arrays or objects inside one another, counting only
    brackets outside strings; every step runs at C speed, so a 4 MiB body takes milliseconds whatever its shape.

    Escaped backslashes and quotes are dropped first, so the quotes left delimit strings and every other piece
    between them lies outside one. The depth at each bracket outside is the running sum of +1 per opening and -1 per
    closing one, and a parser recurses as deep as its highest point: brackets never closed count too (past a stray
    closing bracket the sum may read low, but a parser stops there).
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(text.split(b'"')[::2]).translate(_AS_SQUARE, _NOT_BRACKETS)
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = (codes == ord("[")).astype(np.int32) - (codes == ord("]"))
    return bool(steps.size) and int(np.cumsum(steps).max()) > limit


def key_matches(authorization: bytes | None, api_key: str) -> bool:
    """``Authorization: Bearer KEY`` with this key (compared as bytes, in constant time)."""
    scheme, _, token = (authorization or b"").partition(b" ")
    return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), api_key.encode())


class _Refusal(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _ClientGone(Exception):
    pass


class RequestGuard:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = self.state.settings
        headers = dict(scope.get("headers", []))
        key = settings.api_key
        if key is not None and scope["path"].startswith("/v1/") and not key_matches(headers.get(b"authorization"), key):
            message = "missing or incorrect API key (send 'Authorization: Bearer KEY')"
            await self._refuse(send, 401, message, "invalid_api_key", close=False)
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            await self._refuse(send, 413, self._too_large(), "request_too_large", close=False)
            return
        if b"transfer-encoding" not in headers and (length is None or length.strip(b"0") == b""):
            await self.app(scope, receive, send)  # no body to read
            return
        try:
            body = await self._read_body(receive)
            if not_json(headers.get(b"content-type", b"").decode("latin-1")) is None:
                self._check_json(body)
        except _ClientGone:
            return
        except _Refusal as refusal:
            await self._refuse(send, refusal.status, refusal.message, refusal.code, close=refusal.status == 408)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"request body is larger than {self.state.settings.max_body_bytes} bytes"

    async def _read_body(self, receive: Receive) -> bytes:
        settings = self.state.settings
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.body_timeout_s
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise _Refusal(
                    408, f"the request body did not arrive within {settings.body_timeout_s:g} s", "request_timeout"
                ) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise _Refusal(413, self._too_large(), "request_too_large")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    @staticmethod
    def _check_json(body: bytes) -> None:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as err:
            raise _Refusal(
                400, f"the request body is not valid UTF-8 text (byte {err.start}); send JSON as UTF-8", "invalid_json"
            ) from None
        if json_too_deep(body):
            raise _Refusal(
                400, f"the request body's JSON is nested more than {MAX_JSON_DEPTH} levels deep", "invalid_json"
            )

    async def _refuse(self, send: Send, status: int, message: str, code: str, *, close: bool) -> None:
        """Answer in OpenAI's body and count it; ``close`` ends the connection (a body never read in full)."""
        self.state.metrics.error(error_kind(status))
        body = json.dumps(error_body(status, message, code=code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
