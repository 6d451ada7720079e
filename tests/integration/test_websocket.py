"""WebSocket mode details: the connection cache, FIFO queueing, lanes, limits, auth, restart."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from openai import OpenAI
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, raw_until_terminal, run_server


def until_terminal(conn) -> list:
    out = []
    for e in conn:
        out.append(e)
        if e.type in ("response.completed", "response.failed", "response.incomplete", "error"):
            return out
    raise AssertionError("connection closed before a terminal event")


def test_cache_holds_only_the_latest_unstored_response(server) -> None:
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=0)
    with client.responses.connect() as conn:
        ids = []
        prev = None
        for i in range(3):
            conn.response.create(model="hotloop-sim", input=f"turn {i}", previous_response_id=prev, store=False)
            evs = until_terminal(conn)
            assert evs[-1].type == "response.completed"
            prev = evs[-1].response.id
            ids.append(prev)
        # the first response is no longer cached and was never stored
        conn.response.create(model="hotloop-sim", input="x", previous_response_id=ids[0], store=False)
        [e] = until_terminal(conn)
        assert e.type == "error" and e.error.code == "previous_response_not_found"
        # the latest is still cached
        conn.response.create(model="hotloop-sim", input="x", previous_response_id=ids[-1], store=False)
        assert until_terminal(conn)[-1].type == "response.completed"


def test_stored_response_hydrates_on_another_connection(server) -> None:
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=0)
    with client.responses.connect() as conn:
        conn.response.create(model="hotloop-sim", input="remember me")
        first = until_terminal(conn)[-1].response
    with client.responses.connect() as conn:
        conn.response.create(model="hotloop-sim", input="and now?", previous_response_id=first.id)
        second = until_terminal(conn)[-1].response
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens


def test_frames_are_queued_fifo(server) -> None:
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        for i in range(3):
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": f"q{i}", "store": False}))
        ws.send("garbage")
        seen = []
        for _ in range(3):
            evs = raw_until_terminal(ws)
            assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
            assert evs[-1]["type"] == "response.completed"
            seen.append(evs[0]["response"]["id"])
        err = json.loads(ws.recv(timeout=30))
        assert err["type"] == "error" and err["status"] == 400 and "sequence_number" not in err
    assert len(set(seen)) == 3


def test_generate_false_warmup_then_continue(server) -> None:
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "context", "generate": False, "store": False}))
        evs = raw_until_terminal(ws)
        assert [e["type"] for e in evs] == ["response.created", "response.in_progress", "response.completed"]
        warm = evs[-1]["response"]
        assert warm["status"] == "completed" and warm["output"] == []
        assert warm["usage"]["input_tokens"] > 0 and warm["usage"]["output_tokens"] == 0
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": [], "previous_response_id": warm["id"], "store": False}))
        evs = raw_until_terminal(ws)
        assert evs[-1]["type"] == "response.completed"
        assert evs[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] >= warm["usage"]["input_tokens"]


def test_named_lane_echoes_stream_id(server) -> None:
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x", "store": False, "stream_id": "agent_1"}))
        evs = raw_until_terminal(ws)
        assert all(e.get("stream_id") == "agent_1" for e in evs)
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x", "previous_response_id": "resp_x", "stream_id": "agent_1"}))
        [err] = raw_until_terminal(ws)
        assert err["stream_id"] == "agent_1" and err["error"]["code"] == "previous_response_not_found"
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x", "store": False}))
        evs = raw_until_terminal(ws)
        assert all("stream_id" not in e for e in evs)


def test_connection_age_limit_closes_with_1001(tmp_path) -> None:
    with run_server(tmp_path, "--sim-rate", "0", env={"HOTLOOP_WS_CONNECTION_MAX_AGE": "1"}) as srv:
        with ws_connect(srv.ws + "/responses", open_timeout=10) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x", "store": False}))
            assert raw_until_terminal(ws)[-1]["type"] == "response.completed"
            time.sleep(1.2)
            err = json.loads(ws.recv(timeout=10))
            assert err["type"] == "error" and err["error"]["code"] == "websocket_connection_limit_reached"
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
            assert ws.close_code == 1001


def test_api_key_required_on_http_and_upgrade(tmp_path) -> None:
    with run_server(tmp_path, "--sim-rate", "0", "--api-key", "sk-right") as srv:
        bad = OpenAI(api_key="sk-wrong", base_url=srv.v1, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as ei:
            bad.responses.create(model="hotloop-sim", input="x")
        assert ei.value.code == "invalid_api_key"
        r = httpx.get(srv.v1.replace("/v1", "") + "/healthz")
        assert r.status_code == 200  # probes need no key
        with pytest.raises(InvalidStatus) as wi:
            with ws_connect(srv.ws + "/responses", open_timeout=10, additional_headers={"Authorization": "Bearer sk-wrong"}):
                pass
        assert wi.value.response.status_code == 401
        assert json.loads(wi.value.response.body)["error"]["code"] == "invalid_api_key"
        good = OpenAI(api_key="sk-right", base_url=srv.v1, max_retries=0)
        with good.responses.connect() as conn:
            conn.response.create(model="hotloop-sim", input="x", store=False)
            assert until_terminal(conn)[-1].type == "response.completed"


def test_sqlite_store_survives_restart(tmp_path) -> None:
    env = {"HOTLOOP_DATA_DIR": str(tmp_path / "data")}
    with run_server(tmp_path, "--sim-rate", "0", env=env) as srv:
        client = OpenAI(api_key="k", base_url=srv.v1, max_retries=0)
        r1 = client.responses.create(model="hotloop-sim", input="persist me")
    with run_server(tmp_path, "--sim-rate", "0", env=env) as srv:
        client = OpenAI(api_key="k", base_url=srv.v1, max_retries=0)
        got = client.responses.retrieve(r1.id)
        assert got.output_text == r1.output_text
        # items of stored responses are found by id in SQLite (item_reference), before anything
        # loaded the response into memory
        r3 = client.responses.create(model="hotloop-sim", input=[{"type": "item_reference", "id": r1.output[0].id}])
        assert r3.status == "completed"
        r2 = client.responses.create(model="hotloop-sim", input="again", previous_response_id=r1.id)
        assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.total_tokens


def test_large_input_counted_off_loop_matches_input_tokens_endpoint(server) -> None:
    """Inputs above the inline threshold are tokenized in a worker thread: same counts.

    Each input is new to the server when first sent (the token cache would otherwise answer).
    """
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=0)
    big = ["lorem ipsum dolor sit amet %d " % i * 2600 for i in range(3)]  # ~73 KB each, above INLINE_TOKENIZE_CHARS
    with client.responses.connect() as conn:
        conn.response.create(model="hotloop-sim", input=big[0], store=False)
        first = until_terminal(conn)[-1].response
        conn.response.create(model="hotloop-sim", input=big[1], previous_response_id=first.id, store=False, generate=False)
        warm = until_terminal(conn)[-1].response
    r = client.responses.create(model="hotloop-sim", input=big[2], store=False)
    expected = [client.responses.input_tokens.count(model="hotloop-sim", input=b).input_tokens for b in big]
    assert first.usage.input_tokens == expected[0]
    assert r.usage.input_tokens == expected[2]
    # the chained context: first input + first output (+ per-item framing) + the new input
    assert 0 <= warm.usage.input_tokens - (first.usage.total_tokens + expected[1]) <= 4


def test_large_and_small_frames_through_the_batch_send(server) -> None:
    # response.completed of a 20,000-token answer needs the 8-byte frame length; deltas need 1
    with ws_connect(server.ws + "/responses", open_timeout=10, max_size=None) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x", "store": False,
                            "stream_id": "lane_big", "metadata": {"sim": "text,tokens:20000,rate:0"}}))
        evs = raw_until_terminal(ws)
        deltas = [e["delta"] for e in evs if e["type"] == "response.output_text.delta"]
        final = evs[-1]
        assert final["type"] == "response.completed" and len(deltas) == 20000
        assert all(e["stream_id"] == "lane_big" for e in evs)
        assert final["response"]["output"][0]["content"][0]["text"] == "".join(deltas)
        assert len(json.dumps(final)) > 65536


def _ws_frame(opcode: int, payload: bytes) -> bytes:
    """A client's masked, final frame (payload under 126 bytes)."""
    import os

    mask = os.urandom(4)
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _raw_websocket(port: int, rcvbuf: int | None = None) -> tuple[socket.socket, bytes]:
    """A raw client socket after the WebSocket handshake, and what it read after the 101's head
    (``rcvbuf``: a receive buffer of that size, without the kernel's autotuning)."""
    import base64
    import os

    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16))
    s.sendall(
        b"GET /v1/responses HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 101")
    return s, head.split(b"\r\n\r\n", 1)[1]


