"""A WebSocket handshake the server refuses while frames the client sent without waiting for the
101 are held (reading paused until the application answers): raw sockets on 127.0.0.1 against a
real server. The client gets the whole refusal (status line, headers, the OpenAI error body) and
then a FIN, not a reset: the connection is closed cleanly (what the client still sends meanwhile
is read and dropped), within a bound, without a traceback, and without holding its place under
``--max-connections``."""

from __future__ import annotations

import base64
import json
import os
import socket
import time
from typing import Any, Iterator

import httpx
import pytest
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, raw_until_terminal, run_server
from tests.integration.test_ws_audit import _Frames, _mask

pytestmark = pytest.mark.timeout(120)

ADMIN_KEY = "sk-admin-" + "r" * 20
MAX_CONNECTIONS = 4
LARGE = 400_000  # a first frame larger than one read: most of it is still unread at the refusal


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("ws-refused-held")
    with run_server(
        tmp, "--sim-rate", "0", "--max-connections", str(MAX_CONNECTIONS), env={"HOTLOOP_API_KEY": ADMIN_KEY}
    ) as srv:
        yield srv


def _bad_key() -> str:
    # a fresh one each time: an unknown secret is remembered for 10 s, and a first look reads the
    # key table (the refusal then takes a moment, while the frames wait)
    return "hl-" + base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")


def _upgrade(key: str | None, path: str = "/v1/responses", version: str = "13") -> bytes:
    auth = b"Authorization: Bearer " + key.encode() + b"\r\n" if key else b""
    return (
        b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        + auth
        + b"Sec-WebSocket-Key: " + base64.b64encode(os.urandom(16))
        + b"\r\nSec-WebSocket-Version: " + version.encode() + b"\r\n\r\n"
    )


def _create(size: int = 10) -> bytes:
    body = {"type": "response.create", "model": "hotloop-sim", "store": False, "input": "x" * size}
    return _mask(0x1, json.dumps(body).encode())


class Answer:
    def __init__(self, data: bytes, end: str, seconds: float, sock: socket.socket) -> None:
        self.data = data
        self.end = end  # "FIN", "RST" or "TIMEOUT"
        self.seconds = seconds
        self.sock = sock

    def parsed(self) -> tuple[int, dict[str, str], dict[str, Any]]:
        head, sep, body = self.data.partition(b"\r\n\r\n")
        assert sep, f"no complete head: {self.data[:300]!r} ({self.end})"
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        assert int(headers["content-length"]) == len(body), (headers, body, self.end)
        return status, headers, json.loads(body)


def _refused(
    port: int, head: bytes, first: bytes = b"", then: bytes = b"", pause: float = 0.0, keep: bool = False,
    timeout: float = 10.0,
) -> Answer:
    """Send ``head`` and ``first`` in one write, then ``then`` in another (after ``pause``
    seconds); read until the server's FIN, a reset or ``timeout``. ``keep``: the socket stays
    open (the caller closes it)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(head + first)
    if pause:
        time.sleep(pause)
    if then:
        try:
            s.sendall(then)
        except OSError:
            pass  # (reset: the end says so)
    t0 = time.monotonic()
    data, end = read_to_end(s, t0 + timeout)
    seconds = time.monotonic() - t0
    if not keep:
        s.close()
    return Answer(data, end, seconds, s)


def read_to_end(s: socket.socket, deadline: float) -> tuple[bytes, str]:
    """What the server sends until its FIN, a reset or ``deadline`` (``time.monotonic()``), and
    which of the three ended it: ``"FIN"``, ``"RST"`` or ``"TIMEOUT"``."""
    data = b""
    try:
        while time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = s.recv(1 << 16)
            if not chunk:
                return data, "FIN"
            data += chunk
    except ConnectionResetError:
        return data, "RST"
    except socket.timeout:
        pass
    return data, "TIMEOUT"


def _sockets(pid: int) -> int:
    """Socket descriptors the server process holds."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _settled(server: Server, baseline: int, within: float) -> int:
    deadline = time.monotonic() + within
    n = _sockets(server.proc.pid)
    while n > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
        n = _sockets(server.proc.pid)
    return n


@pytest.fixture
def baseline(server: Server) -> int:
    if not os.path.isdir(f"/proc/{server.proc.pid}/fd"):
        pytest.skip("needs /proc")
    time.sleep(0.1)
    return _sockets(server.proc.pid)


def _assert_unauthorized(a: Answer) -> None:
    status, headers, body = a.parsed()
    assert status == 401, a.data[:200]
    assert headers["content-type"].startswith("application/json")
    assert headers["x-request-id"].startswith("req_")
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key", body
    assert a.end == "FIN", f"{a.end} after {a.seconds:.3f}s: {a.data[:120]!r}"
    assert a.seconds < 5.0


