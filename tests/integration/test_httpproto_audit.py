"""hotloop's HTTP/1.1 protocol (``server/httpproto.py``) on raw sockets: framing at the edges
of what it reads itself (a request head's end split across reads, a body still arriving after
its response, ``Expect: 100-continue`` answered without the 100)."""

from __future__ import annotations

import json
import time
from typing import Iterator

import httpx
import pytest

from tests.conftest import Server, run_server
from tests.integration.test_http_body import _connect, _responses
from tests.integration.test_limits_global import _drain, _read_response

READ_TIMEOUT = 1.5
MAX_BODY = 3 * 1024 * 1024
WAIT = 10.0  # bound on every wait in these tests
HEALTH = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--request-read-timeout", str(READ_TIMEOUT), "--store", "memory", "--sim-rate", "0")
    env = {"HOTLOOP_MAX_BODY_BYTES": str(MAX_BODY)}
    with run_server(tmp_path_factory.mktemp("audit"), *args, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """With the access log on: responses are written through uvicorn's send, corked."""
    args = ("--request-read-timeout", str(READ_TIMEOUT), "--store", "memory", "--sim-rate", "0", "--access-log")
    with run_server(tmp_path_factory.mktemp("audit-logged"), *args) as s:
        yield s


def _body(size: int) -> bytes:
    """A JSON request body of exactly ``size`` bytes whose token count depends on every word."""
    words: list[str] = []
    n = len(json.dumps({"model": "hotloop-sim", "input": ""}))
    while True:
        word = f"w{(len(words) * 7919 + size) % 10007} "
        if n + len(word) > size:
            break
        words.append(word)
        n += len(word)
    body = json.dumps({"model": "hotloop-sim", "input": "".join(words)}).encode()
    return body + b" " * (size - len(body))


def _head(size: int, path: bytes = b"/v1/responses/input_tokens", extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path, size, extra))


# -- a request head whose blank line is split across reads ------------------------------------


@pytest.mark.parametrize("size", [65_535, 200_000, 2_000_000], ids=["parser", "direct", "over-buffer"])
@pytest.mark.parametrize("cuts", [(1,), (2,), (3,), (3, 2, 1)], ids=["1", "2", "3", "3-2-1"])
def test_a_head_whose_end_is_split_across_reads_is_answered_with_its_body(
    srv: Server, size: int, cuts: tuple[int, ...]
) -> None:
    """The head's end was looked for within each read only: its blank line split across two
    reads (as TCP may deliver it), the whole next read (the body's first 64 KiB) was counted as
    head and the request refused 431. It is answered as if sent in one piece, and the request
    pipelined after it too."""
    body = _body(size)
    want = httpx.post(srv.v1 + "/responses/input_tokens", content=body,
                      headers={"content-type": "application/json"}, timeout=WAIT).json()
    head = _head(size)
    stream = head + body + HEALTH
    marks = [len(head) - c for c in cuts]
    pieces = [stream[a:b] for a, b in zip([0, *marks], [*marks, len(stream)])]
    s = _connect(srv)
    try:
        for piece in pieces:
            s.sendall(piece)
            time.sleep(0.05)  # a read each
        (status, got), (status2, health) = _responses(s, 2)
        assert status == 200 and got == want, got
        assert status2 == 200 and health["status"] == "ok"
    finally:
        s.close()


# -- a response complete before its request's body ----------------------------------------------


@pytest.mark.parametrize("early", ["404", "413"])
def test_a_body_that_stalls_after_its_response_gets_no_second_response(srv: Server, early: str) -> None:
    """A response that completes before its request's body has all arrived (a 404 that never
    reads it, a 413 once the limit is passed): the rest of the body is read and dropped, and if
    it stalls the read timeout closes the connection. It wrote a 408 as well, a second response
    to a request already answered."""
    s = _connect(srv)
    try:
        if early == "404":
            s.sendall(_head(100_000, b"/v1/no-such-route") + b"{" * 1000)
        else:
            s.sendall(_head(10 * MAX_BODY, b"/v1/responses") + b" " * (MAX_BODY + 1024 * 1024))
        status, _, got = _read_response(s)
        assert status == int(early) and json.loads(got)["error"]["type"] == "invalid_request_error"
        out, closed = _drain(s, READ_TIMEOUT * 3)
        assert out == b"", out[:300]
        assert closed is not None
    finally:
        s.close()
    assert httpx.get(srv.base + "/healthz", timeout=WAIT).status_code == 200


