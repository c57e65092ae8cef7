"""Alembic revision scripts (Alembic itself skips this file)."""
