"""Built-in synthetic tasks (no downloads)."""
