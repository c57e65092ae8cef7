"""``confkv serve --replicas N``'s flags and the Ray Serve deployment options they make.

Kept free of Ray (and of everything heavy): the flags are parsed and checked, and a bad value answered in one line,
before Ray is imported; without ``--replicas`` nothing here is used beyond ``add_scaleout_arguments``.
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from confkv.errors import ConfkvError

#: The Ray Serve application's name: the replicas' actors, the hub and ``serve status`` use it.
APP_NAME = "confkv"
#: How many successors on the hash ring a session's request may fall back to when its replica refuses it (full):
#: one keeps a session on at most two replicas under load, both of which read it from the shared store.
FALLBACK_REPLICAS = 1


class ScaleOut(BaseModel):
    """How many engine replicas, each's share of the machine, and how Ray Serve admits, queues and scales."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(ge=1, description="engine replicas at start (and while not autoscaling)")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for each replica (fractions allowed)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved for each replica (fractions allowed)")
    max_ongoing_requests: int = Field(32, ge=1, description="requests one replica runs at once")
    max_queued_requests: int = Field(64, ge=-1, description="requests waiting for a replica; beyond: 429 (-1: any)")
    retry_after_s: float = Field(1.0, ge=0, description="the Retry-After of a 429")
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0)
    ray_address: str | None = Field(None, description="an existing Ray cluster (default: start one here)")
    graceful_shutdown_s: float = Field(30.0, ge=0, description="how long a stopping replica drains")

    @field_validator("max_queued_requests")
    @classmethod
    def _a_queue_or_none(cls, v: int) -> int:
        if v == 0:  # Ray Serve takes -1 (no limit) or a positive number; 0 would fail inside Ray at deploy time
            raise ValueError("--max-queued-requests must be -1 (no limit) or at least 1")
        return v

    @model_validator(mode="after")
    def _autoscaling_range(self) -> ScaleOut:
        if self.autoscaling:
            low = self.min_replicas if self.min_replicas is not None else 1
            high = self.max_replicas if self.max_replicas is not None else max(self.replicas, low)
            if not low <= self.replicas <= high:
                raise ValueError(f"--replicas {self.replicas} is outside --min-replicas {low} .. --max-replicas {high}")
        return self

    @property
    def autoscaling(self) -> bool:
        return any(v is not None for v in (self.min_replicas, self.max_replicas, self.target_ongoing_requests))

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments of ``Deployment.options`` (plain values: the request router and backpressure configs
        are built from them where Ray is imported)."""
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_s + 10.0,  # the drain, then the session flush
        }
        if self.autoscaling:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas if self.min_replicas is not None else 1,
                "max_replicas": self.max_replicas if self.max_replicas is not None else max(self.replicas, 1),
                "initial_replicas": self.replicas,
                "target_ongoing_requests": self.target_ongoing_requests or max(1.0, self.max_ongoing_requests / 2),
            }
        else:
            options["num_replicas"] = self.replicas
        return options


def add_scaleout_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``confkv serve --replicas N`` (all ignored without ``--replicas``)."""
    g = p.add_argument_group("scale-out on Ray Serve (confkv[ray]; see docs/scaling-out.md)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas behind one endpoint on Ray Serve (default: one, no Ray)")  # fmt: skip
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="C", help="CPUs per replica (default 1)")
    g.add_argument("--replica-gpus", type=float, default=0.0, metavar="G", help="GPUs per replica (default 0)")
    g.add_argument("--max-ongoing-requests", type=int, default=32, metavar="N",
                   help="requests one replica runs at once (default 32)")  # fmt: skip
    g.add_argument("--max-queued-requests", type=int, default=64, metavar="N",
                   help="requests waiting for a replica; then 429 with Retry-After (default 64; -1: any)")  # fmt: skip
    g.add_argument("--retry-after-s", type=float, default=1.0, metavar="S", help="a 429's Retry-After (default 1)")
    g.add_argument("--min-replicas", type=int, default=None, metavar="N", help="autoscaling: fewest replicas")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N", help="autoscaling: most replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=None, metavar="N",
                   help="autoscaling: running requests per replica to aim for")  # fmt: skip
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join an existing Ray cluster (auto, ray://HOST:10001; default: start one here)")  # fmt: skip


def scaleout_from_args(args: argparse.Namespace) -> ScaleOut:
    """The flags as a ``ScaleOut``; a bad value is one ``ConfkvError`` naming the flag."""
    from confkv.config import format_validation_error

    try:
        return ScaleOut(
            replicas=args.replicas,
            num_cpus=args.replica_cpus,
            num_gpus=args.replica_gpus,
            max_ongoing_requests=args.max_ongoing_requests,
            max_queued_requests=args.max_queued_requests,
            retry_after_s=args.retry_after_s,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            ray_address=args.ray_address,
            graceful_shutdown_s=args.shutdown_grace,
        )
    except ValidationError as err:
        raise ConfkvError(format_validation_error(err, "scale-out setting")) from None


#: The ``confkv serve`` flags that are the deployment's, not a replica's: left out of what each replica is given.
SCALEOUT_KEYS = frozenset(
    {"replicas", "replica_cpus", "replica_gpus", "max_ongoing_requests", "max_queued_requests", "retry_after_s",
     "min_replicas", "max_replicas", "target_ongoing_requests", "ray_address"}
)  # fmt: skip


def replica_args(args: argparse.Namespace) -> dict[str, Any]:
    """What each replica builds its engine and app from: ``confkv serve``'s flags less the deployment's, with the
    session store's write-through on unless ``--no-session-write-through`` (a dead replica's sessions resume on
    another)."""
    out = {k: v for k, v in vars(args).items() if k not in SCALEOUT_KEYS and not callable(v)}
    if out.get("session_write_through") is None:  # not --no-session-write-through
        out["session_write_through"] = True
    return out
