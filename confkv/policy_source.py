"""Where a cache policy comes from, and the one follower that keeps a running engine on it.

A policy can be named four ways: a controller name (``"dynamic"``), a YAML file or an exported folder, a
``registry://NAME@ALIAS`` reference (``store.refs``), or nothing (the default ``dynamic``, with the model's
calibrated thresholds when ``confkv calibrate`` wrote them: ``confkv.calibration``). ``choose_policy`` turns any of
them, plus a controller name and overrides put on top, into a ``PolicyChoice``: the policy, what to call it
(``name``, ``version``, ``source``: the engine's policy info and the server's ``confkv:policy_info``), and what can
change under it (the file, or the registry alias).

``PolicyFollower`` follows that source: it polls a file's names, mtimes and sizes (works on every filesystem, bind
mounts and ConfigMap symlink swaps included), or watches a registry alias (``store.watcher.PolicyWatcher``: polling,
and PostgreSQL's NOTIFY at once), puts the same controller name and overrides on every new version, and hands the
result to ``on_change`` (``LLMEngine.request_policy`` for ``LLM``; the engine thread's inbox for the server). A
version that does not load is handed to ``on_refused`` and the running policy stays. ``LLM`` and ``confkv serve``
both use it; the registry (SQLAlchemy) is imported only when a reference is named.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from confkv.calibration import calibrated_thresholds
from confkv.config import CachePolicy, load_policy_file, make_policy, parse_overrides, preset_scorer
from confkv.errors import ConfkvError
from confkv.plugins import CONTROLLERS

if TYPE_CHECKING:
    from store.refs import ResolvedPolicy

log = logging.getLogger(__name__)

REGISTRY_SCHEME = "registry://"
Overrides = list[str] | dict[str, Any] | None
#: ``on_change(policy, info)``: a new policy to swap in, with its ``name``/``version``/``source``.
OnChange = Callable[[CachePolicy, dict[str, str | None]], None]
#: ``on_refused(source, reason)``: a new version that was not taken.
OnRefused = Callable[[str, str], None]


def is_registry_ref(s: object) -> bool:
    """True for a string of the form ``registry://...`` (a ``Path`` never is one)."""
    return isinstance(s, str) and s.startswith(REGISTRY_SCHEME)


def _resolve_ref(ref: str, registry_url: str | None) -> ResolvedPolicy:
    from store.refs import resolve_ref  # the registry's SQLAlchemy only when a reference is named

    return resolve_ref(ref, registry_url)


def load_policy(source: str | Path, registry_url: str | None = None) -> CachePolicy:
    """A policy file, an exported folder, or a ``registry://`` reference, loaded."""
    if is_registry_ref(source):
        return _resolve_ref(str(source), registry_url).policy
    return load_policy_file(source)


def overlay(base: dict[str, Any], controller: str | None, overrides: Overrides) -> CachePolicy:
    """A controller name and overrides put on top of a policy's values (later ones win). A preset named on top
    ranks its own way: a file's ``scorer`` belongs to the file's rule."""
    values = dict(base)
    if controller is not None:
        if controller not in CONTROLLERS:
            raise ConfkvError(f"unknown policy {controller!r}; choose one of: {', '.join(CONTROLLERS)}",
                              param="controller")  # fmt: skip
        values["controller"] = controller
        if preset_scorer(controller) is not None:
            values["scorer"] = None
    if overrides:
        values.update(parse_overrides(overrides) if isinstance(overrides, list) else overrides)
    return make_policy(values)


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


