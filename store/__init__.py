"""store: reserved for the tuning system (see README)."""
