"""What the replicas of one deployment share beyond the session store: a small named Ray actor.

Ray Serve routes each request to one replica and has no call that reaches all of them, so the answers that are the
deployment's go through this hub: every replica publishes its ``confkv:`` metric families here once a second (and
before it answers ``/metrics``), and ``/metrics`` on any replica renders all live replicas' series, each with its
``replica`` label; a ``PUT /v1/cache_policy`` applied on one replica is recorded here as the policy of record, which
every replica (a replacement started later too) applies within a second. A replica that stopped publishing for
``STALE_S`` is no longer counted (a killed one's counters leave ``/metrics``, as a restarted process's would).

The hub is detached (it outlives the replica that happened to create it) and reserves no CPU; the launcher removes
it with the application.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

#: A replica silent this long is taken for gone.
STALE_S = 10.0


def hub_name(app_name: str) -> str:
    return f"confkv-hub-{app_name}"


#: The Ray namespace of the hub (replicas run in Serve's own; a named actor is found by name and namespace).
NAMESPACE = "confkv"


class ReplicaHub:
    """The deployment's shared state (one instance, a Ray actor: its methods run one at a time)."""

    def __init__(self) -> None:
        self._replicas: dict[str, tuple[float, list[Any]]] = {}  # replica -> (published at, metric families)
        self._policy: tuple[int, dict[str, Any] | None, str | None] = (0, None, None)  # number, policy, version

    def publish(self, replica: str, families: list[Any]) -> int:
        """A replica's current metric families; answers the number of the policy of record."""
        self._replicas[replica] = (time.monotonic(), families)
        return self._policy[0]

    def forget(self, replica: str) -> None:
        """A replica that stops (drained) leaves at once rather than after ``STALE_S``."""
        self._replicas.pop(replica, None)

    def live(self) -> dict[str, list[Any]]:
        """Every replica heard from within ``STALE_S``, with its families."""
        now = time.monotonic()
        for name in [n for n, (t, _) in self._replicas.items() if now - t > STALE_S]:
            del self._replicas[name]
        return {name: families for name, (_, families) in sorted(self._replicas.items())}

    def set_policy(self, policy: dict[str, Any], version: str) -> int:
        """Record a policy one replica was given; answers its number (they only grow)."""
        self._policy = (self._policy[0] + 1, policy, version)
        return self._policy[0]

    def policy(self) -> tuple[int, dict[str, Any] | None, str | None]:
        """The policy of record: (number, the policy as JSON, its version), or (0, None, None) if none was set."""
        return self._policy


def get_hub(app_name: str) -> Any:
    """The deployment's hub, created on first use (``get_if_exists``: replicas starting together get one)."""
    import ray

    actor = ray.remote(num_cpus=0)(ReplicaHub)
    return actor.options(name=hub_name(app_name), namespace=NAMESPACE, lifetime="detached",
                         get_if_exists=True).remote()  # fmt: skip


def remove_hub(app_name: str) -> None:
    """End the hub with its application (it is detached)."""
    import ray

    with contextlib.suppress(ValueError):  # never created
        ray.kill(ray.get_actor(hub_name(app_name), namespace=NAMESPACE))
