"""The initial registry: policies, versions (with artifact and lineage), evaluations, aliases.

Revision ID: 0001
Revises:
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "confkv_policies",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("name", name="uq_confkv_policies_name"),
    )
    op.create_table(
        "confkv_policy_versions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("policy_id", sa.Integer(), sa.ForeignKey("confkv_policies.id", ondelete="CASCADE"), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("parameters", JSONType, nullable=False),
        sa.Column("artifact", sa.LargeBinary(), nullable=True),
        sa.Column("artifact_uri", sa.Text(), nullable=True),
        sa.Column("artifact_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(256), nullable=True),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("model", sa.String(512), nullable=True),
        sa.Column("mlflow_run_id", sa.String(64), nullable=True),
        sa.Column("optuna_study", sa.String(256), nullable=True),
        sa.Column("optuna_trial", sa.Integer(), nullable=True),
        sa.Column(
            "parent_id", sa.Integer(), sa.ForeignKey("confkv_policy_versions.id", ondelete="SET NULL"), nullable=True
        ),
        sa.UniqueConstraint("policy_id", "version", name="uq_confkv_policy_versions_policy_version"),
    )
    op.create_index("ix_confkv_policy_versions_policy_id", "confkv_policy_versions", ["policy_id"])
    op.create_index("ix_confkv_policy_versions_mlflow_run_id", "confkv_policy_versions", ["mlflow_run_id"])
    op.create_table(
        "confkv_evaluations",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "version_id", sa.Integer(), sa.ForeignKey("confkv_policy_versions.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("workload", sa.String(128), nullable=False),
        sa.Column("split", sa.String(32), nullable=False),
        sa.Column("model", sa.String(512), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("metrics", JSONType, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "confkv_aliases",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("policy_id", sa.Integer(), sa.ForeignKey("confkv_policies.id", ondelete="CASCADE"), nullable=False),
        sa.Column("alias", sa.String(64), nullable=False),
        sa.Column(
            "version_id", sa.Integer(), sa.ForeignKey("confkv_policy_versions.id", ondelete="RESTRICT"), nullable=False
        ),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(256), nullable=True),
        sa.UniqueConstraint("policy_id", "alias", name="uq_confkv_aliases_policy_alias"),
    )


def downgrade() -> None:
    op.drop_table("confkv_aliases")
    op.drop_table("confkv_evaluations")
    op.drop_index("ix_confkv_policy_versions_mlflow_run_id", table_name="confkv_policy_versions")
    op.drop_index("ix_confkv_policy_versions_policy_id", table_name="confkv_policy_versions")
    op.drop_table("confkv_policy_versions")
    op.drop_table("confkv_policies")
