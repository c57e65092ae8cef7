"""The registry's tables as SQLAlchemy 2 typed models.

Every table carries the ``confkv_`` prefix and Alembic keeps its own version table (``confkv_alembic_version``),
because the registry is often pointed at a database that MLflow or Optuna already use, and both of those keep
their schema revision in a table called ``alembic_version``.

Integrity lives in the database, not only in this code, so that two processes moving the same alias at once
cannot leave the registry inconsistent:

* ``(policy_id, version)`` is unique: version numbers are allocated per policy, a race on the same number fails;
* ``(policy_id, alias)`` is unique: an alias points at no more than one version of its policy (MLflow's model
  aliases: ``registered_model_aliases`` has the primary key ``(name, alias)``);
* ``confkv_alias_history`` is append-only: the code only ever inserts into it. MLflow keeps no such record
  (mlflow/mlflow#2169); rollback and audit need one.

These classes describe the schema at the newest revision; ``store/migrations/versions`` hold how to get there.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

#: JSON everywhere, JSONB on PostgreSQL (indexable, compact).
JSONType = JSON().with_variant(JSONB(), "postgresql")

KIND_RULE = "rule"  # a CachePolicy's knobs: the artifact is its YAML file
KIND_LEARNED = "learned"  # an exported network: the artifact is a tar of the exported folder


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class Policy(Base):
    """A named line of policy versions (``dynamic-smollm2-mixed``); aliases are per policy."""

    __tablename__ = "confkv_policies"
    __table_args__ = (UniqueConstraint("name", name="uq_confkv_policies_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    description: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    versions: Mapped[list[PolicyVersion]] = relationship(back_populates="policy", order_by="PolicyVersion.version")
    aliases: Mapped[list[Alias]] = relationship(back_populates="policy")


class PolicyVersion(Base):
    """One immutable version: what the policy is (parameters, artifact) and what produced it (lineage)."""

    __tablename__ = "confkv_policy_versions"
    __table_args__ = (UniqueConstraint("policy_id", "version", name="uq_confkv_policy_versions_policy_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("confkv_policies.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # KIND_RULE or KIND_LEARNED
    parameters: Mapped[dict[str, Any]] = mapped_column(JSONType)  # the cache_policy mapping
    artifact: Mapped[bytes | None] = mapped_column(LargeBinary)  # stored in the database ...
    artifact_uri: Mapped[str | None] = mapped_column(Text)  # ... or at a URI
    artifact_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    created_by: Mapped[str | None] = mapped_column(String(256))
    description: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str | None] = mapped_column(String(512))  # the model it was tuned for
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64), index=True)
    optuna_study: Mapped[str | None] = mapped_column(String(256))
    optuna_trial: Mapped[int | None] = mapped_column(Integer)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("confkv_policy_versions.id", ondelete="SET NULL"))

    policy: Mapped[Policy] = relationship(back_populates="versions")
    parent: Mapped[PolicyVersion | None] = relationship(remote_side=[id])
    evaluations: Mapped[list[Evaluation]] = relationship(back_populates="version", order_by="Evaluation.id")


class Evaluation(Base):
    """A version's metrics on one workload and split (the gate writes one per side it compares)."""

    __tablename__ = "confkv_evaluations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("confkv_policy_versions.id", ondelete="CASCADE"))
    workload: Mapped[str] = mapped_column(String(128))
    split: Mapped[str] = mapped_column(String(32))
    model: Mapped[str | None] = mapped_column(String(512))
    reward: Mapped[float | None] = mapped_column(Float)  # the environment's reward, the gate's criterion
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    version: Mapped[PolicyVersion] = relationship(back_populates="evaluations")


Index("ix_confkv_evaluations_version_workload", Evaluation.version_id, Evaluation.workload, Evaluation.split)


class Alias(Base):
    """A named, movable pointer (``production``, ``staging``) at one version of a policy."""

    __tablename__ = "confkv_aliases"
    __table_args__ = (UniqueConstraint("policy_id", "alias", name="uq_confkv_aliases_policy_alias"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("confkv_policies.id", ondelete="CASCADE"))
    alias: Mapped[str] = mapped_column(String(64))
    version_id: Mapped[int] = mapped_column(ForeignKey("confkv_policy_versions.id", ondelete="RESTRICT"))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_by: Mapped[str | None] = mapped_column(String(256))

    policy: Mapped[Policy] = relationship(back_populates="aliases")
    version: Mapped[PolicyVersion] = relationship()


class AliasMove(Base):
    """One move of an alias, appended in the same transaction as the move (revision 0002)."""

    __tablename__ = "confkv_alias_history"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("confkv_policies.id", ondelete="CASCADE"))
    alias: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(16))  # "promote", "rollback", or "backfill" (by migration 0002)
    from_version_id: Mapped[int | None] = mapped_column(ForeignKey("confkv_policy_versions.id", ondelete="SET NULL"))
    to_version_id: Mapped[int | None] = mapped_column(ForeignKey("confkv_policy_versions.id", ondelete="SET NULL"))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    who: Mapped[str | None] = mapped_column(String(256))
    reason: Mapped[str | None] = mapped_column(Text)

    from_version: Mapped[PolicyVersion | None] = relationship(foreign_keys=[from_version_id])
    to_version: Mapped[PolicyVersion | None] = relationship(foreign_keys=[to_version_id])


Index("ix_confkv_alias_history_policy_alias", AliasMove.policy_id, AliasMove.alias, AliasMove.id)
