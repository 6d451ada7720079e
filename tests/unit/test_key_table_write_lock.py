"""The key table (``api_keys`` in the server's SQLite file) while another connection holds the
file's write lock past the busy timeout: ``hotloop keys create``/``revoke`` say so in one line and
change nothing; the server's record of keys' last use neither holds up authentication (a new or
unknown secret's look-up, the revocation check) nor loses the times, nor logs a traceback."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from pathlib import Path

import pytest

from hotloop import cli, errors
from hotloop.state import store as store_mod
from hotloop.tenants import keys as keys_mod
from hotloop.tenants.auth import Tenancy
from hotloop.tenants.keys import SQLiteKeyStore
from tests.unit.test_sqlite_write_lock_requests import Lock

BUSY = 0.3  # the key store's busy timeout in these tests (10 s by default)


def _hotloop(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_keys_and_usage_locked_out_say_so_in_one_line_and_change_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``keys create`` and ``keys revoke`` write; ``usage`` moves an earlier version's ledger rows
    first (here one such row waits): locked out, each said "cannot open the store:
    OperationalError: database is locked" (after 10 s for keys)."""
    monkeypatch.setattr(keys_mod, "BUSY_TIMEOUT", BUSY, raising=False)
    monkeypatch.setattr(store_mod, "BUSY_TIMEOUT", BUSY, raising=False)
    monkeypatch.setenv("HOTLOOP_STORE_BUSY_TIMEOUT", str(BUSY))  # (what the store is opened with)
    data = ["--data-dir", str(tmp_path)]
    code, secret, _ = _hotloop(capsys, "keys", "create", "first", *data)
    assert code == 0 and secret.startswith("hl-")
    path = tmp_path / "hotloop.sqlite3"
    assert _hotloop(capsys, "usage", *data)[0] == 0  # (the ledger's tables are made)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute(
        "CREATE TABLE key_usage (day TEXT NOT NULL, model TEXT NOT NULL, key TEXT NOT NULL, responses INTEGER NOT NULL,"
        " input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,"
        " reasoning_tokens INTEGER NOT NULL, flagged INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (day, model, key))"
    )
    db.execute("INSERT INTO key_usage VALUES ('2026-01-01', 'old-model', 'anonymous', 3, 30, 3, 0, 0, 0)")
    db.close()
    lock = Lock(path)
    try:
        for argv in (("keys", "create", "second"), ("keys", "revoke", "first"), ("usage",)):
            t0 = time.monotonic()
            code, out, err = _hotloop(capsys, *argv, *data)
            assert code == 1 and out == "", (argv, out, err)
            assert err.count("\n") == 1 and "locked by another connection" in err and "nothing was changed" in err, err
            assert "cannot open the store" not in err and "OperationalError" not in err, err
            assert time.monotonic() - t0 < BUSY + 2.0
        code, out, _ = _hotloop(capsys, "keys", "list", *data)  # reads are not locked out
        assert code == 0 and "first" in out and "second" not in out
    finally:
        lock.release()
    code, out, _ = _hotloop(capsys, "keys", "list", *data)
    assert code == 0 and "first" in out and "active" in out and "revoked" not in out and "second" not in out, out
    assert _hotloop(capsys, "keys", "create", "second", *data)[0] == 0
    assert _hotloop(capsys, "keys", "revoke", "first", *data)[0] == 0
    code, out, _ = _hotloop(capsys, "usage", *data)
    assert code == 0 and "old-model" in out, out


def _scope(secret: str) -> dict[str, object]:
    return {"headers": [(b"authorization", b"Bearer " + secret.encode())]}


def test_a_locked_key_table_holds_up_no_authentication_and_keeps_last_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher records last-use times (``touch``, a write) on the key store's one connection
    and thread: locked out, it held them for the whole busy timeout (10 s), so a request with a
    secret not yet seen, and the revocation check, waited that long; the times were dropped and a
    traceback logged ("reading the key table failed")."""
    monkeypatch.setattr(keys_mod, "BUSY_TIMEOUT", 3.0, raising=False)
    monkeypatch.setattr(Tenancy, "REFRESH_SECONDS", 0.05)
    monkeypatch.setattr(Tenancy, "TOUCH_SECONDS", 0.5)
    caplog.set_level(logging.INFO)
    path = tmp_path / "hotloop.sqlite3"
    keys = SQLiteKeyStore(path)
    rec, secret = keys.create("agent")

    async def main() -> tuple[float, float | None]:
        tenancy = Tenancy(keys)
        tenancy.start("127.0.0.1")
        try:
            lock = Lock(path)
            try:
                used_at = time.time()
                assert (await tenancy.authenticate(_scope(secret))).id == rec.id
                await asyncio.sleep(0.7)  # the watcher's touch has begun, locked out
                t0 = time.monotonic()
                with pytest.raises(errors.AuthenticationFailed):
                    await tenancy.authenticate(_scope("hl-" + "x" * 43))  # a look-up of the table
                waited = time.monotonic() - t0
            finally:
                lock.release()
            for _ in range(100):  # the next touch, once the lock is gone
                last = next(k.last_used for k in keys.list() if k.id == rec.id)
                if last is not None:
                    break
                await asyncio.sleep(0.05)
            assert last is None or last >= used_at
            return waited, last
        finally:
            await tenancy.close()

    waited, last = asyncio.run(main())
    assert waited < 1.0, f"an unknown secret's look-up waited {waited:.2f} s behind the locked-out touch"
    assert last is not None, "the last-use time recorded while the table was locked was lost"
    assert "Traceback" not in caplog.text and all(r.exc_info is None for r in caplog.records), caplog.text
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("hotloop") and r.levelno >= logging.WARNING]
    assert 1 <= len(lines) <= 3 and all("locked" in m for m in lines), lines


def test_a_key_table_read_locked_out_is_a_503_not_a_500(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A look-up of the key table (a secret not seen yet) that SQLite refuses as locked (another
    connection kept the file past the key store's busy timeout) raised SQLite's own error: a 500
    for the client. Now a 503 it may retry, one log line, no traceback; the key works once the
    table can be read again."""
    keys = SQLiteKeyStore(tmp_path / "hotloop.sqlite3")
    rec, secret = keys.create("agent")
    real = keys.version

    def version() -> tuple[int, int, int]:
        exc = sqlite3.OperationalError("database is locked")
        exc.sqlite_errorcode = 5  # type: ignore[attr-defined]  # SQLITE_BUSY
        raise exc

    async def main() -> None:
        tenancy = Tenancy(keys)
        tenancy.start("127.0.0.1")
        try:
            keys.version = version  # type: ignore[method-assign]
            with pytest.raises(errors.StoreUnavailable) as info:
                await tenancy.authenticate(_scope("hl-" + "y" * 43))
            assert info.value.status == 503 and "locked" not in info.value.message
            keys.version = real  # type: ignore[method-assign]
            assert (await tenancy.authenticate(_scope(secret))).id == rec.id
        finally:
            await tenancy.close()

    asyncio.run(main())
    assert "Traceback" not in caplog.text and all(r.exc_info is None for r in caplog.records), caplog.text

