"""The key of redacted call ids' tags (``[REDACTED:<kind>:<tag>]``) is kept by the response store:
made once by the first process to open a SQLite file (its ``meta`` table), read by every later
one, so a call stored before a restart, or by another ``--workers`` process, still pairs with its
output redacted after. The memory store's is the process's. (Redis: tests/unit/test_redis_store.py.)"""

from __future__ import annotations

import secrets as rnd
import sqlite3
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotloop.config import Config
from hotloop.pipeline import classify
from hotloop.protocol.request import FunctionCall
from hotloop.server.runner import make_app
from hotloop.state import fpkey
from hotloop.state.store import MemoryStore, SQLiteStore

ALNUM = string.ascii_letters + string.digits


def gh() -> str:
    return "gh" + "p_" + "".join(rnd.choice(ALNUM) for _ in range(36))


def _meta_key(path: Path) -> str:
    with sqlite3.connect(path) as db:
        (value,) = db.execute("SELECT value FROM meta WHERE name = 'call_id_key'").fetchone()
    return value if isinstance(value, str) else value.decode()


def test_two_sqlite_stores_on_one_file_share_the_key_and_it_outlives_them(tmp_path: Path) -> None:
    path = tmp_path / "hotloop.sqlite3"
    a = SQLiteStore(path)
    b = SQLiteStore(path)
    try:
        assert len(a.call_id_key) == fpkey.KEY_LEN
        assert b.call_id_key == a.call_id_key
        assert a.call_id_key not in (fpkey.CALL_ID_PROCESS_KEY, a.fingerprint_key)
    finally:
        a.close()
        b.close()
    reopened = SQLiteStore(path)  # a restart
    try:
        assert reopened.call_id_key == a.call_id_key
    finally:
        reopened.close()
    assert _meta_key(path) == a.call_id_key.hex()  # only in meta, as hex
    other = SQLiteStore(tmp_path / "other" / "hotloop.sqlite3")
    try:
        assert other.call_id_key != a.call_id_key  # another store, another key
    finally:
        other.close()


_OPEN = """
import sys, time
from hotloop.state.store import SQLiteStore
while time.time() < float(sys.argv[2]):  # start together
    time.sleep(0.001)
s = SQLiteStore(sys.argv[1])
print(s.call_id_key.hex())
s.close()
"""


def test_processes_opening_a_new_file_at_once_agree(tmp_path: Path) -> None:
    path = tmp_path / "hotloop.sqlite3"
    SQLiteStore(path).close()  # the schema, as the --workers parent makes it; the key row is dropped
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM meta WHERE name = 'call_id_key'")
    at = str(time.time() + 2.0)
    procs = [
        subprocess.Popen([sys.executable, "-c", _OPEN, str(path), at], stdout=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    keys = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(keys)) == 1 and keys[0] == _meta_key(path)


def test_a_meta_row_that_is_not_a_key_is_refused_without_showing_it(tmp_path: Path) -> None:
    path = tmp_path / "hotloop.sqlite3"
    SQLiteStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = 'abc123' WHERE name = 'call_id_key'")
    with pytest.raises(fpkey.KeyFileError, match="call_id_key") as info:
        SQLiteStore(path)
    assert "abc123" not in str(info.value)


def test_the_memory_store_uses_the_process_key() -> None:
    assert MemoryStore().call_id_key == fpkey.CALL_ID_PROCESS_KEY
    assert len(fpkey.CALL_ID_PROCESS_KEY) == fpkey.KEY_LEN


def test_the_marker_depends_on_the_key_and_classifiers_default_to_the_process_key() -> None:
    secret = gh()
    k1, k2 = rnd.token_bytes(32), rnd.token_bytes(32)
    m1 = classify.call_id_marker("github_token", secret, k1)
    assert m1 == classify.call_id_marker("github_token", secret, k1)
    assert m1 != classify.call_id_marker("github_token", secret, k2)
    assert classify.call_id_marker("github_token", secret) == classify.call_id_marker(
        "github_token", secret, fpkey.CALL_ID_PROCESS_KEY
    )
    for c, key in ((classify.SecretsClassifier("redact", call_id_key=k1), k1),
                   (classify.SecretsClassifier("redact"), fpkey.CALL_ID_PROCESS_KEY)):
        verdict, _ = c.classify([FunctionCall(call_id=secret, name="f", arguments="{}")], c.initial_state())
        assert isinstance(verdict, classify.Redact)
        assert verdict.items[0].call_id == classify.call_id_marker("github_token", secret, key)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="call id key"):
        classify.SecretsClassifier("redact", call_id_key=b"short")


def test_the_server_redacts_call_ids_under_its_stores_key(tmp_path: Path) -> None:
    app = make_app(Config(store="sqlite", data_dir=str(tmp_path), secrets="redact", sim_rate=0))
    try:
        key = app.persistence.store.call_id_key
        assert key != fpkey.CALL_ID_PROCESS_KEY
        (secrets_classifier,) = [c for c in app.engine.classifiers if isinstance(c, classify.SecretsClassifier)]
        secret = gh()
        verdict, _ = secrets_classifier.classify(
            [FunctionCall(call_id=secret, name="f", arguments="{}")], secrets_classifier.initial_state()
        )
        assert isinstance(verdict, classify.Redact)
        assert verdict.items[0].call_id == classify.call_id_marker("github_token", secret, key)  # type: ignore[union-attr]
    finally:
        app.engine.close()
        app.persistence.store.close()
