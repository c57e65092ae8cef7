"""Ray Serve's request router for confkv: a session's requests go to the replica that holds it, the rest to the
less loaded of two.

A request whose ``x-session-id`` header names a session (Ray's proxy reads that header into the request's
metadata; the body's ``session_id`` it cannot see, so clients of a deployment send the header, which confkv also
takes as the session) is placed by Ray's own :class:`ConsistentHashRouter`: a hash ring with virtual nodes over the
replicas, so a session stays on its replica while the replica set is unchanged, and when a replica leaves only its
own sessions move (to their next replica on the ring, which resumes them from the shared session store). When the
session's replica refuses the request (it runs ``max_ongoing_requests`` already), the next replica on the ring takes
it (``FALLBACK_REPLICAS``). Every other request is placed by the power of two choices, as Ray Serve's default
router does: two replicas drawn at random, the one with the shorter queue.
"""

from __future__ import annotations

import random

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, RunningReplica


class SessionAffinityRouter(ConsistentHashRouter):
    """Consistent hashing on the session id where there is one, power of two choices where there is none."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None and pending_request.metadata.session_id:
            return await super().choose_replicas(candidate_replicas, pending_request)
        if len(candidate_replicas) <= 2:  # one rank: the router asks both for their queue and takes the shorter
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        return [random.sample(candidate_replicas, 2)]