def _policy_files(path: Path) -> list[Path]:
    """The files whose change means a new policy: the YAML, or every file of an exported policy folder."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file())
    return [path]


@dataclass(frozen=True)
class PolicyChoice:
    """A policy as chosen at start, what to call it, and what to follow (a file or a registry version)."""

    policy: CachePolicy
    info: dict[str, str | None]
    controller: str | None = None  # put on every followed version, as at start
    overrides: Overrides = None
    file: Path | None = None
    resolved: ResolvedPolicy | None = None

    @property
    def followable(self) -> bool:
        return self.file is not None or (self.resolved is not None and self.resolved.alias is not None)


def choose_policy(
    policy: str | CachePolicy | None = None,
    policy_file: str | Path | None = None,
    overrides: Overrides = None,
    *,
    model: str | None = None,
    cache_dir: str | Path | None = None,
    registry_url: str | None = None,
    source: str = "startup",
) -> PolicyChoice:
    """Combine the ways of naming a policy; later ones win: file (or registry reference), controller name,
    overrides. ``policy`` may itself be a registry reference (as ``confkv serve --policy registry://...``).

    With ``model`` given, the default policy (``dynamic`` named by name or not at all, no file) takes the model's
    calibrated ``entropy_threshold``/``gap_threshold``; overrides still win. ``source`` names a choice that came from
    neither a file nor the registry (``startup``; the server says ``cli``).
    """
    if is_registry_ref(policy):
        if policy_file:
            raise ConfkvError("give either --policy registry://... or --policy-file, not both", param="policy")
        policy, policy_file = None, policy
    if isinstance(policy, CachePolicy):
        return PolicyChoice(overlay(policy.model_dump(), None, overrides), {"name": policy.controller,
                            "version": None, "source": source})  # fmt: skip
    if is_registry_ref(policy_file):
        resolved = _resolve_ref(str(policy_file), registry_url)
        chosen = overlay(resolved.policy.model_dump(), policy, overrides)
        info = {"name": resolved.label, "version": str(resolved.version), "source": resolved.ref}
        return PolicyChoice(chosen, info, policy, overrides, resolved=resolved)
    base = load_policy_file(policy_file).model_dump() if policy_file else {}
    if model is not None and not policy_file and (policy or "dynamic") == "dynamic":
        base.update(calibrated_thresholds(model, cache_dir) or {})
    chosen = overlay(base, policy, overrides)
    if policy_file:
        info = {"name": chosen.controller, "version": file_version(policy_file), "source": f"file:{policy_file}"}
        return PolicyChoice(chosen, info, policy, overrides, file=Path(policy_file))
    return PolicyChoice(chosen, {"name": chosen.controller, "version": None, "source": source}, policy, overrides)


def resolve_policy(
    policy: str | CachePolicy | None = None,
    policy_file: str | Path | None = None,
    overrides: Overrides = None,
    *,
    model: str | None = None,
    cache_dir: str | Path | None = None,
    registry_url: str | None = None,
) -> CachePolicy:
    """``choose_policy``'s policy alone (for callers that follow nothing)."""
    return choose_policy(policy, policy_file, overrides, model=model, cache_dir=cache_dir,
                         registry_url=registry_url).policy  # fmt: skip


class PolicyFollower:
    """Follows a ``PolicyChoice``'s file or registry alias and hands each new version to ``on_change``.

    ``check_now()`` checks synchronously and returns True when a new policy was handed over; ``start()`` checks
    every ``interval_s`` seconds from a daemon thread (and, for a registry on PostgreSQL, at each NOTIFY).
    """

    def __init__(
        self,
        choice: PolicyChoice,
        on_change: OnChange,
        on_refused: OnRefused,
        *,
        interval_s: float = 2.0,
        registry_url: str | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ConfkvError(f"watch interval must be positive (got {interval_s})")
        if not choice.followable:
            raise ConfkvError("nothing to follow: the policy came from neither a file nor a registry alias")
        self.choice = choice
        self.on_change = on_change
        self.on_refused = on_refused
        self.interval_s = float(interval_s)
        self.source = choice.info["source"] or ""
        self._seen = file_fingerprint(choice.file) if choice.file is not None else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.watcher: Any = None
        if choice.resolved is not None:
            from store.watcher import PolicyWatcher

            self.watcher = PolicyWatcher(choice.resolved.ref, self._registry_changed, self._registry_refused,
                                         registry_url=registry_url, interval_s=interval_s,
                                         current_version=choice.resolved.version)  # fmt: skip

    def _put_on_top(self, policy: CachePolicy) -> CachePolicy:
        return overlay(policy.model_dump(), self.choice.controller, self.choice.overrides)

    # ------------------------------------------------------------------------------------------- registry
    def _registry_changed(self, r: ResolvedPolicy) -> None:
        """Called by the watcher with a version that loads; a ``ConfkvError`` raised here refuses it."""
        self.on_change(self._put_on_top(r.policy), {"name": r.label, "version": str(r.version), "source": r.ref})

    def _registry_refused(self, reason: str) -> None:
        self.on_refused(self.source, reason)

    # ----------------------------------------------------------------------------------------------- file
    def check_now(self) -> bool:
        """Check the source now; True when a new policy was handed to ``on_change``."""
        if self.watcher is not None:
            return bool(self.watcher.check_now())
        assert self.choice.file is not None
        fp = file_fingerprint(self.choice.file)
        if fp == self._seen:
            return False
        self._seen = fp
        try:
            policy = self._put_on_top(load_policy_file(self.choice.file))
            info = {"name": policy.controller, "version": file_version(self.choice.file), "source": self.source}
            self.on_change(policy, info)
        except ConfkvError as err:
            self.on_refused(self.source, str(err))
            return False
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_now()
            except Exception:  # the follower must outlive any one bad read
                log.exception("policy file check failed")

    def start(self) -> PolicyFollower:
        if self.watcher is not None:
            self.watcher.start()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="confkv-policy-file", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
