"""The HTTP side assembled: FastAPI with confkv's routers, error handlers and middleware.

The request path is one-way: HTTP -> protocol validation (``protocol.py``) -> the engine thread's inbox -> the
scheduler ... -> the request's queue -> SSE or one JSON body (``streaming.py``). Nothing here touches the engine
directly; policy swaps travel the same inbox, so they always land between two steps.

Every failure a client can cause is a 4xx with OpenAI's error body ``{"error": {"message", "type", "param",
"code"}}`` (``errors.py``): malformed JSON, a body not sent as JSON, wrong types and out-of-range values (400), a
missing or wrong API key (401), an unknown model or session (404), a method the route does not take (405), a turn for
a session that already has one running (409), a body over the limit (413, by Content-Length or while a chunked body
is read), a bad cache policy on ``PUT /v1/cache_policy`` (422); 503 while draining or when the engine thread is gone.
A 500 means a bug in confkv, never bad input. Every 4xx is counted under a client kind of ``confkv:request_errors``,
never ``internal``.

The routes live by family in ``routes/`` (``openai``, ``policy``, ``sessions``, ``ops``); what they share in
``state.py``. Before any of them, ``middleware.py`` checks the API key and reads the body (its size, its time, its
JSON's encoding and depth), and below that ``http11.py`` answers the HTTP parser's own errors and slow request heads,
all in the same error body.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from starlette.routing import Route

from confkv.server.errors import APIError, install_error_handlers
from confkv.server.middleware import RequestGuard
from confkv.server.openapi import install_openapi
from confkv.server.routes import openai, ops, policy, sessions
from confkv.server.state import ServerState

__all__ = ["APIError", "ServerState", "create_app"]


def create_app(state: ServerState, lifespan: Callable[[FastAPI], Any] | None = None) -> FastAPI:
    """Build the FastAPI app over a started (or about to be started, by ``lifespan``) engine thread."""
    app = FastAPI(title="confkv", version="0.1.0", lifespan=lifespan)
    app.state.confkv = state
    install_error_handlers(app, state.metrics)
    install_openapi(app, state.settings.served_model_name)
    app.add_middleware(RequestGuard, state=state)
    routes = [route for route in app.router.routes if isinstance(route, Route)]  # FastAPI's own: /openapi.json ...
    for module in (ops, openai, policy, sessions):
        app.include_router(module.router)
        routes += [route for route in module.router.routes if isinstance(route, Route)]
    app.state.route_methods = [(route.path_regex, set(route.methods or ())) for route in routes]  # for a 405's Allow
    return app
