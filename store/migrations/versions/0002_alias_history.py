"""Alias history (append-only record of every alias move) and an index for a version's evaluations.

Rollback replays this history, so aliases that already exist when a database is upgraded get one ``backfill``
row each (from nothing to their current version): after the upgrade, ``rollback`` reports that there is no
earlier version instead of failing on a missing table, and the audit trail starts at the upgrade.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "confkv_alias_history",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("policy_id", sa.Integer(), sa.ForeignKey("confkv_policies.id", ondelete="CASCADE"), nullable=False),
        sa.Column("alias", sa.String(64), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column(
            "from_version_id",
            sa.Integer(),
            sa.ForeignKey("confkv_policy_versions.id", ondelete="SET NULL"),
            nullable=True,
        ),
        sa.Column(
            "to_version_id",
            sa.Integer(),
            sa.ForeignKey("confkv_policy_versions.id", ondelete="SET NULL"),
            nullable=True,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("who", sa.String(256), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
    )
    op.create_index("ix_confkv_alias_history_policy_alias", "confkv_alias_history", ["policy_id", "alias", "id"])
    op.create_index("ix_confkv_evaluations_version_workload", "confkv_evaluations", ["version_id", "workload", "split"])
    aliases = sa.table(
        "confkv_aliases",
        sa.column("policy_id", sa.Integer()),
        sa.column("alias", sa.String()),
        sa.column("version_id", sa.Integer()),
        sa.column("updated_at", sa.DateTime(timezone=True)),
        sa.column("updated_by", sa.String()),
    )
    history = sa.table(
        "confkv_alias_history",
        sa.column("policy_id", sa.Integer()),
        sa.column("alias", sa.String()),
        sa.column("action", sa.String()),
        sa.column("from_version_id", sa.Integer()),
        sa.column("to_version_id", sa.Integer()),
        sa.column("at", sa.DateTime(timezone=True)),
        sa.column("who", sa.String()),
        sa.column("reason", sa.String()),
    )
    op.execute(
        history.insert().from_select(
            ["policy_id", "alias", "action", "from_version_id", "to_version_id", "at", "who", "reason"],
            sa.select(
                aliases.c.policy_id,
                aliases.c.alias,
                sa.literal("backfill"),
                sa.null(),
                aliases.c.version_id,
                aliases.c.updated_at,
                aliases.c.updated_by,
                sa.literal("recorded by migration 0002 (history starts here)"),
            ).order_by(aliases.c.policy_id, aliases.c.alias),
        )
    )


def downgrade() -> None:
    op.drop_index("ix_confkv_evaluations_version_workload", table_name="confkv_evaluations")
    op.drop_index("ix_confkv_alias_history_policy_alias", table_name="confkv_alias_history")
    op.drop_table("confkv_alias_history")
