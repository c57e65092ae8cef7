"""The OpenAPI document (``/openapi.json``) as the server answers: every route's request body, and each status it
can answer with the schema of that answer (OpenAI's error body for every error).

FastAPI alone documented a 422 with its own validation body on the routes with a body or a path parameter (the
server answers those with a 400 in OpenAI's body), no error status at all elsewhere, and no body for
``PUT /v1/cache_policy``, which reads its own. Routes declare their statuses with :func:`errors` (their
``responses=``); :func:`install_openapi` then drops FastAPI's 422, describes the policy body, and names the one model
this server serves, so a client generated from the document sends what the server takes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from confkv.config import CachePolicy
from confkv.server import protocol as P
from confkv.sessions.store import SESSION_ID_RE

#: What each error status means, wherever a route answers it.
_MEANING = {
    400: "a malformed, mistyped or out-of-range request (body, field or parameter)",
    401: "missing or incorrect API key (only when the server runs with --api-key)",
    404: "no such model or session",
    408: "the request body did not arrive in time (--body-timeout-s)",
    409: "the session already has a request running",
    413: "the request body is over --max-body-bytes",
    422: "a cache policy that cannot be served (a value, a combination, or a learned_path not allowed)",
    500: "the engine failed this request (a bug in confkv, never bad input)",
    503: "the server is draining, or the engine is not running",
}
ERROR_SCHEMA = "#/components/schemas/ErrorResponse"
SESSION_ID_PATTERN = f"^{SESSION_ID_RE.pattern}$"


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses, each with OpenAI's error body."""
    return {status: {"model": P.ErrorResponse, "description": _MEANING[status]} for status in statuses}


def ok(model: type[BaseModel] | None = None, *, media: dict[str, Any] | None = None) -> dict[int | str, Any]:
    """The 200 entry: ``model`` as JSON, and other media types (``{"text/event-stream": {...}}``) beside it."""
    entry: dict[str, Any] = {"description": "Successful Response"}
    if model is not None:
        entry["model"] = model
    if media:
        entry["content"] = media
    return {200: entry}


class HealthStatus(BaseModel):
    """``/health``'s answer: ``ok`` (200), or ``draining``/``unhealthy`` with the reason (503)."""

    status: str
    reason: str | None = None


class PolicyDoc(BaseModel):
    """The served cache policy, where it came from, and its version."""

    name: str | None = None
    version: str | None = None
    source: str
    policy: CachePolicy


class SessionDeleted(BaseModel):
    id: str
    object: str = "session.deleted"
    deleted: bool
    memory: bool
    store: bool


def _policy_body(schema: dict[str, Any]) -> dict[str, Any]:
    """PUT's body: cache-policy keys (unset ones take their defaults, ``block_size`` only the served one), bare or
    under ``cache_policy``."""
    schema["components"]["schemas"]["CachePolicyInput"] = CachePolicy.model_json_schema(mode="validation")
    ref = {"$ref": "#/components/schemas/CachePolicyInput"}
    wrapped = {"type": "object", "properties": {"cache_policy": ref}, "required": ["cache_policy"],
               "additionalProperties": False}  # fmt: skip
    return {"required": True, "content": {"application/json": {"schema": {"anyOf": [ref, wrapped]}}}}


def install_openapi(app: FastAPI, served_model: str) -> None:
    """Make ``app.openapi()`` build the document described in the module docstring (once, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
        for path, item in schema["paths"].items():
            for method, op in item.items():
                responses = op.get("responses", {})
                fastapi_422 = responses.get("422", {}).get("content", {}).get("application/json", {}).get("schema")
                if fastapi_422 is not None and fastapi_422 != {"$ref": ERROR_SCHEMA}:
                    del responses["422"]  # FastAPI's validation body: this server answers 400 in OpenAI's
                for param in op.get("parameters", []):
                    if param["name"] == "session_id":
                        param["schema"] |= {"pattern": SESSION_ID_PATTERN, "maxLength": 128}
                if (path, method) == ("/v1/cache_policy", "put"):
                    op["requestBody"] = _policy_body(schema)
        components = schema["components"]["schemas"]
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            components[name]["properties"]["model"] = {"type": "string", "enum": [served_model], "title": "Model"}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