def _no_errors(server: Server, before: int) -> None:
    log = server.logs()[before:]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


@pytest.mark.parametrize("size", [10, 5_000, LARGE], ids=["small", "medium", "large"])
def test_a_refusal_with_frames_in_the_same_write_ends_with_a_fin(server: Server, baseline: int, size: int) -> None:
    before = len(server.logs())
    for _ in range(3):
        _assert_unauthorized(_refused(server.port, _upgrade(_bad_key()), first=_create(size) + _create()))
    assert _settled(server, baseline, 5.0) == baseline  # every refused connection is closed
    _no_errors(server, before)


@pytest.mark.parametrize("size", [10, LARGE], ids=["small", "large"])
def test_a_refusal_with_frames_in_a_write_of_their_own_ends_with_a_fin(server: Server, baseline: int, size: int) -> None:
    before = len(server.logs())
    for _ in range(3):
        _assert_unauthorized(_refused(server.port, _upgrade(_bad_key()), then=_create(size) + _create()))
    assert _settled(server, baseline, 5.0) == baseline
    _no_errors(server, before)


def test_frames_that_come_after_the_refusal_is_written_do_not_reset_it(server: Server, baseline: int) -> None:
    """The client writes while the 401 is on its way (it has not read it yet): what it sends is
    read and dropped, the 401 is read whole, then the FIN."""
    before = len(server.logs())
    _assert_unauthorized(_refused(server.port, _upgrade(_bad_key()), then=_create(LARGE), pause=0.3))
    assert _settled(server, baseline, 5.0) == baseline
    _no_errors(server, before)


def test_other_refusals_with_held_frames_end_with_a_fin(server: Server, baseline: int) -> None:
    before = len(server.logs())
    # the application's: a path it does not serve over WebSocket (404), no key (401)
    a = _refused(server.port, _upgrade(ADMIN_KEY, path="/v1/elsewhere"), first=_create(LARGE))
    status, _, body = a.parsed()
    assert status == 404 and body["error"]["type"] == "invalid_request_error" and a.end == "FIN", (a.data[:200], a.end)
    a = _refused(server.port, _upgrade(None), first=_create(LARGE))
    assert a.parsed()[0] == 401 and a.end == "FIN", (a.data[:200], a.end)
    # websockets' own, before the application: a version the server does not speak (400)
    a = _refused(server.port, _upgrade(ADMIN_KEY, version="8"), first=_create(LARGE))
    status, headers, body = a.parsed()
    assert status == 400 and headers["sec-websocket-version"] == "13" and a.end == "FIN", (a.data[:200], a.end)
    assert body["error"]["code"] == "invalid_websocket_handshake"
    assert _settled(server, baseline, 5.0) == baseline
    _no_errors(server, before)


def test_a_client_that_keeps_its_socket_open_is_closed_within_a_bound(server: Server, baseline: int) -> None:
    """The client reads the 401 and its FIN but never closes: the server does, soon."""
    a = _refused(server.port, _upgrade(_bad_key()), first=_create(LARGE), keep=True)
    try:
        _assert_unauthorized(a)
        assert _settled(server, baseline, 6.0) == baseline
    finally:
        a.sock.close()


def test_refusals_hold_no_place_under_the_connection_limit(server: Server, baseline: int) -> None:
    for i in range(3 * MAX_CONNECTIONS):
        if i % 2:
            _assert_unauthorized(_refused(server.port, _upgrade(_bad_key()), first=_create(LARGE)))
        else:
            _assert_unauthorized(_refused(server.port, _upgrade(_bad_key()), then=_create()))
    assert _settled(server, baseline, 5.0) == baseline
    # every place is free: as many WebSockets as the limit allows, each answered
    conns = [
        ws_connect(server.ws + "/responses", open_timeout=10, additional_headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        for _ in range(MAX_CONNECTIONS)
    ]
    try:
        for ws in conns:
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "store": False, "input": "hi"}))
            assert raw_until_terminal(ws)[-1]["type"] == "response.completed"
    finally:
        for ws in conns:
            ws.close()
    assert _settled(server, baseline, 5.0) == baseline
    assert httpx.get(server.base + "/healthz", timeout=5).status_code == 200


def test_frames_held_for_an_accepted_handshake_are_still_answered(server: Server) -> None:
    """The guard's other side: the same client with a good key gets the 101 and its response."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        s.sendall(_upgrade(ADMIN_KEY) + _create(LARGE))
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            assert chunk, head
            head += chunk
        status, rest = head.split(b"\r\n\r\n", 1)
        assert status.startswith(b"HTTP/1.1 101"), status
        assert _Frames(s, rest).until_terminal(timeout=20)[-1]["type"] == "response.completed"
    finally:
        s.close()
