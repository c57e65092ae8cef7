"""uvicorn's h11 protocol with the two things an ASGI app cannot do itself: a deadline on the request head, and the
HTTP parser's own errors in OpenAI's error body.

uvicorn has a keep-alive timeout, but it is cancelled by any byte received, and a fresh connection has none: a
client that sends a head a byte at a time, or nothing at all, held its connection for as long as it liked. Here each
connection that waits for a request head (fresh, or idle after a response) gets ``--header-timeout-s`` to send it
whole; one that sent part of a head then gets a 408, one that sent nothing is closed without a word. After a
response that was sent before its request's body was read in full (a 401 or a 413 by Content-Length), the rest of the
body gets ``--body-timeout-s`` to arrive. While the app holds a request, the deadline is the app's
(``middleware.RequestGuard`` reads the body with its own).

A request the parser refuses (a bad chunk size, a Content-Length past any number, a NUL byte in a header, anything
that is not HTTP/1.1) got uvicorn's plain-text 400; here it gets OpenAI's body, and both are counted in
``confkv:request_errors`` (kinds ``bad_request`` and ``timeout``).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from confkv.server.errors import error_body, error_kind

if TYPE_CHECKING:
    from confkv.server.state import ServerState

_REASONS = {400: "Bad Request", 408: "Request Timeout"}


class GuardedH11Protocol(H11Protocol):
    """See the module docstring; :func:`protocol_for` binds it to a server's settings and metrics."""

    state: ServerState

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None
        super().connection_made(transport)
        self._update_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """The parser refused the request: OpenAI's 400, unless a response is already on its way (then only close)."""
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.close()
            return
        self._answer(400, "the request is not valid HTTP/1.1 (its request line, a header, or its chunked framing)",
                     "invalid_http")  # fmt: skip

    # ------------------------------------------------------------------------------------------------ deadlines
    def _update_deadline(self) -> None:
        """Arm the deadline of what the connection waits for now (a head, or the rest of an answered body)."""
        if self.transport.is_closing():
            self._set_deadline(None)
            return
        idle = self.cycle is None or self.cycle.response_complete
        state = self.conn.their_state
        if idle and state is h11.IDLE:
            self._set_deadline("head")
        elif idle and state is h11.SEND_BODY:
            self._set_deadline("body")
        else:
            self._set_deadline(None)

    def _set_deadline(self, waiting_for: str | None) -> None:
        if waiting_for == self._waiting_for:
            return  # a deadline runs from when the wait began, not from the last byte
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting_for = waiting_for
        if waiting_for is not None:
            settings = self.state.settings
            timeout = settings.header_timeout_s if waiting_for == "head" else settings.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._expired, waiting_for)

    def _expired(self, waiting_for: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if waiting_for == "head" and self.conn.trailing_data[0]:
            timeout = self.state.settings.header_timeout_s
            self._answer(408, f"the request head did not arrive within {timeout:g} s", "request_timeout")
        else:  # nothing of a new request, or the rest of a body already answered: nobody waits for a reply
            self.transport.close()

    def _answer(self, status: int, message: str, code: str) -> None:
        """Write an error response outside h11's state machine (the connection ends with it) and count it."""
        self.state.metrics.error(error_kind(status))
        body = json.dumps(error_body(status, message, code=code)).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode("ascii") + body)
        self.transport.close()


def protocol_for(state: ServerState) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn runs (``uvicorn.Config(http=...)``) for the server of ``state``."""
    return type("ConfkvH11Protocol", (GuardedH11Protocol,), {"state": state})
