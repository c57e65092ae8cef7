"""What stands between the socket and the routes: the request body limit (413) and the API key check (401)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from confkv.server.errors import APIError, BodyTooLarge, error_body


class BodyLimitMiddleware:
    """Refuse request bodies over ``limit`` bytes with 413, by Content-Length or while reading a chunked body.

    A chunked body (no Content-Length) is cut off by raising :class:`~confkv.server.errors.BodyTooLarge` from
    ``receive``, which the app's handler answers; should it escape the app before a response started, it is
    answered here.
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
                    raise BodyTooLarge(self.limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)
        except Exception:
            if too_big and not started:
                await self._refuse(send)
            else:
                raise

    async def _refuse(self, send: Send) -> None:
        self.on_refuse()
        body = json.dumps(error_body(413, BodyTooLarge(self.limit).detail, code="request_too_large")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def require_key(request: Request) -> None:
    """The ``/v1/*`` routes' dependency: with ``--api-key``, a request without ``Authorization: Bearer KEY`` is a
    401."""
    api_key = request.app.state.confkv.settings.api_key
    if api_key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    # compared as bytes: compare_digest refuses str with non-ASCII characters (a header is read as latin-1)
    given, key = token.strip().encode("latin-1", "replace"), api_key.encode()
    if scheme.lower() != "bearer" or not secrets.compare_digest(given, key):
        raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")
