"""Names, references and the plain results the registry returns (frozen dataclasses, never ORM objects, so callers
need no open session): a policy or alias name's rules, ``NAME@ALIAS`` / ``NAME@VERSION`` references, and the
records of versions, evaluations, alias moves and policies."""

from __future__ import annotations

import getpass
import re
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from store.errors import RegistryError
from store.models import AliasMove, PolicyVersion

DEFAULT_ALIAS = "production"
LATEST = "latest"  # resolves to the newest version; cannot be used as an alias name (as in MLflow)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ALIAS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")


def who_am_i() -> str:
    """``user@host``: recorded with each version and alias move."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise RegistryError(f"invalid policy name {name!r}: use letters, digits, '.', '_' or '-' (at most 128)")
    return name


def check_alias(alias: str) -> str:
    if not isinstance(alias, str) or not ALIAS_RE.match(alias) or alias == LATEST:
        raise RegistryError(f"invalid alias {alias!r}: start with a letter; letters, digits, '_' or '-'; "
                            f"{LATEST!r} is reserved")  # fmt: skip
    return alias


def utc(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)  # SQLite keeps no zone


# ------------------------------------------------------------------------------------------------ plain results
@dataclass(frozen=True)
class VersionInfo:
    policy: str
    version: int
    kind: str
    parameters: dict[str, Any]
    sha256: str
    artifact_uri: str | None
    created_at: datetime
    created_by: str | None
    description: str | None
    model: str | None
    mlflow_run_id: str | None
    optuna_study: str | None
    optuna_trial: int | None
    parent: tuple[str, int] | None  # (policy name, version) it was derived from
    aliases: tuple[str, ...] = ()

    @property
    def ref(self) -> str:
        return f"{self.policy}@{self.version}"

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["created_at"] = self.created_at.isoformat()
        d["parent"] = None if self.parent is None else f"{self.parent[0]}@{self.parent[1]}"
        d["aliases"] = list(self.aliases)
        return d


@dataclass(frozen=True)
class EvaluationInfo:
    policy: str
    version: int
    workload: str
    split: str
    model: str | None
    reward: float | None
    metrics: dict[str, Any]
    created_at: datetime

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["created_at"] = self.created_at.isoformat()
        return d


@dataclass(frozen=True)
class AliasMoveInfo:
    policy: str
    alias: str
    action: str  # promote, rollback, backfill
    from_version: int | None
    to_version: int | None
    at: datetime
    who: str | None
    reason: str | None
    changed: bool = True  # False: the alias already pointed there, nothing was recorded

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["at"] = self.at.isoformat()
        return d


@dataclass(frozen=True)
class PolicySummary:
    name: str
    versions: int
    latest: int | None
    aliases: dict[str, int] = field(default_factory=dict)
    created_at: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["created_at"] = None if self.created_at is None else self.created_at.isoformat()
        return d


def version_info(v: PolicyVersion, aliases: tuple[str, ...] = ()) -> VersionInfo:
    parent = None if v.parent is None else (v.parent.policy.name, v.parent.version)
    return VersionInfo(
        policy=v.policy.name, version=v.version, kind=v.kind, parameters=dict(v.parameters), sha256=v.artifact_sha256,
        artifact_uri=v.artifact_uri, created_at=utc(v.created_at), created_by=v.created_by,
        description=v.description, model=v.model, mlflow_run_id=v.mlflow_run_id, optuna_study=v.optuna_study,
        optuna_trial=v.optuna_trial, parent=parent, aliases=aliases,
    )  # fmt: skip


def move_info(m: AliasMove, policy: str) -> AliasMoveInfo:
    return AliasMoveInfo(
        policy=policy, alias=m.alias, action=m.action,
        from_version=None if m.from_version is None else m.from_version.version,
        to_version=None if m.to_version is None else m.to_version.version,
        at=utc(m.at), who=m.who, reason=m.reason,
    )  # fmt: skip


def parse_version_ref(ref: int | str | None) -> int | str:
    """``3``/``"3"``/``"v3"`` -> 3; ``None`` -> ``"production"``; other strings are aliases (or ``latest``)."""
    if ref is None or ref == "":
        return DEFAULT_ALIAS
    if isinstance(ref, int):
        return ref
    s = ref.strip()
    if s.isdigit():
        return int(s)
    if s[:1] in ("v", "V") and s[1:].isdigit():
        return int(s[1:])
    return s


def split_ref(spec: str) -> tuple[str, int | str | None]:
    """``NAME@3`` -> (NAME, 3); ``NAME@staging`` -> (NAME, "staging"); ``NAME`` -> (NAME, None)."""
    name, sep, ref = spec.partition("@")
    check_name(name)
    if sep and not ref:
        raise RegistryError(f"{spec!r}: nothing after '@' (expected NAME@VERSION or NAME@ALIAS)")
    return name, (parse_version_ref(ref) if sep else None)
