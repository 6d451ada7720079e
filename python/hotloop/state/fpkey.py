"""The fingerprint key: the secret that keys item fingerprints (:mod:`hotloop.pipeline.items`).

With the SQLite store the key is ``KEY_LEN`` random bytes in the data directory
(``fingerprint.key``, mode 0600), made on first start, so the fingerprints stored with responses
stay valid across restarts. With the memory store (or a ``:memory:`` database) it is
``PROCESS_KEY``, random per process. The key is never logged or served, and no repr shows it.

A key file that is not exactly ``KEY_LEN`` bytes, or that group or others may access (any of the
mode bits 0077), is refused with :class:`KeyFileError` (``hotloop serve`` exits with code 3 and
says which file and why): a key others could read may have leaked, and tightening the mode would
not take it back. Fix the mode (``chmod 600``) if it did not leak, or delete the file: a new key
is made on the next start, and the fingerprints stored under the old one are recomputed when
their responses are loaded (:class:`hotloop.state.store.SQLiteStore`).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path

KEY_FILE = "fingerprint.key"
KEY_LEN = 32
#: this process's key: the memory store's, and the one used before a deployment key is set
PROCESS_KEY = secrets.token_bytes(KEY_LEN)
#: this process's key for the tags of call ids redacted under ``--secrets redact``
#: (:func:`hotloop.pipeline.classify.call_id_marker`): the memory store's, and the one a
#: classifier built without a store uses. The SQLite and Redis stores keep a shared one instead
#: (``call_id_key``: SQLite's ``meta`` table, Redis's ``P callidkey``), made once.
CALL_ID_PROCESS_KEY = secrets.token_bytes(KEY_LEN)
# What a stored fingerprint means: bump it whenever the canonical form or the hash changes, so
# fingerprints stored under the old meaning are dropped (SQLiteStore compares key_id values).
SCHEME = b"hotloop item fingerprint v1: keyed BLAKE2b-128 of msgspec's sorted compact JSON"


def derive(key: bytes, label: bytes) -> bytes:
    """A ``KEY_LEN``-byte key for one purpose, named by ``label``, derived from the deployment's
    ``key`` (keyed BLAKE2b of the label): another use of the secret never holds the key itself,
    and keys derived under different labels are unrelated. It lives exactly as long as ``key``
    (a file's, a Redis deployment's shared one, or ``PROCESS_KEY``: one process's)."""
    return hashlib.blake2b(label, digest_size=KEY_LEN, key=key).digest()


class KeyFileError(Exception):
    """The key file is unusable (its message names the file and the fix, never the key)."""


def key_path(db_path: str | Path) -> Path:
    """Where the key of the SQLite database ``db_path`` lives: beside it."""
    return Path(db_path).parent / KEY_FILE


def key_id(key: bytes) -> bytes:
    """A public tag of ``key`` and ``SCHEME`` (a MAC: it does not reveal the key), stored with
    fingerprints to tell whether they were made under this key and scheme."""
    return hashlib.blake2b(SCHEME, digest_size=16, key=key).digest()


def load_or_create(path: str | Path) -> bytes:
    """The key in ``path``, made first if the file does not exist (atomically: concurrent
    starters all end up with the same key).

    :raises KeyFileError: the file has the wrong size, mode or type.
    """
    path = Path(path)
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_LEN))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # published whole or not at all; never replaces an existing key
        except FileExistsError:  # another process made it first: use theirs
            pass
    finally:
        os.unlink(tmp)
    return _read(path)


def _read(path: Path) -> bytes:
    try:
        return _read_key(path)
    except FileNotFoundError:
        raise
    except OSError as exc:  # a directory, no permission: refused with the start-up exit code
        raise KeyFileError(f"fingerprint key {path} cannot be read ({exc.strerror or type(exc).__name__})") from None


def _read_key(path: Path) -> bytes:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"fingerprint key {path} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"fingerprint key {path} is accessible to group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"run `chmod 600 {path}` if it did not leak, or delete it to make a new key"
            )
        key = f.read(KEY_LEN + 1)
    if len(key) != KEY_LEN:
        raise KeyFileError(
            f"fingerprint key {path} holds {len(key) if len(key) <= KEY_LEN else 'more than ' + str(KEY_LEN)} bytes, "
            f"not {KEY_LEN}; delete it to make a new key"
        )
    return key
