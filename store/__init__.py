"""The policy registry: tuned and learned cache policies, their versions, evaluations and aliases, in SQL.

* ``store.models``: SQLAlchemy 2 typed tables; ``store.migrations``: the Alembic scripts that create and upgrade
  them (run on first use, never ``create_all``), so a production database is upgraded in place.
* ``store.names``: name rules, references and the plain results the registry returns.
* ``store.registry.Registry``: register, resolve, promote (move an alias), roll back, record evaluations, export.
* ``store.refs``: ``registry://NAME@ALIAS`` references, accepted wherever a policy file is.
* ``store.watcher.PolicyWatcher``: follows a reference and reports when its alias moves (hot swap).

The database is SQLite by default (``$XDG_DATA_HOME/confkv/registry.db``), or any URL in ``CONFKV_REGISTRY_URL``,
PostgreSQL through ``postgresql+psycopg://``. Importing this package imports nothing heavy (no torch, no envs).
"""
