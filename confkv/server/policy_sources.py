"""Where a running server's cache policy can come from besides ``PUT /v1/cache_policy``: a watched file, or a
registry reference (``registry://NAME@ALIAS``) followed through ``store.watcher.PolicyWatcher``.

Both end the same way: a new policy goes through the engine thread's inbox (so it lands between two steps), and a
policy that cannot be loaded (bad YAML, an out-of-range value, a corrupt registry version) is refused and counted
(``confkv:policy_swaps_refused``) while the server keeps serving the policy it has.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

from confkv.config import CachePolicy, resolve_policy
from confkv.errors import ConfkvError
from confkv.server.engine_thread import EngineThread

log = logging.getLogger(__name__)


def _policy_files(path: Path) -> list[Path]:
    """The files whose change means a new policy: the YAML, or every file of an exported policy folder."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file())
    return [path]


def file_fingerprint(path: str | Path) -> tuple[tuple[str, int, int], ...]:
    """Names, mtimes and sizes: cheap to poll, and changes whenever an editor or a copy rewrites the file."""
    out = []
    for p in _policy_files(Path(path)):
        try:
            st = p.stat()
        except OSError:
            continue
        out.append((p.name, st.st_mtime_ns, st.st_size))
    return tuple(out)


def file_version(path: str | Path) -> str:
    """A short content hash, reported as the policy's version (``confkv:policy_info{version}``)."""
    h = hashlib.sha256()
    for p in _policy_files(Path(path)):
        try:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        except OSError:
            continue
    return h.hexdigest()[:12]


def apply_and_wait(
    engine_thread: EngineThread, policy: CachePolicy, source: str, version: str | None, name: str | None = None
) -> None:
    """Swap through the inbox and wait for the engine's verdict; a refusal is counted and logged."""
    try:
        engine_thread.set_policy(policy, source=source, version=version, name=name).result(timeout=120)
    except ConfkvError as err:
        engine_thread.refuse_policy(source, str(err))


class PolicyFileWatcher:
    """Polls ``path`` every ``interval_s`` and swaps the policy in when its contents change.

    Polling mtimes (not inotify) works on every filesystem, containers' bind mounts and ConfigMap symlink swaps
    included, at the cost of up to ``interval_s`` of delay.
    """

    def __init__(
        self,
        path: str | Path,
        engine_thread: EngineThread,
        *,
        interval_s: float = 2.0,
        overrides: list[str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.source = f"file:{self.path}"
        self._et = engine_thread
        self._interval = interval_s
        self._overrides = list(overrides or [])
        self._seen = file_fingerprint(self.path)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="confkv-policy-file", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.check_now()
            except Exception:  # the watcher must outlive any one bad read
                log.exception("policy file check failed")

    def check_now(self) -> bool:
        """Reload if the file changed; True when a new policy was handed to the engine."""
        fp = file_fingerprint(self.path)
        if fp == self._seen:
            return False
        self._seen = fp
        try:
            policy = resolve_policy(None, self.path, self._overrides or None)
        except ConfkvError as err:
            self._et.refuse_policy(self.source, str(err))
            return False
        apply_and_wait(self._et, policy, self.source, file_version(self.path))
        return True


def resolve_registry(ref: str, registry_url: str | None) -> Any:
    """``store.refs.resolve_ref``, imported late: serving without the registry needs none of SQLAlchemy."""
    from store.refs import resolve_ref

    return resolve_ref(ref, registry_url=registry_url)


def follow_registry(
    ref: str,
    engine_thread: EngineThread,
    *,
    registry_url: str | None,
    interval_s: float,
    current_version: Any,
    overrides: list[str] | None = None,
) -> Any:
    """A started ``PolicyWatcher`` that swaps in each new version the reference points to, with the server's
    ``--override``s applied to it as they were to the start policy (one that does not apply refuses the version)."""
    from store.watcher import PolicyWatcher

    source = f"registry:{ref}"

    def on_change(resolved: Any) -> None:
        policy = resolve_policy(resolved.policy, None, overrides) if overrides else resolved.policy
        apply_and_wait(engine_thread, policy, source, str(resolved.version), name=resolved.label)

    def on_refused(reason: Any) -> None:
        engine_thread.refuse_policy(source, str(reason))

    watcher = PolicyWatcher(
        ref,
        on_change,
        on_refused,
        registry_url=registry_url,
        interval_s=interval_s,
        current_version=current_version,
    )
    watcher.start()
    return watcher