def test_a_body_after_an_early_response_is_read_and_the_connection_kept(srv: Server) -> None:
    """The body that follows an early response, sent in time, is dropped and the connection
    serves its next request (not a close, not a 408)."""
    s = _connect(srv)
    try:
        s.sendall(_head(100_000, b"/v1/no-such-route") + b"{" * 1000)
        [(status, _)] = _responses(s, 1)
        assert status == 404
        s.sendall(b"{" * 99_000 + HEALTH)
        [(status, got)] = _responses(s, 1)
        assert status == 200 and got["status"] == "ok"
    finally:
        s.close()


# -- Expect: 100-continue ---------------------------------------------------------------------------


@pytest.mark.parametrize("behind", [False, True], ids=["alone", "pipelined"])
@pytest.mark.parametrize("fixture", ["srv", "logged"])
def test_a_final_answer_without_100_continue_closes_the_connection(
    request: pytest.FixtureRequest, fixture: str, behind: bool
) -> None:
    """A client that sent ``Expect: 100-continue`` and got a final response instead does not
    send its body: the connection was kept, the client's next request read as that body and
    dropped, and the read timeout closed it (with a 408 the client took for that request's).
    Now the connection is closed after the response, which says so (through uvicorn's send too,
    with the access log on: it said nothing there, and closed), and a request pipelined ahead
    of it is answered first."""
    srv: Server = request.getfixturevalue(fixture)
    s = _connect(srv)
    try:
        s.sendall((HEALTH if behind else b"") + _head(50, b"/v1/no-such-route", b"Expect: 100-continue\r\n"))
        out, closed = _drain(s, WAIT)  # closed within the linger bound (at most the read timeout)
        assert closed is not None, out
        answers = out.split(b"HTTP/1.1 ")[1:]
        assert [a[:3] for a in answers] == ([b"200"] if behind else []) + [b"404"], out
        head, _, body = answers[-1].partition(b"\r\n\r\n")
        assert json.loads(body)["error"]["type"] == "invalid_request_error"  # and nothing after it
        assert b"\r\nconnection: close\r\n" in head + b"\r\n"  # (with the access log on too)
    finally:
        s.close()


@pytest.mark.parametrize("fixture", ["srv", "logged"])
def test_a_body_sent_after_a_final_answer_to_100_continue_is_read_not_reset(request: pytest.FixtureRequest, fixture: str) -> None:
    """The client asked for 100 Continue, got a final answer first, and sent its (large) body all
    the same, as RFC 9110 lets it: the server reads and drops it and closes afterwards (a
    lingering close), so the client's send completes and it reads the whole answer, instead of
    a reset in the middle of its send."""
    srv: Server = request.getfixturevalue(fixture)
    s = _connect(srv)
    try:
        size = 8 * 1024 * 1024
        s.sendall(_head(size, b"/v1/no-such-route", b"Expect: 100-continue\r\n"))
        time.sleep(0.2)  # the answer is out
        s.sendall(b"{" * size)  # a reset here would raise (BrokenPipeError / ConnectionResetError)
        out, closed = _drain(s, WAIT)
        assert out.startswith(b"HTTP/1.1 404"), out[:300]
        assert b"\r\nconnection: close\r\n" in out, out[:300]
        assert closed is not None
    finally:
        s.close()


@pytest.mark.parametrize("fixture", ["srv", "logged"])
def test_an_http10_request_expecting_100_continue_gets_no_interim_response(request: pytest.FixtureRequest, fixture: str) -> None:
    """An HTTP/1.0 request's expectation is ignored (RFC 9110, 10.1.1): its client knows no
    interim response and would read a 100 Continue as the answer. It got one before its body."""
    srv: Server = request.getfixturevalue(fixture)
    body = _body(200)
    s = _connect(srv)
    try:
        s.sendall(b"POST /v1/responses/input_tokens HTTP/1.0\r\nContent-Type: application/json\r\n"
                  b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        early, closed = _drain(s, 0.5)
        assert early == b"" and closed is None, early
        s.sendall(body)
        out, closed = _drain(s, WAIT)
        assert out.startswith(b"HTTP/1.1 200 "), out[:300]
        assert b"100 Continue" not in out and json.loads(out.partition(b"\r\n\r\n")[2])["input_tokens"] > 0
        assert closed is not None  # HTTP/1.0: closed after the answer
    finally:
        s.close()


def test_a_body_sent_without_waiting_for_100_continue_keeps_the_connection(srv: Server) -> None:
    """The client sent its body without waiting for the 100 (as it may): the early response
    leaves the connection open, the body is read and dropped, and the next request answered."""
    s = _connect(srv)
    try:
        s.sendall(_head(50, b"/v1/no-such-route", b"Expect: 100-continue\r\n") + b"{" * 50)
        status, headers, _ = _read_response(s)
        assert status == 404 and headers.get("connection") != "close"
        s.sendall(HEALTH)
        [(status, got)] = _responses(s, 1)
        assert status == 200 and got["status"] == "ok"
    finally:
        s.close()