def test_a_client_that_pings_and_never_reads_gets_one_pong_held_not_all(server) -> None:
    """uvicorn wrote a pong for every ping, whether or not the client read them (about 25 MB a
    second held by the server for one such client). While the client does not read, only the
    latest ping's pong is kept: it arrives once the client reads, after those written before."""
    s, rest = _raw_websocket(server.port, rcvbuf=65536)  # no autotuning (up to 32 MB here)
    try:
        pings = 200_000  # 26 MB of pongs: more than the kernel's buffers on both sides hold
        batch = b"".join(_ws_frame(0x9, b"%06d" % i + b"p" * 119) for i in range(1000))
        s.settimeout(60)
        for _ in range(pings // 1000):
            s.sendall(batch)  # the same 1,000 frames each time
        last = _ws_frame(0x9, b"last-ping")
        s.sendall(last)
        time.sleep(0.5)  # the server reads it all
        # now read: the pongs written before the client stopped reading, then the held one
        s.settimeout(2)
        buf = rest
        while True:
            try:
                chunk = s.recv(1 << 20)
            except TimeoutError:
                break
            if not chunk:
                break
            buf += chunk
        pongs = buf.count(b"\x8a\x7d") + buf.count(b"\x8a\x09")  # 125- and 9-byte pongs
        assert buf.endswith(b"\x8a\x09last-ping"), buf[-40:]  # the latest ping is answered, last
        assert pongs < pings // 2, pongs  # the rest were never held
    finally:
        s.close()
    # the server serves on, WebSocket mode included
    with ws_connect(server.ws + "/responses") as ws:
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi", "store": False}))
        assert raw_until_terminal(ws)[-1]["type"] == "response.completed"


def _wait_until_let_go(server: Server) -> None:
    """Wait for the connection's one response to start (and fill the buffers), then for the
    server to let the connection go: no response running after at most 15 s."""

    def active() -> int:
        return int(httpx.get(server.base + "/hotloop/stats", timeout=5).json()["active_responses"])

    deadline = time.monotonic() + 5
    while active() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active() == 1
    deadline = time.monotonic() + 15
    while active() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert active() == 0


def test_a_client_that_stops_reading_is_let_go_at_the_keepalive_timeout(tmp_path) -> None:
    """A client sends response.create and reads nothing. Its unanswered pings closed the
    connection gracefully, which waits for the write buffer to drain: never, so its response
    (and the backend connection under it) stayed until the server restarted. Now the
    connection is aborted and the response cancelled."""
    import os

    args = ("--store", "memory", "--sim-rate", "0", "--sim-output-tokens", "100000", "--ws-ping-interval", "0.5",
            "--ws-ping-timeout", "0.5")
    with run_server(tmp_path, *args) as server:
        s, _ = _raw_websocket(server.port, rcvbuf=4096)  # no autotuning
        try:
            create = json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi " * 50, "store": False}).encode()
            mask = os.urandom(4)
            s.sendall(bytes([0x81, 0x80 | 126]) + len(create).to_bytes(2, "big") + mask
                      + bytes(b ^ mask[i % 4] for i, b in enumerate(create)))
            _wait_until_let_go(server)
            closed = False
            s.settimeout(2)
            try:
                while s.recv(1 << 20):
                    pass
                closed = True
            except ConnectionResetError:
                closed = True
            assert closed  # aborted: the client reads what its buffers held, then the end
        finally:
            s.close()
        assert "Traceback" not in server.logs()


def test_a_client_that_pipelines_frames_then_stops_reading_is_let_go(tmp_path) -> None:
    """A client sends more response.create frames than the connection queues, then reads nothing
    and answers no ping (a hung process). Reading paused (the frames wait for room), so each
    pong deadline was pushed back, and the running response waited to write for good: the
    connection, its response and its queued frames were held until the client's socket closed.
    Now a deadline that passes with the write buffer full and not drained once fails it."""
    import os

    args = ("--store", "memory", "--sim-rate", "0", "--sim-output-tokens", "100000", "--ws-ping-interval", "0.5",
            "--ws-ping-timeout", "0.5", "--metrics-public")
    with run_server(tmp_path, *args) as server:
        s, _ = _raw_websocket(server.port, rcvbuf=4096)  # no autotuning
        try:
            create = json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "go " + "word " * 200}).encode()
            frames = []
            for _ in range(150):  # past the queue's 64 and the reader's backlog: reading pauses
                mask = os.urandom(4)
                frames.append(bytes([0x81, 0x80 | 126]) + len(create).to_bytes(2, "big") + mask
                              + bytes(b ^ mask[i % 4] for i, b in enumerate(create)))
            s.sendall(b"".join(frames))
            _wait_until_let_go(server)
            metrics = httpx.get(server.base + "/metrics", timeout=5).text
            assert 'hotloop_open_connections{transport="websocket"} 0.0' in metrics
            assert "hotloop_ws_queued_creates 0.0" in metrics
        finally:
            s.close()
        assert "Traceback" not in server.logs()


