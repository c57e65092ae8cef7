"""Registry databases: which URL, how to connect, and bringing the schema to the newest Alembic revision.

URL resolution, first match wins: an explicit URL (``--registry-url``), ``$CONFKV_REGISTRY_URL``, then a SQLite file
under the user's data folder (``$XDG_DATA_HOME/confkv/registry.db``, default ``~/.local/share/confkv/registry.db``).
``postgresql://`` and ``postgres://`` are read as ``postgresql+psycopg://`` (psycopg 3 is the driver confkv ships).

Writes are serialised per database so that concurrent alias moves and version numbering stay exact:

* SQLite: write transactions start with ``BEGIN IMMEDIATE`` (the write lock is taken up front and waited for,
  instead of two readers both trying to upgrade to writers and one failing with "database is locked"); the file
  runs in WAL mode so a watcher's reads never wait on a writer.
* PostgreSQL: write units lock their policy's row (``SELECT ... FOR UPDATE``, see ``store.registry``), and the
  migration itself runs under a transaction-scoped advisory lock so two processes starting at once on an empty
  database do not both create the tables.
"""

from __future__ import annotations

import os
import threading
from functools import cache
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.pool import StaticPool

from store.errors import RegistryError

ENV_URL = "CONFKV_REGISTRY_URL"
VERSION_TABLE = "confkv_alembic_version"
#: ``pg_advisory_xact_lock`` key held while migrating (any constant unlikely to collide: "confkv" in ASCII).
MIGRATION_LOCK_KEY = 0x636F6E666B76
_WRITE = "confkv_write"

_engines: dict[str, Engine] = {}
_ready: set[str] = set()
_lock = threading.Lock()


def default_registry_url() -> str:
    """``$CONFKV_REGISTRY_URL``, else the SQLite file in the user's data folder."""
    env = os.environ.get(ENV_URL)
    if env:
        return env
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return f"sqlite:///{base / 'confkv' / 'registry.db'}"


def parse_url(url: str | URL | None) -> URL:
    """A validated SQLAlchemy URL for the registry (SQLite or PostgreSQL through psycopg 3)."""
    raw = url if url is not None else default_registry_url()
    try:
        u = make_url(raw)
    except ArgumentError:
        raise RegistryError(
            f"invalid registry URL {raw!r}: expected sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB"
        ) from None
    if u.drivername in ("postgresql", "postgres", "postgresql+psycopg"):
        return u.set(drivername="postgresql+psycopg")
    if u.drivername in ("sqlite", "sqlite+pysqlite"):
        return u
    raise RegistryError(
        f"unsupported registry URL scheme {u.drivername!r}: use sqlite:///PATH or postgresql+psycopg://..."
    )


def display_url(url: str | URL | None) -> str:
    """The URL without its password, for messages."""
    try:
        return parse_url(url).render_as_string(hide_password=True)
    except RegistryError:
        return str(url)


def _sqlite_engine(u: URL) -> Engine:
    memory = u.database in (None, "", ":memory:")
    kwargs: dict[str, Any] = {"connect_args": {"timeout": 30.0, "check_same_thread": False}}
    if memory:
        kwargs["poolclass"] = StaticPool
    else:
        Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)  # type: ignore[arg-type]
    engine = create_engine(u, **kwargs)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        # pysqlite's own transaction handling would BEGIN lazily (deferred) and skip DDL; own it instead.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        if not memory:
            cur.execute("PRAGMA journal_mode=WAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")

    return engine


def get_engine(url: str | URL | None = None, *, migrate: bool = True) -> Engine:
    """One engine (and connection pool) per registry URL in this process, migrated to the newest revision
    (``migrate=False``: as it is, for tests and tools that manage revisions themselves)."""
    u = parse_url(url)
    key = u.render_as_string(hide_password=False)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            sqlite = u.get_backend_name() == "sqlite"
            engine = _sqlite_engine(u) if sqlite else create_engine(u, pool_pre_ping=True)
            _engines[key] = engine
    if migrate and key not in _ready:
        ensure_schema(engine)
        _ready.add(key)
    return engine


def writer(engine: Engine) -> Engine:
    """The same engine whose transactions take the database's write lock at BEGIN (SQLite; a no-op elsewhere)."""
    return engine.execution_options(**{_WRITE: True})


def dispose_engines() -> None:
    """Close every pooled connection (tests; a process that forks)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
        _ready.clear()


# ------------------------------------------------------------------------------------------------ migrations
def alembic_config(url: str | None = None) -> Any:
    """An Alembic config pointing at the scripts shipped in ``store/migrations`` (no alembic.ini needed)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", "store:migrations")
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@cache
def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


@cache
def known_revisions() -> frozenset[str]:
    from alembic.script import ScriptDirectory

    return frozenset(s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions())


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (None: empty, never migrated)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the Alembic migrations up to ``revision`` in one locked transaction."""
    from alembic import command

    with writer(engine).begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def ensure_schema(engine: Engine) -> None:
    """Upgrade an empty or older database to the newest revision; refuse one newer than this code."""
    shown = engine.url.render_as_string(hide_password=True)
    try:
        current = current_revision(engine)
        if current == head_revision():
            return
        if current is not None and current not in known_revisions():
            raise RegistryError(
                f"the registry at {shown} is at schema revision {current!r}, which this confkv does not know "
                f"(newest known: {head_revision()!r}); upgrade confkv"
            )
        upgrade(engine)
    except DBAPIError as err:
        raise RegistryError(f"cannot open the registry at {shown}: {str(err.orig).strip().splitlines()[0]}") from None
