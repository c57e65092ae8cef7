"""What every route shares, and the dependency that hands it to them.

``ServerState`` is built once per server (``main.build_state``) and hung on ``app.state.confkv``; routes take it as
a FastAPI dependency (:data:`StateDep`) instead of closing over it, so each family of routes can live in its own
module.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request

from confkv.config import CachePolicy
from confkv.server.engine_thread import EngineThread
from confkv.server.metrics import ServerMetrics
from confkv.server.settings import ServerSettings


class Cluster(Protocol):
    """What a replica among several behind one endpoint (``confkv.scaleout``) adds to the routes that answer for
    the whole deployment; a plain ``confkv serve`` has none."""

    async def metrics(self) -> bytes:
        """The body of ``/metrics``: every live replica's series, each with its ``replica`` label."""
        ...

    async def health(self) -> dict[str, Any]:
        """What ``/health`` adds: the replicas the deployment has now."""
        ...

    async def policy_changed(self, policy: CachePolicy, version: str) -> None:
        """A ``PUT /v1/cache_policy`` applied here: hand it to every other replica."""
        ...


class ServerState:
    """What the routes share: the engine thread, metrics, settings, the draining flag SIGTERM sets, and the cluster
    this server is a replica of (None for one server)."""

    def __init__(self, engine_thread: EngineThread, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine_thread = engine_thread
        self.settings = settings
        self.metrics = metrics
        self.draining = False
        self.started = int(time.time())
        self.cluster: Cluster | None = None

    def healthy(self) -> bool:
        return not self.draining and self.engine_thread.healthy(self.settings.health_stale_s)


def get_state(request: Request) -> ServerState:
    return request.app.state.confkv


StateDep = Annotated[ServerState, Depends(get_state)]


async def engine_answer(fut: Any, timeout: float = 60.0) -> Any:
    """Await a ``concurrent.futures`` future the engine thread completes, bounded so no handler waits forever."""
    return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
