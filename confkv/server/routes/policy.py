"""The cache policy API: ``GET /v1/cache_policy`` says what is served, ``PUT`` swaps in a new one between two
engine steps (through the engine thread's inbox, like every policy change)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from confkv.config import CachePolicy, error_field, format_validation_error
from confkv.errors import ConfkvError
from confkv.server import protocol as P
from confkv.server.engine_thread import EngineUnavailable
from confkv.server.errors import APIError, not_json
from confkv.server.openapi import PolicyDoc, errors, ok
from confkv.server.state import ServerState, StateDep, engine_answer

router = APIRouter()


def check_learned_path(policy: CachePolicy, current: CachePolicy, allowed_dirs: tuple[str, ...]) -> None:
    """A learned policy loads over the API only from the folder served now (started with, or followed in the
    registry) or from one under an ``--allowed-policy-dir``: anything else is refused with one message whatever the
    path is, so the answer tells nothing of the server's file system, and no folder the operator did not name is
    ever read."""
    path = policy.learned_path
    if path is None or path == current.learned_path:
        return
    real = os.path.realpath(path)  # a symlink or ".." inside an allowed folder that leads out of it is refused
    for folder in allowed_dirs:
        root = os.path.realpath(folder)
        if os.path.commonpath([real, root]) == root:
            return
    where = "a folder under --allowed-policy-dir" if allowed_dirs else "no folder (no --allowed-policy-dir given)"
    raise APIError(
        422,
        f"learned_path: this server loads a learned policy over the API only from {where}, or the one it serves "
        "now; serve one with --policy-file or from the registry (--policy registry://NAME@ALIAS)",
        param="learned_path",
        code="learned_path_not_allowed",
    )


def check_host_memory(policy: CachePolicy, current: CachePolicy) -> None:
    """A new ``host_cache_memory`` within the machine's memory (a unit typo would otherwise be taken at its word)."""
    if policy.host_cache_memory == current.host_cache_memory:
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if policy.host_cache_memory > total:
        raise APIError(
            422,
            f"host_cache_memory is {policy.host_cache_memory} bytes; this machine has {total} bytes of memory",
            param="host_cache_memory",
            code="invalid_value",
        )


def policy_doc(state: ServerState) -> dict[str, Any]:
    policy, info = state.engine_thread.policy_snapshot
    return {**info, "policy": policy.model_dump(mode="json")}


@router.get("/v1/cache_policy", responses={**ok(PolicyDoc), **errors(401)})
async def get_cache_policy(state: StateDep) -> dict[str, Any]:
    return policy_doc(state)


@router.put("/v1/cache_policy", responses={**ok(PolicyDoc), **errors(400, 401, 408, 413, 422, 503)})
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
        param = error_field(err)
        raise APIError(422, format_validation_error(err, "cache policy"), param=param, code="invalid_value") from None
    check_learned_path(policy, current, state.settings.allowed_policy_dirs)
    check_host_memory(policy, current)
    version = hashlib.sha256(policy.model_dump_json().encode()).hexdigest()[:12]
    if state.draining:
        raise APIError(503, "the server is shutting down", code="server_shutting_down")
    try:
        await engine_answer(et.set_policy(policy, source="api", version=version))
    except ConfkvError as err:
        raise APIError(422, str(err), param=err.param, code="invalid_value") from None
    except EngineUnavailable as err:
        raise APIError(503, f"the engine is not available: {err}", code="engine_unavailable") from None
    except TimeoutError:
        raise APIError(503, "the engine did not answer in time; the policy may still be applied (GET "
                       "/v1/cache_policy says)", code="engine_unavailable") from None  # fmt: skip
    if state.cluster is not None:  # every replica serves what one was told
        try:
            await state.cluster.policy_changed(policy, version)
        except Exception as err:  # the hub is gone (restarting): say so rather than answer 500
            message = f"the policy is applied here, but the other replicas could not be told ({type(err).__name__})"
            raise APIError(503, message + "; send the PUT again", code="deployment_unavailable") from None
    return policy_doc(state)
