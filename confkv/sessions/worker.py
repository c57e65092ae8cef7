"""The session tier's background I/O: object-storage calls off the engine thread, answered through a queue.

The engine thread queues jobs (``put``, ``get``, ``delete``, ``sweep``) and drains answers between steps; jobs run in
the order they were queued. Every put, get and delete is answered, whatever failed: a restore left unanswered would
keep its request waiting for good, and an unanswered write would keep a flush waiting out its timeout. Encoding a
record costs about as much as writing it, so it happens here too, never on the engine thread.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from confkv.sessions.errors import CorruptRecord, ForeignRecord, SessionStoreError
from confkv.sessions.store import SessionStore

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreWorker:
    """One daemon thread running a session store's calls; ``submit`` a job, ``answers`` what came back."""

    def __init__(self, store: SessionStore, is_active: Callable[[str], bool]) -> None:
        self.store = store
        self._is_active = is_active  # a session with a request running now is never swept
        self._jobs: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._done: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._thread: threading.Thread | None = threading.Thread(target=self._work, name="confkv-sessions",
                                                                 daemon=True)  # fmt: skip
        self._thread.start()

    def submit(self, job: tuple[Any, ...]) -> None:
        """Queue ``("put", record, token, n)``, ``("get", session_id, request_id, expect)``, ``("delete",
        session_id, n)`` or ``("sweep", cutoff_unix_time)``."""
        self._jobs.put(job)

    def answers(self, block_s: float = 0.0) -> list[tuple[Any, ...]]:
        """Every answer ready now (waiting up to ``block_s`` for the first)."""
        out = []
        while True:
            try:
                out.append(self._done.get(timeout=block_s) if block_s else self._done.get_nowait())
            except queue.Empty:
                return out
            block_s = 0.0

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(("stop",))
            self._thread.join(timeout=10)
            self._thread = None

    def _work(self) -> None:
        store = self.store
        while True:
            job = self._jobs.get()
            kind = job[0]
            if kind == "stop":
                return
            if kind == "put":
                _, record, token, n = job
                _, err = call(store.put, record)
                self._done.put(("put", record.session_id, err, token, n))
            elif kind == "get":
                _, sid, rid, expect = job
                got, err = call(store.get, sid, expect=expect)
                self._done.put(("got", sid, rid, got, err))
            elif kind == "delete":
                _, sid, n = job
                _, err = call(store.delete, sid)
                self._done.put(("deleted", sid, err, n))
            elif kind == "sweep":
                try:
                    self._sweep(job[1])
                except Exception:  # a bug here must not take the worker down with every later session
                    log.exception("session store sweep failed")

    def _sweep(self, cutoff: float) -> None:
        """Delete the store's sessions last used before ``cutoff``. A damaged tokens object is read past: the record
        beside it says when the session was last used (and reading it writes the tokens again), and a session whose
        record is damaged too is garbage, deleted. An object that cannot be read for another reason (the store
        did not answer, another format's sharing the bucket) is left alone and does not stop the sweep."""
        store = self.store
        sids, err = call(store.list_sessions)
        for sid in sids if err is None else []:
            if self._is_active(sid):
                continue
            tokens, err = call(store.read_tokens, sid)
            updated_at = tokens.updated_at if err is None and tokens is not None else None
            if isinstance(err, CorruptRecord | ForeignRecord):
                record, err = call(store.get, sid, expect={})
                if isinstance(err, CorruptRecord):
                    updated_at = -math.inf
                elif record is not None:
                    updated_at = record.updated_at
            if updated_at is not None and updated_at < cutoff:
                call(store.delete, sid)


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T | None, SessionStoreError | None]:
    """Run a store call on the worker: its result, or the fault it raised (the store has logged and counted its
    own). Anything else is a bug, logged here and answered as a fault, so the worker and its callers go on."""
    try:
        return fn(*args, **kwargs), None
    except SessionStoreError as e:
        return None, e
    except Exception as e:
        log.exception("session store call %s failed", getattr(fn, "__name__", fn))
        return None, SessionStoreError(f"{type(e).__name__}: {e}")
