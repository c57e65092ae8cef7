"""What the session tiers hold and read: the operator's options, the parked session between two of its requests,
and the shape of a request the tiers act on (the engine's ``Sequence`` is one)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from confkv.cache.state import SequenceKV
from confkv.controllers import BudgetState, Controller

TIERS = ("device", "host", "store")


@dataclass(frozen=True)
class SessionOptions:
    """Where sessions go and when. ``store_url`` None keeps them in memory only (lost on exit)."""

    store_url: str | None = None
    idle_s: float = 60.0  # device -> host after this long unused
    offload_s: float = 600.0  # host -> object storage after this long unused
    ttl_s: float = 24 * 3600.0  # forgotten (memory and store) after this long unused
    storage_options: dict[str, Any] | None = None
    timeout_s: float = 5.0
    store_backoff_s: float = 10.0  # after the store fails to answer, new sessions skip it this long
    #: Also write each finished turn's record to the store while keeping it in memory, so another server sharing
    #: the store resumes the session if this one dies (replicas behind one endpoint): a crash then loses only the
    #: turns whose write had not landed. Off, a session reaches the store only when it goes idle or on a drain.
    write_through: bool = False


class SessionRequest(Protocol):
    """What the tiers read and set on a request of a session (the engine's ``Sequence`` is one)."""

    seq_id: int
    request_id: str
    session_id: str | None
    token_ids: list[int]
    controller: Controller
    kv: SequenceKV
    ctrl: BudgetState
    num_computed: int
    cached_tokens: int
    restoring: bool
    restore_started: float
    restore_s: float | None
    finish_reason: str | None


@dataclass
class Parked:
    """A session between two of its requests."""

    session_id: str
    token_ids: list[int]
    num_computed: int
    kv: SequenceKV | None  # None once the session lives only in object storage
    ctrl: BudgetState | None
    resident: list[int]  # logical blocks on the device when it was parked (where a restore puts them back)
    tier: str  # "device" | "host" | "store"
    last_used: float = field(default_factory=time.monotonic)
