"""Where responses, their items and the caches that hold them live (the stores, the connection
and prefix caches, the fingerprint key)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def create_private(db_path: str) -> None:
    """Make the data directory (mode 0700) and an empty database file (0600) at ``db_path`` where
    they do not exist yet: the file holds every tenant's stored responses and the API keys' hashes.
    An existing directory or file keeps the mode it has; SQLite gives the file's ``-wal`` and
    ``-shm`` files the file's own mode."""
    Path(db_path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(db_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
