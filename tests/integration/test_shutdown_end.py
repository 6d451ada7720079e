"""A single server's stop: SIGINT twice; requests and clients still there when the grace and
ABORT_WINDOW are over."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import httpx

from hotloop.state.store import SQLiteStore
from tests.conftest import run_server


def test_a_second_sigint_still_writes_the_store_queue_out(tmp_path: Path) -> None:
    """Ctrl-C twice: README, Shutdown says SIGINT stops the server, writes the store's queue out and
    exits 0. uvicorn's "second Ctrl-C forces the exit" skipped the lifespan shutdown (the flush):
    the usage ledger of the responses just completed was lost, the exit status was still 0, and
    the log held a CancelledError traceback."""
    data = tmp_path / "data"
    with run_server(tmp_path, "--sim-rate", "0", env={"HOTLOOP_DATA_DIR": str(data)}) as s:
        with httpx.Client(timeout=10) as c:
            for _ in range(5):
                assert c.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi"}).status_code == 200
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.02)
        s.proc.send_signal(signal.SIGINT)
        code = s.proc.wait(timeout=30)
        logs = s.logs()
        s.log.write_text("")  # run_server's own traceback check is made by the assertions below
    store = SQLiteStore(data / "hotloop.sqlite3")
    try:
        ledger = sum(int(r["responses"]) for r in store.usage())
    finally:
        store.close()
    assert ledger == 5, f"the ledger holds {ledger} of the 5 completed responses (exit {code})"
    assert code == 0
    assert "Traceback" not in logs, logs


def _raw(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    return s


def _read_all(s: socket.socket, timeout: float = 10.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except OSError:
        pass
    return out


def test_a_request_still_arriving_at_the_end_of_the_grace_gets_an_openai_error(tmp_path: Path) -> None:
    """A request whose body has not all arrived when the server's grace (plus ABORT_WINDOW) ends:
    the answer must be an OpenAI error object (JSON, ``error.type``), not uvicorn's plain-text
    ``500 Internal Server Error``; and no traceback in the log."""
    with run_server(tmp_path, "--sim-rate", "0", "--shutdown-grace", "1") as s:
        head = b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        conn = _raw(s.port, head + b'{"model"')
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
        answer = _read_all(conn)
        conn.close()
        assert s.proc.wait(timeout=30) == 0
        logs = s.logs()
        s.log.write_text("")
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"application/json" in headers.lower(), answer[:300]
    assert json.loads(body)["error"]["type"] == "server_error", body[:300]
    assert "Traceback" not in logs, logs


def test_clients_that_stopped_reading_at_the_end_of_the_grace_leave_no_tracebacks(tmp_path: Path) -> None:
    """Streams whose clients stopped reading (SSE): at the grace's end their responses fail, and
    ABORT_WINDOW later what still runs is cancelled by design; that must not log an
    "Exception in ASGI application" traceback per connection."""
    with run_server(tmp_path, "--sim-rate", "0", "--sim-output-tokens", "100000", "--shutdown-grace", "1") as s:
        conns = []
        body = json.dumps({"model": "hotloop-sim", "input": "hi", "stream": True}).encode()
        for _ in range(3):
            c = socket.socket()
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.connect(("127.0.0.1", s.port))
            c.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            conns.append(c)  # never read
        time.sleep(1.0)
        s.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert s.proc.wait(timeout=30) == 0
        took = time.monotonic() - sent
        for c in conns:
            c.close()
        logs = s.logs()
        s.log.write_text("")
    assert took < 10, took
    assert "Traceback" not in logs, logs[-3000:]


def test_a_stop_that_could_not_store_what_it_answered_exits_non_zero(tmp_path: Path) -> None:
    """Another connection holds the SQLite file's write lock (a backup, a shell) while the
    server stops with writes queued: the flush gives up at its bound and names them in the log,
    and the process exited 0 all the same, so that what runs it could not tell. It exits
    ``WRITES_LOST`` (4) now."""
    import sqlite3
    import subprocess
    import sys

    from hotloop.server.runner import WRITES_LOST
    from tests.conftest import free_port

    port = free_port()
    data = tmp_path / "data"
    entry = "import sys, hotloop.pipeline.post as p, hotloop.cli as c; p.CLOSE_FLUSH_SECONDS = 2; sys.exit(c.main(sys.argv[1:]))"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", entry, "serve", "--port", str(port), "--data-dir", str(data), "--sim-rate", "0",
             "--shutdown-grace", "1"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.1)
        db = sqlite3.connect(data / "hotloop.sqlite3", isolation_level=None, timeout=1)
        db.execute("BEGIN EXCLUSIVE")  # another connection's write lock, held
        ids = []
        for i in range(2):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/responses", timeout=10,
                           json={"model": "hotloop-sim", "input": f"hi {i}", "metadata": {"sim": "tokens:3"}})
            assert r.status_code == 200
            ids.append(r.json()["id"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == WRITES_LOST
        db.execute("ROLLBACK")
        assert [db.execute("SELECT count(*) FROM responses WHERE id = ?", (i,)).fetchone()[0] for i in ids] == [0, 0]
        db.close()
        assert "not stored" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
