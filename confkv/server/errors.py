"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, for every failure a client sees.

:class:`APIError` is raised anywhere in a route; the handlers installed by :func:`install_error_handlers` turn it,
FastAPI's validation errors, Starlette's HTTP errors (404, 405, 413) and any unexpected exception (500) into that
body, and count each under ``confkv:request_errors{kind}`` (:func:`error_kind`: a client kind for every 4xx,
``internal`` only for a 5xx).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from confkv.server import protocol as P
from confkv.server.metrics import ServerMetrics

log = logging.getLogger("confkv.server.app")

_STATUS_KIND = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "bad_request",
    408: "timeout",
    409: "conflict",
    413: "too_large",
    422: "bad_request",
}
_STATUS_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere in a route to answer with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


#: OpenAI's ``code`` of the errors Starlette and FastAPI raise themselves (a body FastAPI could not parse, an unknown
#: path, a method the path does not take)
_HTTP_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}


def allowed_methods(request: Request) -> list[str]:
    """Every method some route on the request's path takes (a path served by several routes, one per method), from
    the table ``create_app`` keeps in ``app.state.route_methods``."""
    methods: set[str] = set()
    for pattern, route_methods in request.app.state.route_methods:
        if pattern.fullmatch(request.url.path):
            methods |= route_methods
    return sorted(methods)


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


def not_json(content_type: str | None) -> str | None:
    """Why a body of this Content-Type is refused, or None when FastAPI reads it as JSON (``application/json`` or
    ``application/*+json``)."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return None
    got = content_type[:100] if content_type else "no Content-Type"
    return f"the request body must be JSON, sent with 'Content-Type: application/json' (got {got})"


def param_of(loc: tuple[Any, ...]) -> str | None:
    """OpenAI's ``param`` for a pydantic error location (``("body", "messages", 0)`` -> ``messages.0``)."""
    parts = [str(x) for x in loc if x != "body"]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Answer every error raised while handling a request with OpenAI's body, counted once."""

    def respond(
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
        return respond(err.status, err.message, param=err.param, code=err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return respond(400, "request body is not valid JSON", code="invalid_json")
        if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
            return respond(400, "request body is missing", code="invalid_request")
        if tuple(first.get("loc", ())) == ("body",):  # the body as a whole is not an object
            if (refusal := not_json(request.headers.get("content-type"))) is not None:
                return respond(400, refusal, code="invalid_content_type")
            return respond(400, "the request body must be a JSON object", code="invalid_request")
        parts = []
        for e in errors[:5]:
            param = param_of(tuple(e.get("loc", ())))
            msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
            parts.append(f"{param}: {msg}" if param else msg)
        param = param_of(tuple(first.get("loc", ())))
        return respond(400, "; ".join(parts), param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        headers = dict(err.headers or {})
        if err.status_code == 405:  # Starlette's Allow names the first route on the path only
            headers["Allow"] = ", ".join(allowed_methods(request))
        return respond(err.status_code, str(err.detail), code=_HTTP_CODES.get(err.status_code), headers=headers)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return respond(500, f"internal error: {type(err).__name__}", code="internal_error")