def test_a_client_that_pipelines_frames_and_reads_with_a_short_stall_is_kept(tmp_path) -> None:
    """The other side of the rule above: a client whose frames wait for room (reading paused)
    that reads what it is sent, and stalls once across a pong deadline for less than the pong
    timeout, is kept: the server's writes were held up for less than a whole timeout."""
    import os
    import select

    timeout = 3.0
    args = ("--store", "memory", "--sim-rate", "0", "--sim-output-tokens", "100000", "--ws-ping-interval",
            str(timeout), "--ws-ping-timeout", str(timeout))
    with run_server(tmp_path, *args) as server:
        s, buf = _raw_websocket(server.port, rcvbuf=4096)
        frames = bytearray(buf)
        try:
            create = json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "go " + "word " * 200,
                                 "store": False}).encode()
            pipelined = []
            for _ in range(150):
                mask = os.urandom(4)
                pipelined.append(bytes([0x81, 0x80 | 126]) + len(create).to_bytes(2, "big") + mask
                                 + bytes(b ^ mask[i % 4] for i, b in enumerate(create)))
            s.sendall(b"".join(pipelined))
            s.setblocking(False)
            t0 = time.monotonic()
            first_ping: float | None = None
            stalled = False
            total = 0
            while time.monotonic() < t0 + 4 * timeout:
                now = time.monotonic()
                if first_ping is not None and not stalled and now >= first_ping + 2 * timeout - 1.5:
                    stalled = True  # no reading across the second pong deadline: 2 s (the buffers fill)
                    time.sleep(2.0)
                    continue
                if not select.select([s], [], [], 0.05)[0]:
                    continue
                try:
                    data = s.recv(1 << 20)
                except BlockingIOError:
                    continue
                assert data, "closed by the server"  # (a reset raises ConnectionResetError)
                total += len(data)
                frames += data
                while len(frames) >= 4:  # the server's frames (unmasked): find its first ping
                    n, h = frames[1] & 0x7F, 2
                    if n == 126:
                        n, h = int.from_bytes(frames[2:4], "big"), 4
                    elif n == 127:
                        if len(frames) < 10:
                            break
                        n, h = int.from_bytes(frames[2:10], "big"), 10
                    if len(frames) < h + n:
                        break
                    if frames[0] & 0xF == 0x9 and first_ping is None:
                        first_ping = time.monotonic()
                    del frames[: h + n]
            assert stalled and total > 1_000_000
        finally:
            s.close()
        assert "keepalive" not in server.logs() and "Traceback" not in server.logs()


