"""One confkv engine as a Ray Serve replica: the same FastAPI app as ``confkv serve`` (routes, streaming, API key,
limits, errors), its engine built in the replica from ``confkv serve``'s flags, linked to the deployment's hub
(``confkv.scaleout.link``), and every response naming the replica in ``x-confkv-replica``.

Stopping (scale-down, ``serve shutdown``, SIGTERM of ``confkv serve --replicas``): Ray routes no new request here
and waits for the running ones, then ends the app's lifespan, which stops the engine thread; stopping writes every
session still in memory to the store (as a plain server's SIGTERM does), though with write-through on, each finished
turn is there already. Ray calls ``check_health`` every few seconds: an engine thread that died or is stuck in a step
makes Ray replace the replica.
"""

from __future__ import annotations

import argparse
from typing import Any

from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from confkv.scaleout.hub import get_hub
from confkv.scaleout.link import ReplicaLink
from confkv.server.app import create_app
from confkv.server.main import build_state, load_engine, make_lifespan
from confkv.server.settings import settings_from_args

#: The response header that names the replica that answered.
REPLICA_HEADER = b"x-confkv-replica"


class ReplicaHeader:
    """ASGI middleware: ``x-confkv-replica`` on every response."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.value)]}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.ingress()
class ConfkvReplica:
    """The deployment's class: ``args`` are ``confkv serve``'s flags (``options.replica_args``)."""

    def __init__(self, args: dict[str, Any], app_name: str) -> None:
        ns = argparse.Namespace(**args)
        settings = settings_from_args(ns)
        engine, choice = load_engine(ns, settings)
        self.state = build_state(engine, settings)
        self.replica = serve.get_replica_context().replica_id.unique_id
        link = ReplicaLink(self.state, get_hub(app_name), self.replica)
        self.state.cluster = link
        self.fastapi = create_app(self.state, lifespan=make_lifespan(self.state, choice, ns.registry_url, link.running))
        self.fastapi.add_middleware(ReplicaHeader, replica=self.replica)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return self.fastapi

    def check_health(self) -> None:
        """Ray's health check: raise while the engine thread is gone or stuck, and Ray replaces the replica."""
        et = self.state.engine_thread
        if self.state.draining or et.healthy(self.state.settings.health_stale_s):
            return
        raise RuntimeError(et.fatal or ("engine thread not running" if not et.alive else "engine step is stuck"))
