"""The policy registry: versions with their lineage, evaluations, aliases and the history of every alias move.

One ``Registry`` per database URL; every public method is one unit of work in its own session, and returns plain
frozen dataclasses (never ORM objects) so callers need no open session.

Concurrency. Each write that depends on what is already there (the next version number, the alias's current
version, the rollback target) first locks its policy's row: ``SELECT ... FOR UPDATE`` on PostgreSQL, and on SQLite
the whole database through ``BEGIN IMMEDIATE`` (``store.db``). So two promotions of the same alias run one after
the other, each records the version it really replaced, and the unique constraints in ``store.models`` back this
up: a unit that still collides (two processes creating the same new policy name) is retried from the start.

On PostgreSQL every alias move also sends ``NOTIFY confkv_registry, '{"policy":..,"alias":..,"version":..}'``
in the same transaction (delivered at commit), which ``store.watcher`` listens to.

Rollback replays the alias's history as a stack: a promotion pushes its version, a rollback pops one. So
repeated rollbacks walk back through the versions the alias held (v3 -> v2 -> v1), rather than toggling between
the last two.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from confkv.config import CachePolicy
from store.artifacts import PackedPolicy, fetch_uri, materialise, pack_path, policy_yaml, store_at, verify
from store.db import display_url, get_engine, writer
from store.errors import NotFoundError, PromotionRefused, RegistryError
from store.models import KIND_LEARNED, Alias, AliasMove, Evaluation, Policy, PolicyVersion
from store.names import (
    DEFAULT_ALIAS,
    LATEST,
    AliasMoveInfo,
    EvaluationInfo,
    PolicySummary,
    VersionInfo,
    check_alias,
    check_name,
    move_info,
    parse_version_ref,
    split_ref,
    utc,
    version_info,
    who_am_i,
)

T = TypeVar("T")

NOTIFY_CHANNEL = "confkv_registry"
UNSET: Any = object()  # "no expectation" for set_alias, "every version" for evaluations


# ------------------------------------------------------------------------------------------------ the registry
class Registry:
    """A policy registry at ``url`` (default: ``$CONFKV_REGISTRY_URL`` or the user's SQLite file).

    Opening it migrates the database to the newest schema revision (Alembic) once per process.
    """

    def __init__(self, url: str | None = None) -> None:
        self.url = display_url(url)
        with self._db_errors():
            self.engine = get_engine(url)
        self._writer = writer(self.engine)

    # ------------------------------------------------------------------------------------------- plumbing
    @contextmanager
    def _db_errors(self) -> Iterator[None]:
        try:
            yield
        except IntegrityError:
            raise
        except DBAPIError as err:
            msg = str(err.orig).strip().splitlines()[0] if err.orig is not None else str(err)
            raise RegistryError(f"registry at {self.url}: {msg}") from None

    def _read(self, fn: Callable[[Session], T]) -> T:
        with self._db_errors(), Session(self.engine) as s:
            return fn(s)

    def _write(self, fn: Callable[[Session], T], attempts: int = 8) -> T:
        """Run ``fn`` in one write transaction; retry it whole when a unique constraint says it raced."""
        for attempt in range(attempts):
            try:
                with self._db_errors(), Session(self._writer, expire_on_commit=False) as s, s.begin():
                    return fn(s)
            except IntegrityError as err:
                if attempt == attempts - 1:
                    msg = str(err.orig).strip().splitlines()[0]
                    raise RegistryError(f"registry at {self.url}: write kept conflicting: {msg}") from None
                time.sleep(0.02 * (attempt + 1))
        raise AssertionError("unreachable")

    @staticmethod
    def _policy(s: Session, name: str, *, lock: bool = False) -> Policy:
        q = select(Policy).where(Policy.name == name)
        p = s.scalars(q.with_for_update() if lock else q).one_or_none()
        if p is None:
            raise NotFoundError(f"no policy named {name!r} in the registry")
        return p

    @staticmethod
    def _version(s: Session, p: Policy, ref: int | str | None) -> PolicyVersion:
        r = parse_version_ref(ref)
        if isinstance(r, int):
            v = s.scalars(
                select(PolicyVersion).where(PolicyVersion.policy_id == p.id, PolicyVersion.version == r)
            ).one_or_none()
            if v is None:
                nums = s.scalars(select(PolicyVersion.version).where(PolicyVersion.policy_id == p.id)).all()
                have = f"versions {min(nums)}-{max(nums)}" if nums else "no versions"
                raise NotFoundError(f"policy {p.name!r} has no version {r} ({have})")
            return v
        if r == LATEST:
            v = s.scalars(select(PolicyVersion).where(PolicyVersion.policy_id == p.id)
                          .order_by(PolicyVersion.version.desc()).limit(1)).one_or_none()  # fmt: skip
            if v is None:
                raise NotFoundError(f"policy {p.name!r} has no versions")
            return v
        a = s.scalars(select(Alias).where(Alias.policy_id == p.id, Alias.alias == r)).one_or_none()
        if a is None:
            raise NotFoundError(f"policy {p.name!r} has no alias {r!r}")
        return a.version

    @staticmethod
    def _aliases_of(s: Session, p: Policy) -> dict[int, tuple[str, ...]]:
        out: dict[int, list[str]] = {}
        for a in s.scalars(select(Alias).where(Alias.policy_id == p.id).order_by(Alias.alias)):
            out.setdefault(a.version.version, []).append(a.alias)
        return {k: tuple(v) for k, v in out.items()}

    # ------------------------------------------------------------------------------------------- register
    def register(
        self,
        name: str,
        source: str | Path | CachePolicy | PackedPolicy,
        *,
        model: str | None = None,
        mlflow_run_id: str | None = None,
        optuna_study: str | None = None,
        optuna_trial: int | None = None,
        parent: str | int | None = None,
        description: str | None = None,
        created_by: str | None = None,
        artifact_store: str | None = None,
    ) -> VersionInfo:
        """Add a new version (numbered 1, 2, ... per policy, no alias) and return it.

        ``source`` is a YAML policy file, an exported folder, a ``CachePolicy`` or an already packed policy; it is
        validated (it must load) before anything is written. The artifact goes into the database, or under
        ``artifact_store`` (a folder or fsspec URL) with only its URI and checksum in the database.
        ``parent`` is ``N`` (a version of this policy) or ``OTHER@N``.
        """
        check_name(name)
        if isinstance(source, PackedPolicy):
            packed = source
        elif isinstance(source, CachePolicy):
            from store.artifacts import pack_policy

            packed = pack_policy(source)
        else:
            packed = pack_path(source)
        uri = store_at(artifact_store, packed.sha256, packed.kind, packed.artifact) if artifact_store else None
        who = created_by or who_am_i()

        def unit(s: Session) -> VersionInfo:
            p = s.scalars(select(Policy).where(Policy.name == name).with_for_update()).one_or_none()
            if p is None:
                p = Policy(name=name)
                s.add(p)
                s.flush()  # a concurrent creation of the same name fails here and the unit is retried
            parent_row = None
            if parent is not None:
                pname, pref = (name, parent) if isinstance(parent, int) or "@" not in str(parent) else split_ref(
                    str(parent))  # fmt: skip
                parent_row = self._version(s, p if pname == name else self._policy(s, pname), pref)
            last = s.scalar(select(func.max(PolicyVersion.version)).where(PolicyVersion.policy_id == p.id))
            v = PolicyVersion(
                policy=p, version=(last or 0) + 1, kind=packed.kind, parameters=packed.parameters,
                artifact=None if uri else packed.artifact, artifact_uri=uri, artifact_sha256=packed.sha256,
                created_by=who, description=description, model=model, mlflow_run_id=mlflow_run_id,
                optuna_study=optuna_study, optuna_trial=optuna_trial, parent=parent_row,
            )  # fmt: skip
            s.add(v)
            s.flush()
            return version_info(v)

        return self._write(unit)

    # ------------------------------------------------------------------------------------------- aliases
    def set_alias(
        self,
        name: str,
        alias: str,
        version: int | str,
        *,
        reason: str | None = None,
        who: str | None = None,
        expected: int | None = UNSET,
        action: str = "promote",
    ) -> AliasMoveInfo:
        """Point ``alias`` at ``version`` (a number, ``latest`` or another alias) and record the move.

        ``expected``: the version the caller saw under the alias (None: no version); when the alias has moved
        since, the move is refused (``PromotionRefused``). The gate uses this so that it never promotes past a
        version it did not compare against.
        """
        check_name(name)
        check_alias(alias)
        who = who or who_am_i()

        def unit(s: Session) -> AliasMoveInfo:
            p = self._policy(s, name, lock=True)
            target = self._version(s, p, version)
            row = s.scalars(select(Alias).where(Alias.policy_id == p.id, Alias.alias == alias)
                            .with_for_update()).one_or_none()  # fmt: skip
            current = None if row is None else row.version.version
            if expected is not UNSET and current != expected:
                raise PromotionRefused(
                    f"{name}@{alias} moved while it was being checked (expected "
                    f"{'no version' if expected is None else f'version {expected}'}, now "
                    f"{'no version' if current is None else f'version {current}'}); run the promotion again"
                )
            now = datetime.now(timezone.utc)
            if row is not None and row.version_id == target.id:
                return AliasMoveInfo(name, alias, action, current, current, now, who, reason, changed=False)
            prev_id = None if row is None else row.version_id
            if row is None:
                row = Alias(policy_id=p.id, alias=alias, version_id=target.id, updated_at=now, updated_by=who)
                s.add(row)
            else:
                row.version_id, row.updated_at, row.updated_by = target.id, now, who
            s.add(AliasMove(policy_id=p.id, alias=alias, action=action, from_version_id=prev_id,
                            to_version_id=target.id, at=now, who=who, reason=reason))  # fmt: skip
            s.flush()
            _notify(s, name, alias, target.version)
            return AliasMoveInfo(name, alias, action, current, target.version, now, who, reason)

        return self._write(unit)

    def promote(self, name: str, version: int | str, alias: str = DEFAULT_ALIAS, **kw: Any) -> AliasMoveInfo:
        return self.set_alias(name, alias, version, **kw)

    def rollback(
        self, name: str, alias: str = DEFAULT_ALIAS, *, reason: str | None = None, who: str | None = None
    ) -> AliasMoveInfo:
        """Move ``alias`` back to the version it pointed at before its current one (see the module doc)."""
        check_name(name)
        check_alias(alias)
        who = who or who_am_i()

        def unit(s: Session) -> AliasMoveInfo:
            p = self._policy(s, name, lock=True)
            row = s.scalars(select(Alias).where(Alias.policy_id == p.id, Alias.alias == alias)
                            .with_for_update()).one_or_none()  # fmt: skip
            if row is None:
                raise NotFoundError(f"policy {name!r} has no alias {alias!r}: nothing to roll back")
            stack: list[int] = []
            for m in s.scalars(select(AliasMove).where(AliasMove.policy_id == p.id, AliasMove.alias == alias)
                               .order_by(AliasMove.id)):  # fmt: skip
                if m.action == "rollback":
                    if stack:
                        stack.pop()
                elif m.to_version_id is not None and (not stack or stack[-1] != m.to_version_id):
                    stack.append(m.to_version_id)
            if not stack or stack[-1] != row.version_id:  # history and pointer disagree: trust the pointer
                stack.append(row.version_id)
            if len(stack) < 2:
                raise NotFoundError(f"{name}@{alias} (version {row.version.version}) has no earlier version "
                                    "to roll back to")  # fmt: skip
            target = s.get(PolicyVersion, stack[-2])
            assert target is not None
            current = row.version
            now = datetime.now(timezone.utc)
            row.version_id, row.updated_at, row.updated_by = target.id, now, who
            s.add(AliasMove(policy_id=p.id, alias=alias, action="rollback", from_version_id=current.id,
                            to_version_id=target.id, at=now, who=who, reason=reason))  # fmt: skip
            s.flush()
            _notify(s, name, alias, target.version)
            return AliasMoveInfo(name, alias, "rollback", current.version, target.version, now, who, reason)

        return self._write(unit)

    # ------------------------------------------------------------------------------------------- evaluations
    def add_evaluation(
        self,
        name: str,
        version: int | str,
        workload: str,
        split: str,
        metrics: dict[str, Any],
        *,
        model: str | None = None,
        reward: float | None = None,
    ) -> EvaluationInfo:
        """Record a version's metrics on a workload split (``reward`` defaults to ``metrics["reward"]``)."""
        clean = json.loads(json.dumps(metrics, default=float))  # numpy scalars and the like become JSON numbers
        if reward is None and isinstance(clean.get("reward"), (int, float)):
            reward = float(clean["reward"])

        def unit(s: Session) -> EvaluationInfo:
            v = self._version(s, self._policy(s, name), version)
            e = Evaluation(version_id=v.id, workload=workload, split=split, model=model, reward=reward, metrics=clean)
            s.add(e)
            s.flush()
            return EvaluationInfo(name, v.version, workload, split, model, reward, clean, utc(e.created_at))

        return self._write(unit)

    # ------------------------------------------------------------------------------------------- reads
    def list_policies(self) -> list[PolicySummary]:
        def unit(s: Session) -> list[PolicySummary]:
            out = []
            for p in s.scalars(select(Policy).order_by(Policy.name)):
                nums = s.scalars(select(PolicyVersion.version).where(PolicyVersion.policy_id == p.id)).all()
                aliases = {a.alias: a.version.version for a in p.aliases}
                out.append(PolicySummary(p.name, len(nums), max(nums) if nums else None, dict(sorted(aliases.items())),
                                         utc(p.created_at)))  # fmt: skip
            return out

        return self._read(unit)

    def get_version(self, name: str, ref: int | str | None = None) -> VersionInfo:
        """A version by number, ``latest``, or alias (default ``production``)."""
        check_name(name)

        def unit(s: Session) -> VersionInfo:
            p = self._policy(s, name)
            v = self._version(s, p, ref)
            return version_info(v, self._aliases_of(s, p).get(v.version, ()))

        return self._read(unit)

    def alias_version(self, name: str, alias: str = DEFAULT_ALIAS) -> int | None:
        """The version ``alias`` points at now (None: the alias is not set)."""
        check_name(name)

        def unit(s: Session) -> int | None:
            p = self._policy(s, name)
            a = s.scalars(select(Alias).where(Alias.policy_id == p.id, Alias.alias == alias)).one_or_none()
            return None if a is None else a.version.version

        return self._read(unit)

    def versions(self, name: str) -> list[VersionInfo]:
        check_name(name)

        def unit(s: Session) -> list[VersionInfo]:
            p = self._policy(s, name)
            aliases = self._aliases_of(s, p)
            return [version_info(v, aliases.get(v.version, ())) for v in p.versions]

        return self._read(unit)

    def evaluations(self, name: str, version: int | str | None = UNSET) -> list[EvaluationInfo]:
        """Evaluations of one version, or of every version of the policy when ``version`` is not given."""
        check_name(name)

        def unit(s: Session) -> list[EvaluationInfo]:
            p = self._policy(s, name)
            q = select(Evaluation).join(PolicyVersion).where(PolicyVersion.policy_id == p.id)
            if version is not UNSET:
                q = q.where(Evaluation.version_id == self._version(s, p, version).id)
            return [EvaluationInfo(name, e.version.version, e.workload, e.split, e.model, e.reward, dict(e.metrics),
                                   utc(e.created_at)) for e in s.scalars(q.order_by(Evaluation.id))]  # fmt: skip

        return self._read(unit)

    def history(self, name: str, alias: str | None = None) -> list[AliasMoveInfo]:
        """Every move of the policy's aliases (or of one alias), oldest first."""
        check_name(name)

        def unit(s: Session) -> list[AliasMoveInfo]:
            p = self._policy(s, name)
            q = select(AliasMove).where(AliasMove.policy_id == p.id)
            if alias is not None:
                q = q.where(AliasMove.alias == alias)
            return [move_info(m, name) for m in s.scalars(q.order_by(AliasMove.id))]

        return self._read(unit)

    # ------------------------------------------------------------------------------------------- artifacts
    def artifact(self, name: str, ref: int | str | None = None) -> tuple[VersionInfo, bytes]:
        """A version and its artifact bytes, checked against the recorded sha256 (``ArtifactError`` if not)."""
        check_name(name)

        def unit(s: Session) -> tuple[VersionInfo, bytes | None]:
            p = self._policy(s, name)
            v = self._version(s, p, ref)
            return version_info(v, self._aliases_of(s, p).get(v.version, ())), v.artifact

        info, data = self._read(unit)
        if info.artifact_uri:
            data = fetch_uri(info.artifact_uri)
        return info, verify(data, info.sha256, f"{info.ref}")

    def load(self, name: str, ref: int | str | None = None) -> tuple[VersionInfo, CachePolicy, Path | None]:
        """A version's runnable policy: checked, unpacked (learned) and loaded; ``ArtifactError`` if it does not."""
        info, data = self.artifact(name, ref)
        policy, path = materialise(info.kind, data, info.sha256, info.ref)
        return info, policy, path

    def export(self, name: str, ref: int | str | None, out: str | Path) -> Path:
        """Write a version as a YAML policy file (rule) or an exported folder (learned); return what to load.

        A rule version goes to ``out`` when it names a ``.yaml``/``.yml`` file, else to ``out/policy.yaml``; a
        learned version fills the folder ``out``. Either loads with ``confkv generate --policy-file``.
        """
        info, policy, path = self.load(name, ref)
        out = Path(out)
        header = f"# {info.ref} from the confkv policy registry (sha256 {info.sha256})\n".encode()
        try:
            if info.kind != KIND_LEARNED:
                target = out if out.suffix in (".yaml", ".yml") else out / "policy.yaml"
                target.parent.mkdir(parents=True, exist_ok=True)
                params = policy.model_dump(mode="json", exclude={"learned_path"}, exclude_none=True)
                target.write_bytes(header + policy_yaml(params))
                return target
            if out.suffix in (".yaml", ".yml") or out.is_file():
                raise RegistryError(f"{info.ref} is a learned policy: it exports to a folder, not to {out}")
            assert path is not None
            shutil.copytree(path, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".confkv-*"))
            (out / "policy.yaml").write_bytes(header + (path / "policy.yaml").read_bytes())
            return out
        except OSError as err:
            raise RegistryError(f"cannot write {out}: {err.strerror or err}") from None


def _notify(s: Session, name: str, alias: str, version: int) -> None:
    """PostgreSQL: tell listeners (``store.watcher``) that an alias moved; delivered when the move commits."""
    if s.get_bind().dialect.name == "postgresql":
        payload = json.dumps({"policy": name, "alias": alias, "version": version})
        s.execute(select(func.pg_notify(NOTIFY_CHANNEL, payload)))