def test_a_client_whose_frames_wait_for_room_is_not_let_go_at_the_keepalive_timeout(tmp_path) -> None:
    """The connection's queue is full (frames wait behind a long response for
    ``ws_max_queued_bytes``), so the server stops reading it. The client's pongs are then among
    the bytes not read: the server's keepalive took their absence for a client gone, closed a
    healthy connection with 1011 and cancelled its responses. Now the deadline waits for reading
    to resume, and every response is answered."""
    args = ("--store", "memory", "--ws-ping-interval", "0.5", "--ws-ping-timeout", "0.5")
    with run_server(tmp_path, *args, env={"HOTLOOP_WS_MAX_QUEUED_BYTES": "200000"}) as server:
        with ws_connect(server.ws + "/responses", open_timeout=10, max_size=None, compression=None, ping_interval=None) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "long", "store": False,
                                "metadata": {"sim": "tokens:30,rate:10"}}))  # 3 s: six pings
            for _ in range(4):  # 150 KB each: the second waits for room, unread
                ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x" * 150_000,
                                    "store": False, "metadata": {"sim": "tokens:3"}}))
            done = []
            while len(done) < 5:
                event = json.loads(ws.recv(timeout=30))
                if event["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
                    done.append(event["type"])
            assert done == ["response.completed"] * 5
        assert "keepalive" not in server.logs() and "Traceback" not in server.logs()


def test_a_text_message_that_is_not_utf8_closes_with_1007_and_one_log_line(server) -> None:
    """uvicorn logged each such message as an ERROR with a traceback: any client could flood
    the log. Now one line; the close is 1007 as before."""
    before = server.logs().count("is not UTF-8")
    for _ in range(3):
        s, buf = _raw_websocket(server.port)
        try:
            s.sendall(_ws_frame(0x1, b'{"type":"\xff"}'))
            while len(buf) < 4:
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
            assert buf[0] == 0x88 and int.from_bytes(buf[2:4], "big") == 1007  # a close frame, 1007
        finally:
            s.close()
    deadline = time.monotonic() + 5
    while server.logs().count("is not UTF-8") < before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.logs().count("is not UTF-8") == before + 3
    assert "Traceback" not in server.logs() and "Invalid UTF-8" not in server.logs()


def test_pings_are_answered_while_frames_wait_for_room(tmp_path) -> None:
    """80 response.create frames sent at once: past the backlog bound the reader waits for a
    response to finish, and reading had paused with a message waiting, so a ping sent then was
    answered only seconds later (a client with websockets' 20 s ping timeout would drop the
    connection and its queued responses). Small frames are read ahead now: the pong is at once."""
    with run_server(tmp_path, "--store", "memory", "--sim-rate", "50", "--sim-output-tokens", "100") as server:
        s, buf = _raw_websocket(server.port)
        try:
            frames = [json.dumps({"type": "response.create", "model": "m", "input": f"t{i}", "store": False}).encode()
                      for i in range(80)]
            s.sendall(b"".join(_ws_frame(0x1, f) for f in frames))
            time.sleep(0.5)
            s.sendall(_ws_frame(0x9, b"are-you-there"))
            t0 = time.monotonic()
            while b"\x8a\x0dare-you-there" not in buf and time.monotonic() - t0 < 10:
                buf += s.recv(1 << 16)
            assert b"\x8a\x0dare-you-there" in buf and time.monotonic() - t0 < 1.0
        finally:
            s.close()


def test_a_create_and_a_bad_frame_in_one_write_leave_the_server_serving(server: Server) -> None:
    """A valid response.create and, in the same write, a text frame that is not UTF-8: the reader
    made the create's lane task, then read the disconnect the bad frame queued, without
    suspending, and cancelled that task before it ran. Its entry stayed, and the reader's
    cancel-and-await loop spun for good: the whole process stopped answering (and SIGTERM)."""
    for _ in range(3):
        s, buf = _raw_websocket(server.port)
        try:
            create = json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi"}).encode()
            s.sendall(_ws_frame(0x1, create) + _ws_frame(0x1, b"\xff\xfe"))
            deadline = time.monotonic() + 10
            while b"\x88" not in buf and time.monotonic() < deadline:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        finally:
            s.close()
        assert httpx.get(server.base + "/healthz", timeout=5).status_code == 200


def test_connections_caches_share_the_process_byte_budget(tmp_path) -> None:
    """``ws_cache_total_bytes``: each connection within its own bound, together over the process's
    budget, the oldest cached response goes (a ``store: false`` one cannot be continued, as any
    uncached one), and a closed connection gives its bytes back (``/hotloop/stats``)."""
    env = {"HOTLOOP_WS_CACHE_TOTAL_BYTES": str(600_000)}
    with run_server(tmp_path, "--sim-rate", "0", env=env) as s:
        client = OpenAI(api_key="k", base_url=s.v1, max_retries=0)

        def caches() -> dict:
            return httpx.get(s.base + "/hotloop/stats", timeout=10).json()["ws_connection_caches"]

        with client.responses.connect() as one, client.responses.connect() as two:
            one.response.create(model="hotloop-sim", input="a " * 100_000, store=False)
            first = until_terminal(one)[-1].response
            held = caches()
            assert held["entries"] == 1 and 200_000 < held["bytes"] <= 600_000 and held["max_bytes"] == 600_000
            one.response.create(model="hotloop-sim", input="more", previous_response_id=first.id, store=False)
            again = until_terminal(one)[-1].response  # cached: continued
            assert again.status == "completed"
            two.response.create(model="hotloop-sim", input="b " * 250_000, store=False)
            assert until_terminal(two)[-1].type == "response.completed"
            after = caches()
            assert after["entries"] == 1 and after["bytes"] <= 600_000  # one's went to make room
            one.response.create(model="hotloop-sim", input="more", previous_response_id=again.id, store=False)
            [e] = until_terminal(one)
            assert e.type == "error" and e.error.code == "previous_response_not_found"
            two.close()
            deadline = time.monotonic() + 10
            while caches()["entries"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert caches() == {"entries": 0, "bytes": 0, "max_bytes": 600_000}
