"""``DELETE /v1/sessions/{id}``: forget a session in the engine's memory (through the engine thread's inbox, like
everything that touches the engine) and in the object store (called from a worker thread here: the store is
thread-safe, and its answer says whether the record existed)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from confkv.errors import ConfkvError
from confkv.server.engine_thread import EngineUnavailable
from confkv.server.errors import APIError
from confkv.server.openapi import SessionDeleted, errors, ok
from confkv.server.state import StateDep, engine_answer
from confkv.sessions.errors import SessionStoreError
from confkv.sessions.store import check_session_id

router = APIRouter()


@router.delete("/v1/sessions/{session_id}", responses={**ok(SessionDeleted), **errors(400, 401, 404, 503)})
async def delete_session(session_id: str, state: StateDep) -> dict[str, Any]:
    """Forget a session everywhere: 200 with where it was found, 404 if neither the engine's memory nor the store
    held it, 400 for an id that cannot name a session, 503 if the store could not be reached (the memory tiers
    are cleared by then; DELETE is idempotent, so the client retries)."""
    try:
        check_session_id(session_id)
    except ConfkvError as err:
        raise APIError(400, str(err), param="session_id", code="invalid_session_id") from None
    et = state.engine_thread
    store = et.session_store
    run = asyncio.get_running_loop().run_in_executor
    in_store, store_error = False, None
    if store is not None:  # asked first: the engine queues a deletion on its own writer, which may run before ours
        try:
            in_store = await run(None, store.exists, session_id)
        except SessionStoreError as err:
            store_error = err
    try:
        in_memory = await engine_answer(et.delete_session(session_id))
    except EngineUnavailable as err:
        raise APIError(503, f"the engine is not available: {err}", code="engine_unavailable") from None
    if store is not None and store_error is None:  # deleted here too: gone from the store when we answer
        try:
            in_store = await run(None, store.delete, session_id) or in_store
        except SessionStoreError as err:
            store_error = err
    if store_error is not None:
        raise APIError(
            503,
            f"session {session_id!r} was removed from memory, but the session store did not answer "
            f"({store_error}): its record may remain there; retry the DELETE",
            code="session_store_unavailable",
        )
    if not (in_memory or in_store):
        raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
    return {"id": session_id, "object": "session.deleted", "deleted": True, "memory": in_memory, "store": in_store}
