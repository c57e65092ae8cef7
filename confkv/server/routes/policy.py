"""The cache policy API: ``GET /v1/cache_policy`` says what is served, ``PUT`` swaps in a new one between two
engine steps (through the engine thread's inbox, like every policy change)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from confkv.config import CachePolicy, format_validation_error
from confkv.errors import ConfkvError
from confkv.server import protocol as P
from confkv.server.engine_thread import EngineUnavailable
from confkv.server.errors import APIError, not_json, param_from_policy_message, param_of
from confkv.server.middleware import require_key
from confkv.server.state import ServerState, StateDep, engine_answer

router = APIRouter(dependencies=[Depends(require_key)])


def policy_doc(state: ServerState) -> dict[str, Any]:
    policy, info = state.engine_thread.policy_snapshot
    return {**info, "policy": policy.model_dump(mode="json")}


@router.get("/v1/cache_policy")
async def get_cache_policy(state: StateDep) -> dict[str, Any]:
    return policy_doc(state)


@router.put("/v1/cache_policy")
async def put_cache_policy(request: Request, state: StateDep) -> dict[str, Any]:
    """Swap the served policy: 200 with the new one, 422 for a policy that cannot be, 503 while draining."""
    et = state.engine_thread
    if (refusal := not_json(request.headers.get("content-type"))) is not None:  # POST: through the body model
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
        param = param_of(tuple(first.get("loc", ()))) or param_from_policy_message(first.get("msg", ""))
        raise APIError(422, format_validation_error(err, "cache policy"), param=param, code="invalid_value") from None
    version = hashlib.sha256(policy.model_dump_json().encode()).hexdigest()[:12]
    if state.draining:
        raise APIError(503, "the server is shutting down", code="server_shutting_down")
    try:
        await engine_answer(et.set_policy(policy, source="api", version=version))
    except ConfkvError as err:
        raise APIError(422, str(err), param=param_from_policy_message(str(err)), code="invalid_value") from None
    except EngineUnavailable as err:
        raise APIError(503, f"the engine is not available: {err}", code="engine_unavailable") from None
    except TimeoutError:
        raise APIError(503, "the engine did not answer in time; the policy may still be applied (GET "
                       "/v1/cache_policy says)", code="engine_unavailable") from None  # fmt: skip
    return policy_doc(state)
