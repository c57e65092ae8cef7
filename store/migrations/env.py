"""Alembic environment for the registry.

``store.db.upgrade`` runs this with an open connection (``config.attributes["connection"]``) inside a transaction it
has already begun and locked, so migrations of one database never run twice at once. Offline mode (``--sql``)
renders the SQL for a DBA from ``sqlalchemy.url``.
"""

from __future__ import annotations

from alembic import context

from store.models import Base

VERSION_TABLE = "confkv_alembic_version"  # not "alembic_version": MLflow and Optuna use that name

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        version_table=VERSION_TABLE,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("store migrations run through store.db.upgrade, which passes a connection")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
