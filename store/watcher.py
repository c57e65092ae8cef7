"""Follow a ``registry://NAME@ALIAS`` reference and report when its alias moves: the registry half of hot swap.

A ``PolicyWatcher`` polls the alias every ``interval_s`` seconds from a daemon thread. On PostgreSQL it also
``LISTEN``\\s on the channel the registry ``NOTIFY``\\s on every alias move (``store.registry``), so it reacts at
once; polling stays on as the fallback (a dropped listen connection, a missed notification).

When the alias points at a version other than the current one, the watcher resolves it fully (checksum, artifact
unpacked, policy and controller built: ``store.refs.resolve_ref``) and only then calls ``on_change`` with the
``ResolvedPolicy``; the engine swaps between two steps. A version that fails its checksum or does not load is
refused: ``on_refused(reason)`` is called and the refusal logged, once per refused version (it is not retried
every poll, but a later move away and back is checked again), and the current policy stays in place. An artifact
that cannot be read at all (its storage unreachable) is not a refusal: it is tried again at the next check.

A reference that names a fixed version (``registry://NAME@3``) never moves; watching it is allowed and does
nothing after the first check. Database errors while polling are logged and retried at the next interval: a
registry outage must not disturb serving.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confkv.errors import ConfkvError
from store.errors import ArtifactUnavailable
from store.refs import ResolvedPolicy, parse_ref

log = logging.getLogger("confkv.registry.watcher")


class PolicyWatcher:
    """Watch ``ref`` and call ``on_change`` when it resolves to a new, loadable version.

    ``current_version`` is the version already in use (``None``: the first check reports whatever the reference
    resolves to). ``check_now()`` checks synchronously and returns True when ``on_change`` was called.
    """

    def __init__(
        self,
        ref: str,
        on_change: Callable[[ResolvedPolicy], None],
        on_refused: Callable[[str], None] | None = None,
        *,
        registry_url: str | None = None,
        interval_s: float = 5.0,
        current_version: int | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ConfkvError(f"watch interval must be positive (got {interval_s})")
        self.name, self.target = parse_ref(ref)
        self.ref = ref
        self.on_change = on_change
        self.on_refused = on_refused
        self.registry_url = registry_url
        self.interval_s = float(interval_s)
        self.current_version = current_version
        self.refused_version: int | None = None
        self.checks = 0
        self.changes = 0
        self.refusals = 0
        self.listening = False  # True while a PostgreSQL LISTEN connection is up
        self._registry: Any = None
        self._check_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---------------------------------------------------------------------------------------------- checking
    def _reg(self) -> Any:
        if self._registry is None:
            from store.registry import Registry

            self._registry = Registry(self.registry_url)
        return self._registry

    def check_now(self) -> bool:
        """Look at the reference now; call ``on_change`` (and return True) if it moved to a version that loads.

        A version that does not load (or that ``on_change`` refuses with a ``ConfkvError``) goes to ``on_refused``
        and False is returned. Registry errors (unreachable, alias removed) and an artifact that cannot be read at
        its URI (``ArtifactUnavailable``) are raised to a direct caller; the watcher's own thread logs them and
        tries again at the next interval.
        """
        from store.refs import validate_policy

        with self._check_lock:
            self.checks += 1
            reg = self._reg()
            info = reg.get_version(self.name, self.target)
            if info.version == self.current_version:
                self.refused_version = None  # moved back: a later move to the refused version is checked again
                return False
            if info.version == self.refused_version:
                return False
            try:
                _, policy, path = reg.load(self.name, info.version)
                validate_policy(policy, info.ref)
                alias = self.target if isinstance(self.target, str) and self.target != "latest" else None
                # on_change may refuse too (the engine cannot take a policy with another block size); any other
                # exception leaves current_version unchanged, so the version is tried again at the next check
                self.on_change(ResolvedPolicy(policy, info.policy, info.version, alias, info.sha256, path))
            except ArtifactUnavailable:
                raise  # not the version's fault: tried again at the next check, like an unreachable registry
            except ConfkvError as err:
                self.refused_version = info.version
                self.refusals += 1
                reason = f"refused {self.ref} -> {info.ref}: {err}"
                log.warning("%s; keeping version %s", reason, self.current_version)
                if self.on_refused is not None:
                    self.on_refused(reason)
                return False
            log.info("%s moved: version %s -> %s", self.ref, self.current_version, info.version)
            self.current_version = info.version
            self.refused_version = None
            self.changes += 1
            return True

    def _safe_check(self) -> None:
        try:
            self.check_now()
        except Exception as err:  # registry unreachable, alias removed, a failing callback: keep serving
            log.warning("watching %s: %s", self.ref, err)

    # ---------------------------------------------------------------------------------------------- threads
    def start(self) -> PolicyWatcher:
        """Start polling (and listening, on PostgreSQL) in daemon threads; returns self."""
        if self._threads:
            return self
        self._stop.clear()
        poller = threading.Thread(target=self._poll_loop, name=f"confkv-watch-{self.name}", daemon=True)
        self._threads = [poller]
        if self._reg().engine.dialect.name == "postgresql":
            self._threads.append(threading.Thread(target=self._listen_loop, name=f"confkv-listen-{self.name}",
                                                  daemon=True))  # fmt: skip
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the threads (waits up to ``timeout`` seconds for them)."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)
        self._threads = []

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def __enter__(self) -> PolicyWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the check: a notification that arrives during it triggers another
            self._safe_check()
            self._wake.wait(self.interval_s)  # a notification (or stop) ends the wait early

    def _listen_loop(self) -> None:
        """PostgreSQL only: wake the poller as soon as a move of this policy is notified; reconnect on errors."""
        import psycopg

        from store.registry import NOTIFY_CHANNEL

        url = self._reg().engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while not self._stop.is_set():
            try:
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self.listening = True
                    self._wake.set()  # catch a move made before LISTEN took effect
                    while not self._stop.is_set():  # short waits so that stop() is prompt
                        for note in conn.notifies(timeout=0.25, stop_after=1):
                            if self._concerns_us(note.payload):
                                self._wake.set()
            except Exception as err:
                self.listening = False
                if self._stop.is_set():
                    break
                log.warning("LISTEN on the registry failed (%s); polling every %.1fs", err, self.interval_s)
                self._stop.wait(max(self.interval_s, 1.0))
        self.listening = False

    def _concerns_us(self, payload: str) -> bool:
        try:
            doc = json.loads(payload)
        except ValueError:
            return True
        return doc.get("policy") == self.name


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass (tests and scripts that wait for a swap)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
