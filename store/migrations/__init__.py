"""Alembic migrations of the registry schema, shipped inside the package and run by ``store.db.upgrade``."""
