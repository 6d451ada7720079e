"""Adversarial clients: disconnects, deep JSON, floods, failed continuations, hostile schemas.

Every case also relies on the server fixture's check that the server logged no traceback.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
from openai import OpenAI
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.conftest import run_server


def active(server) -> int:
    return int(httpx.get(server.base + "/healthz", timeout=10).json()["active_responses"])


def wait_idle(server, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if active(server) == 0:
            return True
        time.sleep(0.05)
    return False


def recv_json(ws) -> dict:
    return json.loads(ws.recv(timeout=30))


def until_terminal(ws) -> list[dict]:
    out = []
    while True:
        e = recv_json(ws)
        out.append(e)
        if e["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
            return out


def slow_body(**kw) -> dict:
    return {"model": "hotloop-sim", "input": "x", "store": False, "metadata": {"sim": "tokens:400,rate:20"}, **kw}


def test_sse_client_disconnect_cancels_generation(server) -> None:
    assert wait_idle(server)
    with httpx.stream("POST", server.v1 + "/responses", json=slow_body(stream=True), timeout=30) as r:
        lines = r.iter_lines()
        for line in lines:
            if "output_text.delta" in line:
                assert active(server) == 1
                break
    # leaving the block closes the connection after ~2 of 400 tokens (20 s at 20 tokens/s)
    assert wait_idle(server), "generation continued after the client went away"


def test_json_client_timeout_cancels_generation(server) -> None:
    assert wait_idle(server)
    try:
        httpx.post(server.v1 + "/responses", json=slow_body(), timeout=0.5)
    except httpx.TimeoutException:
        pass
    assert wait_idle(server), "generation continued after the client gave up"


def test_upload_abort_is_quiet(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"")
    time.sleep(0.2)
    assert "Exception in ASGI application" not in server.logs()


def test_deep_json_is_a_400_everywhere(server) -> None:
    deep = "[" * 5000 + "]" * 5000
    r = httpx.post(server.v1 + "/responses", content=f'{{"model":"m","input":{deep}}}', timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    nested: object = "x"
    for _ in range(300):
        nested = [nested]
    body = {"model": "hotloop-sim", "input": [{"type": "custom_tool_call", "call_id": "c", "name": "n", "input": nested}]}
    r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"default": nested}}}}
    r = httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", "input": "x", "tools": [tool]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        ws.send('{"type":"response.create","model":"m","input":' + deep + "}")
        e = recv_json(ws)
        assert e["type"] == "error" and e["status"] == 400
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "ok", "store": False}))
        assert until_terminal(ws)[-1]["type"] == "response.completed"


def test_failed_continuations_evict_the_parent(server) -> None:
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        def turn(**kw) -> list[dict]:
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x", "store": False, **kw}))
            return until_terminal(ws)

        failures = [
            {"tool_choice": "sometimes"},  # invalid value (validation)
            {"tools": "abc"},  # invalid type (frame decoding)
            {"input": [{"type": "function_call_output", "call_id": "call_none", "output": "x"}]},  # unknown call
            {"metadata": {"sim": "rate_limit"}},  # backend error before the first token
        ]
        for bad in failures:
            parent = turn()[-1]["response"]["id"]
            [err] = turn(previous_response_id=parent, **bad)
            assert err["type"] == "error", bad
            [gone] = turn(previous_response_id=parent)
            assert gone["error"]["code"] == "previous_response_not_found", bad


def test_hostile_tool_schemas_and_directives_are_400(server) -> None:
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=0)
    for params in ({"properties": {"a": 5}}, {"properties": [1, 2]}, {"anyOf": {"a": 1}}, {"type": "array", "minItems": "x"}):
        r = httpx.post(
            server.v1 + "/responses",
            json={"model": "hotloop-sim", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", **params}}]},
            timeout=30,
        )
        assert r.status_code == 400, (params, r.text)
    for sim in ("tokens:20000000", "tools:100000", "stall:-1", "rate:-5"):
        r = httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", "input": "x", "metadata": {"sim": sim}}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata.sim", sim
    t0 = time.monotonic()
    r2 = client.responses.create(model="hotloop-sim", input="x", max_output_tokens=1, metadata={"sim": "tokens:100000"})
    assert r2.status == "incomplete" and time.monotonic() - t0 < 10


def test_age_limit_reached_with_a_full_queue(tmp_path) -> None:
    env = {"HOTLOOP_WS_CONNECTION_MAX_AGE": "1.5", "HOTLOOP_WS_MAX_QUEUED": "2"}
    with run_server(tmp_path, "--sim-rate", "0", env=env) as srv:
        with ws_connect(srv.ws + "/responses", open_timeout=10) as ws:
            ws.send(json.dumps(slow_body(metadata={"sim": "tokens:60,rate:20"})))  # ~3 s
            for _ in range(40):
                ws.send(b"\x00binary")
            errors, codes = 0, []
            try:
                while True:
                    e = recv_json(ws)
                    if e["type"] == "error":
                        codes.append(e["error"]["code"])
            except ConnectionClosed:
                pass
            assert "websocket_connection_limit_reached" in codes
            assert ws.close_code == 1001


def test_client_chosen_item_ids_are_not_resolvable_by_others(server) -> None:
    secret = {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "A's secret"}]}
    r = httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", "input": [secret]}, timeout=30)
    assert r.status_code == 200
    r = httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", "input": [{"type": "item_reference", "id": "msg_1"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "item_not_found"


def _raw_exchange(server, raw: bytes) -> tuple[int, dict]:
    """Send ``raw`` on a fresh connection; the status and JSON body of what comes back."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        s.sendall(raw)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    finally:
        s.close()
    head, _, body = out.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split()[1]), json.loads(body)


def test_what_is_not_http_or_not_a_handshake_gets_the_openai_error_shape(server) -> None:
    """uvicorn and websockets answered these in text, websockets' naming its own exceptions
    (a base64 decoder's "Incorrect padding")."""
    for raw in (
        b"BLAH BLAH\r\n\r\n",
        b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ):
        status, body = _raw_exchange(server, raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (raw, body)
        assert body["error"]["code"] == "invalid_http_request", (raw, body)
    upgrade = b"GET /v1/responses HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
    post = upgrade.replace(b"GET ", b"POST ", 1) + b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    for raw in (upgrade + b"\r\n", upgrade + b"Sec-WebSocket-Key: bad\r\n\r\n", post):  # the last: websockets cannot parse it
        status, body = _raw_exchange(server, raw)
        assert status == 400 and body["error"]["code"] == "invalid_websocket_handshake", body
        assert "padding" not in body["error"]["message"] and "Sec-WebSocket" not in body["error"]["message"]
    assert httpx.get(server.base + "/healthz", timeout=10).status_code == 200
