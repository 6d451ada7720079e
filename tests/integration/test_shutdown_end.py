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
