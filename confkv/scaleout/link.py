"""A replica's link to its deployment (``confkv.server.state.Cluster``): the answers that are the deployment's.

Each replica runs one :class:`ReplicaLink`: a task that publishes its metric families to the hub every
``SYNC_S`` and applies the policy of record when it changed; ``/metrics`` merges every live replica's families
(one ``# HELP``/``# TYPE`` per family, each series labelled ``replica``), ``/health`` says how many replicas are live,
and a ``PUT /v1/cache_policy`` applied here is recorded in the hub for the others.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from confkv.config import CachePolicy
from confkv.errors import ConfkvError
from confkv.server.state import ServerState

log = logging.getLogger("confkv.scaleout")

#: How often a replica publishes its metrics and looks for a new policy of record.
SYNC_S = 1.0
#: The label that tells replicas' series apart.
REPLICA_LABEL = "replica"


def labelled(families: Iterable[Metric], replica: str) -> list[Metric]:
    """Copies of ``families`` with every sample labelled ``replica=...`` (the originals stay the registry's)."""
    out = []
    for fam in families:
        new = copy.copy(fam)
        new.samples = [s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in fam.samples]
        out.append(new)
    return out


class _Merged(Collector):
    """Several replicas' families as one exposition: same-named families become one, their samples side by side."""

    def __init__(self, by_replica: dict[str, list[Metric]]) -> None:
        self.by_replica = by_replica

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for families in self.by_replica.values():
            for fam in families:
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = copy.copy(fam)
                    merged[fam.name].samples = list(fam.samples)
        yield from merged.values()


def render(by_replica: dict[str, list[Metric]]) -> bytes:
    """Prometheus' text format of every replica's families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(by_replica))
    return generate_latest(registry)


class ReplicaLink:
    """See the module docstring; ``hub`` is the deployment's hub actor (``confkv.scaleout.hub``)."""

    def __init__(self, state: ServerState, hub: Any, replica: str) -> None:
        self.state = state
        self.hub = hub
        self.replica = replica
        self._seen_policy = 0

    def families(self) -> list[Metric]:
        return labelled(self.state.metrics.registry.collect(), self.replica)

    async def _publish(self) -> int:
        return await self.hub.publish.remote(self.replica, self.families())

    async def metrics(self) -> bytes:
        await self._publish()  # this replica's series as of now; the others' as of their last second
        return render(await self.hub.live.remote())

    async def health(self) -> dict[str, Any]:
        live = await self.hub.live.remote()
        return {"replica": self.replica, "replicas": len(live)}

    async def policy_changed(self, policy: CachePolicy, version: str) -> None:
        self._seen_policy = await self.hub.set_policy.remote(policy.model_dump(mode="json"), version)

    async def _follow_policy(self) -> None:
        """Apply the policy of record if it is newer than the last one seen and not the one served here."""
        number, policy, version = await self.hub.policy.remote()
        if number <= self._seen_policy or policy is None:
            return
        self._seen_policy = number
        et = self.state.engine_thread
        if et.policy_snapshot[1].get("version") == version:
            return
        try:
            await asyncio.wrap_future(et.set_policy(CachePolicy(**policy), source="api", version=version))
            log.info("replica %s: policy %s from the deployment applied", self.replica, version)
        except (ConfkvError, ValueError) as err:  # checked by the replica that took the PUT: should not happen
            et.refuse_policy("api", str(err))

    async def _sync(self) -> None:
        while True:
            try:
                await self._publish()
                await self._follow_policy()
            except asyncio.CancelledError:
                raise
            except Exception:  # the hub restarting must not end the loop
                log.exception("replica %s: could not reach the deployment's hub", self.replica)
            await asyncio.sleep(SYNC_S)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """While the app runs: the sync task (first: the policy of record, so a replacement serves it at once)."""
        try:
            await self._follow_policy()
        except Exception:
            log.exception("replica %s: could not read the policy of record", self.replica)
        task = asyncio.ensure_future(self._sync())
        try:
            yield
        finally:
            self.state.draining = True  # /health and new requests: 503 while the last ones finish
            task.cancel()
            try:
                await self.hub.forget.remote(self.replica)
            except Exception:
                log.warning("replica %s: could not leave the hub", self.replica)
