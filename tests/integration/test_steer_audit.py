"""``response.steer`` and lanes against a real ``hotloop serve`` (simulator backend), audited
against the README's "WebSocket lanes and steering". Every wait is bounded."""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import httpx
import pytest
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, run_server

TERMINAL = ("response.completed", "response.failed", "response.incomplete")
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(tmp_path_factory.mktemp("steer_audit"), "--sim-rate", "200", "--store", "memory") as s:
        yield s


def create(**kw: Any) -> str:
    kw.setdefault("model", "hotloop-sim")
    kw.setdefault("input", "hi")
    kw.setdefault("store", False)
    return json.dumps({"type": "response.create", **kw})


def steer(rid: str, input: Any) -> str:
    return json.dumps({"type": "response.steer", "previous_response_id": rid, "input": input})


def recv(ws: Any, timeout: float = 10) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=timeout))


def until(ws: Any, pred: Any, timeout: float = 20) -> list[dict[str, Any]]:
    """Events up to and including the first that ``pred`` accepts (within ``timeout``)."""
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        e = recv(ws, max(0.05, deadline - time.monotonic()))
        out.append(e)
        if pred(e):
            return out


def test_a_continuation_refused_behind_its_running_parent_returns_the_pending_input(paced: Server) -> None:
    """The continuation of a steered tool-call turn sent (pipelined) while that turn still runs,
    and refused on arrival (a malformed field): its error waits behind the lane, and the steering
    input queued for it must come back after it (``successor_creation_failed``), as it does when
    the refusal comes after ``response.steer.pending``. It stayed queued and was silently
    prepended to the next continuation instead."""
    with ws_connect(paced.ws + "/responses") as ws:
        ws.send(create(input="weather?", tools=TOOLS, store=True, metadata={"sim": "tools:1,rate:10"}))
        rid = recv(ws)["response"]["id"]
        ws.send(steer(rid, "and Rome"))
        ws.send(create(previous_response_id=rid, input=[], tools=TOOLS, temperature="hot"))
        events = until(ws, lambda e: e["type"] == "error")
        kinds = [e["type"] for e in events]
        assert "response.steer.accepted" in kinds and "response.completed" in kinds
        assert kinds.index("response.completed") < kinds.index("response.steer.pending") < kinds.index("error")
        assert events[-1]["error"]["param"] == "temperature"
        back = recv(ws, 5)
        assert back["type"] == "response.steer.failed", back
        assert back["error"]["code"] == "successor_creation_failed"
        acc = next(e for e in events if e["type"] == "response.steer.accepted")
        assert back["steer"] == {"id": acc["steer"]["id"], "input": "and Rome", "previous_response_id": rid}
        # the corrected continuation commits only its own input
        [call] = [it for e in events if e["type"] == "response.completed" for it in e["response"]["output"]]
        out = [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
        ws.send(create(previous_response_id=rid, input=out, tools=TOOLS, store=True, metadata={"sim": "text,tokens:3"}))
        cont = until(ws, lambda e: e["type"] in TERMINAL)
        assert cont[-1]["type"] == "response.completed"
    listed = httpx.get(f"{paced.v1}/responses/{cont[0]['response']['id']}/input_items", params={"order": "asc"}).json()
    texts = [c.get("text") for it in listed["data"] if it["type"] == "message" for c in it["content"]]
    assert "and Rome" not in texts


def test_a_steer_after_the_connections_age_limit_is_refused_not_ignored(tmp_path: Any) -> None:
    """Past its age limit a connection runs its responses to their end, then says why and closes.
    A steer naming the response still running got no reply at all (neither accepted nor failed);
    it is refused with ``response_not_active`` at once, and the response runs to its end."""
    env = {"HOTLOOP_WS_CONNECTION_MAX_AGE": "1"}
    with run_server(tmp_path, "--sim-rate", "40", "--store", "memory", env=env) as srv:
        with ws_connect(srv.ws + "/responses") as ws:
            ws.send(create(input="write", stream_id="s", metadata={"sim": "text,tokens:120"}))  # ~3 s
            rid = recv(ws)["response"]["id"]
            time.sleep(1.5)  # past the age limit: the response goes on
            ws.send(steer(rid, "late"))
            got = until(ws, lambda e: e["type"].startswith("response.steer.") or e["type"] in TERMINAL, timeout=3)
            failed = got[-1]
            assert failed["type"] == "response.steer.failed", failed["type"]
            assert failed["error"]["code"] == "response_not_active" and failed["stream_id"] == "s"
            assert failed["steer"] == {"input": "late", "previous_response_id": rid}
            rest = until(ws, lambda e: e["type"] in TERMINAL, timeout=20)
            assert rest[-1]["type"] == "response.completed" and rest[-1]["response"]["id"] == rid
            assert recv(ws, 5)["error"]["code"] == "websocket_connection_limit_reached"


def test_a_steer_holding_a_secret_under_block_is_refused_before_it_cuts_the_response(tmp_path: Any) -> None:
    """``--secrets block``: steering input is checked as the successor's input would be before
    the steer is accepted. A steer holding a credential was accepted, cut the running response
    short, and then its successor was refused (secret_detected): the generation lost for
    nothing. Now the steer itself is refused, and the response runs on."""
    token = "gh" + "p_" + "aB3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5"
    with run_server(tmp_path, "--sim-rate", "200", "--store", "memory", "--secrets", "block") as s:
        with ws_connect(s.ws + "/responses", open_timeout=10) as ws:
            ws.send(create(metadata={"sim": "tokens:60"}))
            rid = until(ws, lambda e: e["type"] == "response.created")[-1]["response"]["id"]
            until(ws, lambda e: e["type"].endswith(".delta"))
            ws.send(steer(rid, "use this token " + token))
            events = until(ws, lambda e: e["type"] in ("response.completed", "response.incomplete", "response.failed"))
            failed = [e for e in events if e["type"] == "response.steer.failed"]
            assert len(failed) == 1 and failed[0]["error"]["code"] == "secret_detected", events
            assert token not in json.dumps(failed[0]["error"])
            assert events[-1]["type"] == "response.completed"  # not cut short
            assert not any(e["type"] == "response.steer.accepted" for e in events)
