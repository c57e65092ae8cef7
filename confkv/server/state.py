"""What every route shares, and the dependency that hands it to them.

``ServerState`` is built once per server (``main.build_state``) and hung on ``app.state.confkv``; routes take it as
a FastAPI dependency (:data:`StateDep`) instead of closing over it, so each family of routes can live in its own
module.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import Depends, Request

from confkv.server.engine_thread import EngineThread
from confkv.server.metrics import ServerMetrics
from confkv.server.settings import ServerSettings


class ServerState:
    """What the routes share: the engine thread, metrics, settings, and the draining flag SIGTERM sets."""

    def __init__(self, engine_thread: EngineThread, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine_thread = engine_thread
        self.settings = settings
        self.metrics = metrics
        self.draining = False
        self.started = int(time.time())

    def healthy(self) -> bool:
        return not self.draining and self.engine_thread.healthy(self.settings.health_stale_s)


def get_state(request: Request) -> ServerState:
    return request.app.state.confkv


StateDep = Annotated[ServerState, Depends(get_state)]


async def engine_answer(fut: Any, timeout: float = 60.0) -> Any:
    """Await a ``concurrent.futures`` future the engine thread completes, bounded so no handler waits forever."""
    return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
