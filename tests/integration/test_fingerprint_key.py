"""The fingerprint key of a real ``hotloop serve``: made once in the data directory, kept across
restarts (stored fingerprints stay equal to ones computed from scratch under it), never logged or
served; an unusable key file stops start-up with exit code 3 and says why."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec

from hotloop.pipeline import items as itemlib
from hotloop.protocol.request import item_from_dict
from hotloop.state import fpkey
from tests.conftest import free_port, run_server

ROOT = str(Path(__file__).resolve().parents[2])


def _stored_fps(data: Path) -> list[tuple[bytes, bytes]]:
    """(item body, fingerprint) of every stored item."""
    with sqlite3.connect(data / "hotloop.sqlite3") as db:
        return db.execute(
            "SELECT b.body, ri.fp FROM response_items ri JOIN blobs b ON b.hash = ri.hash ORDER BY ri.response_id, ri.pos"
        ).fetchall()


def test_the_key_is_made_once_kept_across_restarts_and_never_shown(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {"HOTLOOP_DATA_DIR": str(data)}
    with run_server(tmp_path, "--sim-rate", "0", env=env) as s:
        r = httpx.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": "first"}, timeout=30)
        assert r.status_code == 200
        first = r.json()
        key = (data / fpkey.KEY_FILE).read_bytes()
        assert len(key) == fpkey.KEY_LEN and (data / fpkey.KEY_FILE).stat().st_mode & 0o777 == 0o600
        for path in ("/healthz", "/hotloop/stats", "/metrics"):
            body = httpx.get(s.base + path, timeout=10).content
            assert key not in body and key.hex().encode() not in body
    with run_server(tmp_path, "--sim-rate", "0", env=env) as s:
        assert (data / fpkey.KEY_FILE).read_bytes() == key
        r = httpx.post(
            s.v1 + "/responses",
            json={"model": "hotloop-sim", "input": "second", "previous_response_id": first["id"]},
            timeout=30,
        )
        assert r.status_code == 200
        assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0  # continued after the restart
        logs = s.logs()
    assert key.hex() not in logs and repr(key)[2:-1] not in logs

    # Every stored fingerprint is the one computed from scratch under the deployment's key.
    itemlib.use_key(key)
    try:
        rows = _stored_fps(data)
        assert len(rows) >= 4
        for body, fp in rows:
            assert fp == itemlib.fingerprint(item_from_dict(msgspec.json.decode(body)))
    finally:
        itemlib.use_key(fpkey.PROCESS_KEY)


def _serve(data: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hotloop", "serve", "--port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": ROOT, "HOTLOOP_DATA_DIR": str(data)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


def test_an_unusable_key_file_fails_start_up(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    key_file = data / fpkey.KEY_FILE
    key = os.urandom(fpkey.KEY_LEN)
    key_file.write_bytes(key)
    os.chmod(key_file, 0o644)
    proc = _serve(data)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "start-up failed" in out and str(key_file) in out and "chmod 600" in out and "Traceback" not in out
    assert key.hex() not in out
    assert key_file.read_bytes() == key and not (data / "hotloop.sqlite3").exists()

    os.chmod(key_file, 0o600)
    key_file.write_bytes(key[:20])
    proc = _serve(data)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "holds 20 bytes" in out and "Traceback" not in out
