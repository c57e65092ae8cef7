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
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from confkv.controllers import BudgetState
from confkv.errors import ConfkvError
from confkv.kv.block_table import DROPPED, ON_HOST, BlockTable
from confkv.kv.manager import KVStats, SequenceKV
from confkv.sessions.errors import RecordMissing, SessionStoreError, StoreUnavailable
from confkv.sessions.record import BlockKV, SessionRecord, dtype_name, model_fingerprint
from confkv.sessions.store import FAULT_KINDS, SessionStore, check_session_id

if TYPE_CHECKING:
    from confkv.engine.engine import LLMEngine
    from confkv.engine.sequence import Sequence

log = logging.getLogger(__name__)
T = TypeVar("T")

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


class SessionTiers:
    """The engine's sessions; every method runs on the engine thread except the background I/O worker."""

    def __init__(self, engine: LLMEngine, options: SessionOptions) -> None:
        self.engine = engine
        self.options = options
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
        self.offloads = 0
        self.faults: Counter[str] = Counter()
        #: Restore latencies since the last ``drain_restore_seconds`` (for a histogram; bounded for offline use).
        self.restore_seconds: deque[float] = deque(maxlen=4096)
        #: Deleted sessions whose store copy may still exist (the store did not answer the delete): never restored,
        #: and deleted again on the next sweep. Each maps to its delete's job number: only a record written after
        #: the delete (a later put, by number) replaces what was deleted.
        self._unconfirmed_deletes: dict[str, int] = {}
        self._last_put: dict[str, int] = {}  # session id -> job number of its latest queued write
        self._job_no = 0
        self._store_down_until = 0.0
        self._fingerprint: str | None = None
        self._jobs: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._done: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._pending_writes = 0
        self._last_sweep = time.monotonic()
        self._worker: threading.Thread | None = None
        if self.store is not None:
            self._worker = threading.Thread(target=self._work, name="confkv-sessions", daemon=True)
            self._worker.start()

    # --------------------------------------------------------------------------------------------- identity
    @property
    def expect(self) -> dict[str, Any]:
        """What a record must have been written for to be restored here."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.engine.model, self.engine.tokenizer)
        return {
            "model_fingerprint": self._fingerprint,
            "block_size": self.engine.pool.block_size,
            "dtype": dtype_name(self.engine.pool.dtype),
        }

    # ------------------------------------------------------------------------------------------- requests
    def check(self, session_id: str) -> None:
        """Refuse a malformed id, or a session that already has a request running (before any state is made)."""
        check_session_id(session_id)
        if session_id in self.active:
            raise ConfkvError(f"session {session_id!r} already has a request running; send one turn at a time")

    def attach(self, seq: Sequence, session_id: str) -> None:
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
            self._jobs.put(("get", session_id, seq.request_id, self.expect))

    def _adopt(
        self,
        seq: Sequence,
        kv: SequenceKV,
        ctrl: BudgetState | None,
        num_computed: int,
        history: list[int],
        resident: list[int],
        tier: str,
    ) -> None:
        """Continue from a parked cache: keep the prefix the new prompt shares with the history, compute the rest.

        The prompt's last token is always computed (its logits give the first new token), so a prompt that only
        repeats the history reuses all but that token.
        """
        manager = self.engine.manager
        prompt = seq.token_ids
        extends = len(prompt) > num_computed and prompt[:num_computed] == history[:num_computed]
        common = 0
        limit = min(num_computed, len(prompt) - 1)
        while common < limit and prompt[common] == history[common]:
            common += 1
        if not seq.controller.evicts and DROPPED in kv.table.entries:
            # a block the host tier had to drop (a record larger than it): a full cache continues without holes,
            # so everything from that block on is recomputed
            common = min(common, kv.table.entries.index(DROPPED) * kv.table.block_size)
        if not extends:
            self.mismatches += 1
        # back to the device first (only the blocks that stay): a cut inside a block that is on the host would
        # otherwise fall back to the block's start, so a session from the host or the store would recompute up to
        # block_size - 1 tokens a session kept on the device reuses, and (under an evicting policy) continue
        # differently from it
        keep = kv.table.blocks_for(common)
        manager.restore_to_device(kv, [i for i in resident if i < min(keep, len(kv.table))])
        kept = manager.truncate(kv, common)
        if kept == 0:
            manager.close(kv)
            self.misses += 1
            return
        self.hits[tier] += 1
        manager.close(seq.kv)  # the empty cache the request was opened with
        seq.seq_id = kv.seq_id
        kv.controller = seq.controller
        kv.stats = KVStats()
        kv.prompt_trimmed = False  # come down to the budget once the new turn is read
        kv.cap = math.inf
        kv.budget = min(kv.budget, seq.controller.max_budget)
        seq.kv = kv
        manager._seqs[kv.seq_id] = kv
        if ctrl is not None:
            seq.ctrl = seq.controller.adopt(ctrl)
        seq.num_computed = kept
        seq.cached_tokens = kept
        self.tokens_reused += kept

    def park(self, seq: Sequence) -> bool:
        """Keep a finished request's KV for its session's next turn; False when it cannot be kept (then close)."""
        sid = seq.session_id
        if sid is None or self.active.get(sid) != seq.request_id:
            return False
        del self.active[sid]
        if seq.finish_reason == "error" or seq.num_computed == 0:
            return False
        kv = seq.kv
        self.parked[sid] = Parked(sid, list(seq.token_ids), seq.num_computed, kv, seq.ctrl,
                                  kv.table.resident_indices(), "device")  # fmt: skip
        return True

    def release(self, seq: Sequence) -> None:
        """A request that was not parked (aborted before it started, failed): its session is free again."""
        if seq.session_id is not None and self.active.get(seq.session_id) == seq.request_id:
            del self.active[seq.session_id]

    def delete(self, session_id: str) -> bool:
        """Forget a session in every tier; True if it existed in memory (the store is cleared in the background)."""
        check_session_id(session_id)
        self.active.pop(session_id, None)  # a request running now finishes without parking
        parked = self.parked.pop(session_id, None)
        if parked is not None and parked.kv is not None:
            self.engine.manager.close(parked.kv)
        if self.store is not None:
            n = self._next_job()
            self._unconfirmed_deletes[session_id] = n
            self._jobs.put(("delete", session_id, n))
        return parked is not None

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
        host = self.engine.host
        need = len(kv.table.resident_indices()) * self.engine.pool.bytes_per_block
        if self.store is not None:  # make room by sending older host-tier sessions to the store, not by dropping
            for other in list(self.parked.values()):
                if host.used_bytes + need <= host.capacity_bytes:
                    break
                if other is not parked and other.tier == "host":
                    self._to_store(other)
        freed = self.engine.manager.offload_all(kv)
        parked.tier = "host"
        return freed

    def _to_store(self, parked: Parked) -> None:
        """Hand the session's whole record to the background writer and free both memory tiers at once."""
        kv = parked.kv
        assert kv is not None and self.store is not None
        engine = self.engine
        table = kv.table
        blocks: dict[int, BlockKV] = {}
        on_device = table.resident_indices()
        if on_device:
            k, v, score = engine.pool.read_blocks([table.entries[i] for i in on_device])
            for j, i in enumerate(on_device):
                blocks[i] = BlockKV(k[:, j].cpu(), v[:, j].cpu(), score[j].cpu())
        on_host = table.host_indices()
        if on_host:
            k, v, score = engine.host.take(kv.seq_id, on_host)
            for j, i in enumerate(on_host):
                blocks[i] = BlockKV(k[:, j], v[:, j], score[j])
        ctrl = parked.ctrl or BudgetState(budget=kv.budget)
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
            policy=engine.policy.model_dump(mode="json"),
            policy_version=engine.policy_info.get("version"),
            meta={"resident": parked.resident, "table_blocks": len(table.entries)},
            **self.expect,
        )
        engine.manager.close(kv)
        parked.kv = None
        parked.tier = "store"
        self.offloads += 1
        self._pending_writes += 1
        n = self._next_job()
        self._last_put[parked.session_id] = n
        self._jobs.put(("put", record, parked, n))

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
        if self.store is not None and now - self._last_sweep > min(opts.ttl_s / 10, 600.0):
            self._last_sweep = now
            for sid, n in self._unconfirmed_deletes.items():
                if self._last_put.get(sid, 0) < n:  # a write queued since will replace the deleted record
                    self._jobs.put(("delete", sid, n))
            self._jobs.put(("sweep", time.time() - opts.ttl_s))

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
        if self._worker is not None:
            self._jobs.put(("stop",))
            self._worker.join(timeout=10)
            self._worker = None

    # --------------------------------------------------------------------------------------- restores
    def _drain(self, block_s: float = 0.0) -> None:
        while True:
            try:
                item = self._done.get(timeout=block_s) if block_s else self._done.get_nowait()
            except queue.Empty:
                return
            block_s = 0.0
            kind = item[0]
            if kind == "got":
                self._restored(*item[1:])
            elif kind == "put":
                _, sid, err, parked, n = item
                self._pending_writes -= 1
                if self._last_put.get(sid) == n:
                    del self._last_put[sid]
                if err is not None:  # the record did not land: only what the request carries is left
                    if self.parked.get(sid) is parked:  # not a newer turn's session parked since
                        del self.parked[sid]
                    self._fault(err)
                else:
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
        self._store_down_until = 0.0

    def wait_for_restores(self, timeout_s: float) -> None:
        """Block briefly for a restore when nothing else can run (no busy loop while a record is read)."""
        self._drain(block_s=timeout_s)

    def _restored(self, session_id: str, request_id: str, record: SessionRecord | None, err: Exception | None) -> None:
        seq = self.engine.sequence(request_id)
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

    def _kv_from_record(self, seq: Sequence, record: SessionRecord) -> SequenceKV:
        """The record's blocks as a cache of the engine's: all to the host tier; ``_adopt`` brings the formerly
        resident ones to the device as memory allows."""
        engine = self.engine
        seq_id = engine.new_seq_id()
        table = BlockTable(engine.pool.block_size)
        n_blocks = int(record.meta.get("table_blocks", table.blocks_for(record.num_computed)))
        table.entries = [DROPPED] * n_blocks
        table.num_tokens = record.num_computed
        applied = record.controller.get("applied_budget")
        kv = SequenceKV(seq_id=seq_id, table=table, controller=seq.controller,
                        budget=float(applied) if applied is not None else seq.kv.budget,
                        since_compact=int(record.controller.get("since_compact", 0)))  # fmt: skip
        # registered before its blocks go to the host tier: a record larger than that tier has some of its own
        # blocks dropped by the put, and only a registered sequence's table is told which
        engine.manager._seqs[seq_id] = kv
        if record.blocks:
            order = sorted(record.blocks, reverse=True)  # the host tier drops the first put first: keep the prefix
            k = torch.stack([record.blocks[i].k for i in order], dim=1)
            v = torch.stack([record.blocks[i].v for i in order], dim=1)
            score = torch.stack([record.blocks[i].score for i in order])
            for i in order:
                table.entries[i] = ON_HOST
            engine.manager._mark_dropped(engine.host.put(seq_id, order, k, v, score))
        return kv

    # ---------------------------------------------------------------------------------- background I/O
    def _work(self) -> None:
        """Object-storage calls, off the engine thread (encoding costs about 15 ms per MiB of KV)."""
        assert self.store is not None
        store = self.store
        while True:
            job = self._jobs.get()
            kind = job[0]
            if kind == "stop":
                return
            # every put, get and delete answers, whatever failed: a restore left unanswered would keep its request
            # waiting for good, and an unanswered write would keep ``flush`` waiting out its timeout
            if kind == "put":
                _, record, parked, n = job
                _, err = _call(store.put, record)
                self._done.put(("put", record.session_id, err, parked, n))
            elif kind == "get":
                _, sid, rid, expect = job
                got, err = _call(store.get, sid, expect=expect)
                self._done.put(("got", sid, rid, got, err))
            elif kind == "delete":
                _, sid, n = job
                _, err = _call(store.delete, sid)
                self._done.put(("deleted", sid, err, n))
            elif kind == "sweep":
                try:
                    self._sweep(store, job[1])
                except Exception:  # a bug here must not take the worker down with every later session
                    log.exception("session store sweep failed")

    def _sweep(self, store: SessionStore, cutoff: float) -> None:
        """Delete the store's sessions last used before ``cutoff``; an object that cannot be read (corrupt, or
        another format's sharing the bucket) is left alone and does not stop the sweep."""
        sids, err = _call(store.list_sessions)
        for sid in sids if err is None else []:
            tokens, err = _call(store.read_tokens, sid)
            if err is None and tokens is not None and tokens.updated_at < cutoff and sid not in self.active:
                _call(store.delete, sid)

    # -------------------------------------------------------------------------------------------- metrics
    def stats(self) -> dict[str, Any]:
        by_tier = Counter(p.tier for p in self.parked.values())
        bytes_by_tier = {"device": 0, "host": 0}
        per_block = self.engine.pool.bytes_per_block
        for p in self.parked.values():
            if p.kv is not None:
                bytes_by_tier["device"] += len(p.kv.table.resident_indices()) * per_block
                bytes_by_tier["host"] += self.engine.host.bytes_of(p.kv.seq_id)
        store = self.store.stats() if self.store is not None else None
        return {
            "sessions": {tier: by_tier.get(tier, 0) for tier in TIERS},
            "session_hits": {tier: self.hits.get(tier, 0) for tier in TIERS},
            "session_misses": self.misses,
            "session_mismatches": self.mismatches,
            "session_tokens_reused": self.tokens_reused,
            "session_offloads": self.offloads,
            "session_faults": {k: self.faults.get(k, 0) for k in FAULT_KINDS},
            "session_bytes": {**bytes_by_tier, "store_written": store["bytes_written"] if store else 0},
            "session_store_reachable": store["reachable"] if store else None,
        }

    def drain_restore_seconds(self) -> list[float]:
        out = list(self.restore_seconds)
        self.restore_seconds.clear()
        return out


def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T | None, SessionStoreError | None]:
    """Run a store call on the worker: its result, or the fault it raised (the store has logged and counted its
    own). Anything else is a bug, logged here and answered as a fault, so the worker and its callers go on."""
    try:
        return fn(*args, **kwargs), None
    except SessionStoreError as e:
        return None, e
    except Exception as e:
        log.exception("session store call %s failed", getattr(fn, "__name__", fn))
        return None, SessionStoreError(f"{type(e).__name__}: {e}")


def _finite(x: float) -> float | None:
    return None if x == float("inf") else float(x)
