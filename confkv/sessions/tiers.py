"""Sessions across the three tiers: device memory, host memory, object storage.

A request with a ``session_id`` continues that session. When it finishes, its KV is not freed: the session is
*parked* with it (device blocks, host blocks, the controller's budget and block scores). The next request of the
session whose prompt extends the parked tokens adopts that KV and computes only the new tokens; a prompt that
departs from the history keeps the common prefix (``mismatches`` counts it) and recomputes the rest.

Tier moves, all decided on the engine thread between steps:

* device -> host: under memory pressure (the scheduler needs blocks, or the circuit breaker would trip) and after
  ``idle_s`` unused; parked blocks are what admission reclaims first, least recently used first;
* host -> object storage: after ``offload_s`` unused, or when the host tier would overflow; the whole record
  (token ids, every block still held, controller state, policy and its version, model fingerprint) is written by a
  background thread, token ids first, and host memory is freed at once (the record owns the tensors meanwhile);
* object storage -> host -> device: a request for a session that is not in memory waits (``restoring``) while the
  background thread reads and checks its record; its blocks come back to the device where they were, as far as
  free memory allows, the rest to the host tier, where recall can reach them.

Nothing is lost on a fault: if the store is unreachable, slow, or returns a corrupt or foreign record, the request
recomputes from its own prompt (it carries the whole conversation), the fault is logged and counted, and the next
call tries the store again. Sessions expire ``ttl_s`` after their last use (memory and store) or on ``delete``.

What carries over exactly: under ``full`` everything (the output equals a recomputation token for token). Under an
evicting policy the KV a session keeps is what *decoding* left (its budget), where a recomputation would read the
whole history again as a prompt (keeping up to ``max_size``): the two are different caches by design, so outputs
may differ; the controller's budget and step count carry over, a learned controller's segment memory does not. A
session restored under another policy than the one that wrote it continues under the engine's current policy
(its budget clamped to the new range), as a policy swap would.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

from confkv.cache.manager import CacheManager
from confkv.cache.state import SequenceKV
from confkv.controllers import BudgetState
from confkv.errors import SessionBusy
from confkv.sessions.errors import RecordMissing, SessionStoreError, StoreUnavailable
from confkv.sessions.record import BlockKV, SessionRecord, dtype_name
from confkv.sessions.state import TIERS, Parked, SessionOptions, SessionRequest
from confkv.sessions.store import FAULT_KINDS, SessionStore, check_session_id
from confkv.sessions.worker import StoreWorker

log = logging.getLogger(__name__)


class SessionTiers:
    """The engine's sessions; every method runs on the engine thread except the background I/O worker.

    They move KV through the cache manager and read nothing else of the engine: ``identity`` says what a record
    must have been written for (the model fingerprint, computed once, on first use), ``policy`` the policy and
    version a record is written under, ``lookup`` finds a request's live sequence when its restore comes back, and
    ``new_seq_id`` numbers a restored cache.
    """

    def __init__(
        self,
        manager: CacheManager,
        options: SessionOptions,
        *,
        identity: Callable[[], str],
        policy: Callable[[], tuple[dict[str, Any], str | None]],
        lookup: Callable[[str], SessionRequest | None],
        new_seq_id: Callable[[], int],
    ) -> None:
        self.manager = manager
        self.pool = manager.pool
        self.host = manager.host
        self.options = options
        self._identity = identity
        self._policy = policy
        self._lookup = lookup
        self._new_seq_id = new_seq_id
        self.store = (
            SessionStore(options.store_url, storage_options=options.storage_options, timeout_s=options.timeout_s)
            if options.store_url
            else None
        )
        self.parked: OrderedDict[str, Parked] = OrderedDict()  # least recently used first
        self.active: dict[str, str] = {}  # session id -> request id running now
        self.hits: Counter[str] = Counter()  # by tier
        self.misses = 0
        self.mismatches = 0
        self.tokens_reused = 0
        self.offloads = 0  # records the store confirmed written
        self.offload_attempts = 0
        self.offload_failures = 0
        self.faults: Counter[str] = Counter()
        #: Restore latencies since the last ``drain_restore_seconds`` (for a histogram; bounded for offline use).
        self.restore_seconds: deque[float] = deque(maxlen=4096)
        #: Deleted sessions whose store copy may still exist (the store did not answer the delete): never restored,
        #: and deleted again on the next sweep. Each maps to its delete's job number: only a record written after
        #: the delete (a later put, by number) replaces what was deleted.
        self._unconfirmed_deletes: dict[str, int] = {}
        self._last_put: dict[str, int] = {}  # session id -> job number of its latest queued write
        self._job_no = 0
        self._store_down_until = -math.inf
        self._fingerprint: str | None = None
        self._pending_writes = 0
        # a deadline, not "seconds since the last sweep": a machine's monotonic clock starts near zero at boot
        self._next_sweep = time.monotonic() + self.sweep_interval_s
        self.worker = StoreWorker(self.store, lambda sid: sid in self.active) if self.store is not None else None

    # --------------------------------------------------------------------------------------------- identity
    @property
    def expect(self) -> dict[str, Any]:
        """What a record must have been written for to be restored here."""
        if self._fingerprint is None:
            self._fingerprint = self._identity()
        return {
            "model_fingerprint": self._fingerprint,
            "block_size": self.pool.block_size,
            "dtype": dtype_name(self.manager.host_fmt.record_dtype),  # what the lower tiers hold (host_kv_dtype)
        }

    @property
    def sweep_interval_s(self) -> float:
        """How often the store is swept for expired sessions (and unconfirmed deletes are retried)."""
        return min(self.options.ttl_s / 10, 600.0)

    def request_sweep(self) -> None:
        """Sweep at the next ``housekeeping`` instead of waiting out the interval."""
        self._next_sweep = -math.inf

    # ------------------------------------------------------------------------------------------- requests
    def check(self, session_id: str) -> None:
        """Refuse a malformed id, or a session that already has a request running (before any state is made)."""
        check_session_id(session_id)
        if session_id in self.active:
            raise SessionBusy(f"session {session_id!r} already has a request running; send one turn at a time",
                              param="session_id")  # fmt: skip

    def attach(self, seq: SessionRequest, session_id: str) -> None:
        """Give a new request of ``session_id`` the session's KV, or queue its restore from object storage.

        While the store is backing off after it failed to answer, a session that is not in memory starts from its
        prompt at once instead of waiting for a store that is probably still down (counted as ``unavailable``).
        """
        self.check(session_id)
        seq.session_id = session_id
        self.active[session_id] = seq.request_id
        parked = self.parked.pop(session_id, None)
        if parked is not None and parked.kv is not None:
            self._adopt(seq, parked.kv, parked.ctrl, parked.num_computed, parked.token_ids, parked.resident,
                        parked.tier)  # fmt: skip
        elif self.store is None or session_id in self._unconfirmed_deletes:
            self.misses += 1
        elif time.monotonic() < self._store_down_until:
            self.faults["unavailable"] += 1
        else:
            seq.restoring = True
            seq.restore_started = time.perf_counter()
            self._submit(("get", session_id, seq.request_id, self.expect))

    def _adopt(
        self,
        seq: SessionRequest,
        kv: SequenceKV,
        ctrl: BudgetState | None,
        num_computed: int,
        history: list[int],
        resident: list[int],
        tier: str,
    ) -> None:
        """Continue from a parked cache (``CacheManager.adopt``): the request takes it over, and computes only
        what its prompt does not share with the history."""
        prompt = seq.token_ids
        if not (len(prompt) > num_computed and prompt[:num_computed] == history[:num_computed]):
            self.mismatches += 1
        kept = self.manager.adopt(kv, prompt, history, num_computed, resident, seq.controller)
        if kept == 0:
            self.misses += 1
            return
        self.hits[tier] += 1
        self.manager.close(seq.kv)  # the empty cache the request was opened with
        seq.seq_id = kv.seq_id
        seq.kv = kv
        if ctrl is not None:
            seq.ctrl = seq.controller.adopt(ctrl)
        seq.num_computed = kept
        seq.cached_tokens = kept
        self.tokens_reused += kept

    def park(self, seq: SessionRequest) -> bool:
        """Keep a finished request's KV for its session's next turn; False when it cannot be kept (then close)."""
        sid = seq.session_id
        if sid is None or self.active.get(sid) != seq.request_id:
            return False
        del self.active[sid]
        if seq.finish_reason == "error" or seq.num_computed == 0:
            return False
        kv = seq.kv
        parked = Parked(sid, list(seq.token_ids), seq.num_computed, kv, seq.ctrl, kv.table.resident_indices(),
                        "device")  # fmt: skip
        self.parked[sid] = parked
        if self.options.write_through and self.store is not None and sid not in self._unconfirmed_deletes:
            self._write(parked, keep=True)
        return True

    def release(self, seq: SessionRequest) -> None:
        """A request that was not parked (aborted before it started, failed): its session is free again."""
        if seq.session_id is not None and self.active.get(seq.session_id) == seq.request_id:
            del self.active[seq.session_id]

    def delete(self, session_id: str) -> bool:
        """Forget a session in every tier; True if it existed in memory (the store is cleared in the background)."""
        check_session_id(session_id)
        self.active.pop(session_id, None)  # a request running now finishes without parking
        parked = self.parked.pop(session_id, None)
        if parked is not None and parked.kv is not None:
            self.manager.close(parked.kv)
        if self.store is not None:
            n = self._next_job()
            self._unconfirmed_deletes[session_id] = n
            self._submit(("delete", session_id, n))
        return parked is not None

    def _submit(self, job: tuple[Any, ...]) -> None:
        assert self.worker is not None
        self.worker.submit(job)

    def _next_job(self) -> int:
        """Number store jobs in the order they are queued (the worker runs them in that order)."""
        self._job_no += 1
        return self._job_no

    # ----------------------------------------------------------------------------------------- tier moves
    def reclaim(self, blocks: int) -> int:
        """Memory pressure: move parked sessions' device blocks to the host tier, least recently used first."""
        freed = 0
        for parked in list(self.parked.values()):
            if freed >= blocks:
                break
            if parked.tier == "device" and parked.kv is not None:
                freed += self._to_host(parked)
        return freed

    def _to_host(self, parked: Parked) -> int:
        kv = parked.kv
        assert kv is not None
        host = self.host
        need = len(kv.table.resident_indices()) * self.manager.host_bytes_per_block
        if self.store is not None:  # make room by sending older host-tier sessions to the store, not by dropping
            for other in list(self.parked.values()):
                if host.used_bytes + need <= host.capacity_bytes:
                    break
                if other is not parked and other.tier == "host":
                    self._to_store(other)
        freed = self.manager.offload_all(kv)
        parked.tier = "host"
        return freed

    def _to_store(self, parked: Parked) -> None:
        """Hand the session's whole record to the background writer and free both memory tiers at once."""
        self._write(parked, keep=False)

    def _write(self, parked: Parked, *, keep: bool) -> None:
        """Queue the session's whole record for the store; ``keep`` (write-through) copies its blocks and leaves the
        session where it is, else both memory tiers are freed at once and the record owns the tensors."""
        kv = parked.kv
        assert kv is not None and self.store is not None
        table = kv.table
        blocks: dict[int, BlockKV] = {}
        on_device = table.resident_indices()
        if on_device:
            k, v, score = self.pool.read_blocks([table.entries[i] for i in on_device])  # indexing copies
            k, v = self.manager.to_host_form(table, on_device, k, v)
            for j, i in enumerate(on_device):
                blocks[i] = BlockKV(k[:, j].cpu(), v[:, j].cpu(), score[j].cpu())
        on_host = table.host_indices()
        if on_host:
            k, v, score = (self.host.peek if keep else self.host.take)(kv.seq_id, on_host)
            for j, i in enumerate(on_host):
                blocks[i] = BlockKV(k[:, j], v[:, j], score[j])
        ctrl = parked.ctrl or BudgetState(budget=kv.budget)
        policy, version = self._policy()
        record = SessionRecord(
            session_id=parked.session_id,
            token_ids=parked.token_ids,
            num_computed=parked.num_computed,
            blocks=blocks,
            controller={
                "budget": _finite(ctrl.budget),
                "uncertain": ctrl.uncertain,
                "steps": ctrl.steps,
                "applied_budget": _finite(kv.budget),
                "since_compact": kv.since_compact,
            },
            policy=policy,
            policy_version=version,
            meta={"resident": parked.resident, "table_blocks": len(table.entries)},
            **self.expect,
        )
        if not keep:
            self.manager.close(kv)
            parked.kv = None
            parked.tier = "store"
        self.offload_attempts += 1
        self._pending_writes += 1
        n = self._next_job()
        self._last_put[parked.session_id] = n
        self._submit(("put", record, None if keep else parked, n))  # a failed write-through leaves memory as it is

    def housekeeping(self) -> None:
        """Apply finished restores and writes, move idle sessions down a tier, expire old ones (between steps)."""
        self._drain()
        now = time.monotonic()
        opts = self.options
        for sid, parked in list(self.parked.items()):
            idle = now - parked.last_used
            if idle > opts.ttl_s:
                self.delete(sid)
            elif parked.tier == "device" and idle > opts.idle_s:
                self._to_host(parked)
            elif parked.tier == "host" and idle > opts.offload_s and self.store is not None:
                self._to_store(parked)
        if self.store is not None and now >= self._next_sweep:
            self._next_sweep = now + self.sweep_interval_s
            for sid, n in self._unconfirmed_deletes.items():
                if self._last_put.get(sid, 0) < n:  # a write queued since will replace the deleted record
                    self._submit(("delete", sid, n))
            self._submit(("sweep", time.time() - opts.ttl_s))

    def flush(self, timeout_s: float = 60.0) -> int:
        """Write every session still in memory to object storage and wait for the writes (before an exit)."""
        if self.store is None:
            return 0
        count = 0
        for parked in list(self.parked.values()):
            if parked.kv is not None:
                self._to_store(parked)
                count += 1
        deadline = time.monotonic() + timeout_s
        while self._pending_writes and time.monotonic() < deadline:
            self._drain(block_s=0.05)
        return count

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    # --------------------------------------------------------------------------------------- restores
    def _drain(self, block_s: float = 0.0) -> None:
        for item in self.worker.answers(block_s) if self.worker is not None else []:
            kind = item[0]
            if kind == "got":
                self._restored(*item[1:])
            elif kind == "put":
                _, sid, err, parked, n = item
                self._pending_writes -= 1
                if self._last_put.get(sid) == n:
                    del self._last_put[sid]
                if err is not None:  # the record did not land: only what the request carries is left
                    if parked is not None and self.parked.get(sid) is parked:  # not a newer turn's session since
                        del self.parked[sid]
                    self.offload_failures += 1
                    self._fault(err)
                else:
                    self.offloads += 1
                    if self._unconfirmed_deletes.get(sid, n) < n:  # written after the delete: it replaced it
                        del self._unconfirmed_deletes[sid]
                    self._store_answered()
            elif kind == "deleted":
                _, sid, err, n = item
                if err is None:
                    if self._unconfirmed_deletes.get(sid) == n:
                        del self._unconfirmed_deletes[sid]
                    self._store_answered()
                else:
                    self._fault(err)

    def _fault(self, err: SessionStoreError) -> None:
        self.faults[err.kind] += 1
        if isinstance(err, StoreUnavailable):  # do not make every new session wait on a store that is down
            self._store_down_until = time.monotonic() + self.options.store_backoff_s

    def _store_answered(self) -> None:
        """A store that took a write or a delete is back: sessions read from it again, without waiting out the
        backoff a fault set."""
        self._store_down_until = -math.inf

    def wait_for_restores(self, timeout_s: float) -> None:
        """Block briefly for a restore when nothing else can run (no busy loop while a record is read)."""
        self._drain(block_s=timeout_s)

    def _restored(self, session_id: str, request_id: str, record: SessionRecord | None, err: Exception | None) -> None:
        seq = self._lookup(request_id)
        if seq is None:  # the request was aborted meanwhile
            return
        seq.restoring = False
        seq.restore_s = time.perf_counter() - seq.restore_started
        self.restore_seconds.append(seq.restore_s)
        self.parked.pop(session_id, None)  # the store copy is now this request's
        if record is None:
            if isinstance(err, SessionStoreError) and not isinstance(err, RecordMissing):
                self._fault(err)
            else:
                self.misses += 1
            return
        self._store_answered()
        kv = self._kv_from_record(seq, record)
        ctrl = BudgetState(budget=record.controller.get("budget", kv.budget) or kv.budget,
                           uncertain=bool(record.controller.get("uncertain", False)),
                           steps=int(record.controller.get("steps", 0)))  # fmt: skip
        self._adopt(seq, kv, ctrl, record.num_computed, record.token_ids, record.meta.get("resident", []), "store")

    def _kv_from_record(self, seq: SessionRequest, record: SessionRecord) -> SequenceKV:
        """The record's blocks as a cache of the engine's, all on the host tier (``CacheManager.from_blocks``)."""
        applied = record.controller.get("applied_budget")
        return self.manager.from_blocks(
            self._new_seq_id(),
            record.num_computed,
            int(record.meta.get("table_blocks", -(-record.num_computed // self.pool.block_size))),
            {i: (b.k, b.v, b.score) for i, b in record.blocks.items()},
            seq.controller,
            float(applied) if applied is not None else seq.kv.budget,
            int(record.controller.get("since_compact", 0)),
        )

    # -------------------------------------------------------------------------------------------- metrics
    def stats(self) -> dict[str, Any]:
        by_tier = Counter(p.tier for p in self.parked.values())
        bytes_by_tier = {"device": 0, "host": 0}
        per_block = self.pool.bytes_per_block
        for p in self.parked.values():
            if p.kv is not None:
                bytes_by_tier["device"] += len(p.kv.table.resident_indices()) * per_block
                bytes_by_tier["host"] += self.host.bytes_of(p.kv.seq_id)
        store = self.store.stats() if self.store is not None else None
        repaired = store["tokens_repaired"] if store else 0
        return {
            "sessions": {tier: by_tier.get(tier, 0) for tier in TIERS},
            "session_hits": {tier: self.hits.get(tier, 0) for tier in TIERS},
            "session_misses": self.misses,
            "session_mismatches": self.mismatches,
            "session_tokens_reused": self.tokens_reused,
            "session_offloads": self.offloads,
            "session_offload_attempts": self.offload_attempts,
            "session_offload_failures": self.offload_failures,
            # a damaged tokens object found beside a sound record (and written again) is a corrupt object too
            "session_faults": {k: self.faults.get(k, 0) + (repaired if k == "corrupt" else 0) for k in FAULT_KINDS},
            "session_tokens_repaired": repaired,
            "session_bytes": {**bytes_by_tier, "store_written": store["bytes_written"] if store else 0},
            "session_store_reachable": store["reachable"] if store else None,
        }

    def drain_restore_seconds(self) -> list[float]:
        out = list(self.restore_seconds)
        self.restore_seconds.clear()
        return out


def _finite(x: float) -> float | None:
    return None if x == float("inf") else float(x)
