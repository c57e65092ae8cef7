"""Alembic migrations of the registry schema, shipped inside the package and run by ``store.db.upgrade``.

There is no ``alembic.ini``: ``store.db.alembic_config()`` points Alembic here. To add a revision after changing
``store.models``, autogenerate it against a database at the current head, then review and name it
``versions/NNNN_what.py``::

    from alembic import command
    from store.db import alembic_config, get_engine

    engine = get_engine("sqlite:////tmp/dev-registry.db")  # migrated to the current head on open
    with engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.revision(cfg, message="what changed", autogenerate=True, rev_id="0003")

Every revision must upgrade a database written by the previous one in place (``tests/test_registry.py`` runs
0001 -> head with data in it); add to that test when a revision moves data.
"""
