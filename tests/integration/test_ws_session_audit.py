"""WebSocket mode audit: the connection age limit reached while responses run, and warm-ups.

Past ``ws_connection_max_age`` a connection takes no new response, but every ``response.create``
gets an answer on its own lane (``websocket_connection_limit_reached``, status 400): one that
arrives later at once (after its lane's running response, if its lane has one), one that was
waiting when the limit came, once its lane's running response is over; errors already waiting
behind a lane are still sent. Responses already running finish normally. When the last one is
done, the connection says why it closes (an error frame without ``stream_id``) and closes (1001).
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import pytest
from openai import OpenAI
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, run_server

MAX_AGE = 1.0
SLOW = {"sim": "text,tokens:60,rate:20"}  # about 3 s of streaming: still running past the limit
LIMIT = "websocket_connection_limit_reached"
TERMINAL = ("response.completed", "response.failed", "response.incomplete")


@pytest.fixture(scope="module")
def aged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(
        tmp_path_factory.mktemp("aged"), "--sim-rate", "0", env={"HOTLOOP_WS_CONNECTION_MAX_AGE": str(MAX_AGE)}
    ) as s:
        yield s


def create(**kw: Any) -> str:
    return json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi", "store": False, **kw})


def drain(ws: Any, timeout: float = 20) -> tuple[list[dict[str, Any]], int | None]:
    """Every frame until the server closes, and the close code."""
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the server did not close the connection; got {[e['type'] for e in out]}"
        try:
            out.append(json.loads(ws.recv(timeout=left)))
        except ConnectionClosed:
            return out, ws.close_code
        except TimeoutError:
            raise AssertionError(f"the server did not close the connection; got {[e['type'] for e in out]}")


def lane(frames: list[dict[str, Any]], stream_id: str | None) -> list[dict[str, Any]]:
    return [e for e in frames if e.get("stream_id") == stream_id]


def assert_finished_normally(events: list[dict[str, Any]]) -> str:
    """One whole response: numbered from 0, created first, completed last."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["status"] == "completed"
    assert events[-1]["response"]["output"], "the running response was cut short"
    return str(events[-1]["response"]["id"])


def is_limit(e: dict[str, Any], stream_id: str | None) -> bool:
    return (
        e["type"] == "error"
        and e.get("status") == 400
        and e["error"]["code"] == LIMIT
        and e["error"]["type"] == "invalid_request_error"
        and e.get("stream_id") == stream_id
        and "sequence_number" not in e
    )


def test_create_after_the_limit_on_an_idle_lane_is_answered_at_once(aged: Server) -> None:
    """Lane "b" is idle when its create arrives past the limit: its error comes at once, while
    the default lane's response still streams; that response then completes normally."""
    with ws_connect(aged.ws + "/responses", open_timeout=10) as ws:
        ws.send(create(metadata=SLOW))
        first = json.loads(ws.recv(timeout=10))
        assert first["type"] == "response.created"
        time.sleep(MAX_AGE + 0.3)  # past the limit; the response runs for ~3 s
        ws.send(create(stream_id="b"))
        frames, code = drain(ws)
    frames = [first, *frames]
    b = lane(frames, "b")
    assert len(b) == 1 and is_limit(b[0], "b"), b
    at = frames.index(b[0])
    main = [e for e in frames if "sequence_number" in e]
    done_at = frames.index(main[-1])
    assert at < done_at, "lane b's create was not answered until the running response ended"
    assert_finished_normally(main)
    # the connection says why it closes, last, then closes with 1001
    assert is_limit(frames[-1], None) and code == 1001


def test_create_after_the_limit_on_the_busy_lane_is_answered_after_its_response(aged: Server) -> None:
    """Same lane: the answer waits behind the running response (never inside its events), and
    comes before the close."""
    with ws_connect(aged.ws + "/responses", open_timeout=10) as ws:
        ws.send(create(metadata=SLOW, stream_id="a"))
        assert json.loads(ws.recv(timeout=10))["type"] == "response.created"
        time.sleep(MAX_AGE + 0.3)
        ws.send(create(stream_id="a", input="late"))
        frames, code = drain(ws)
    a = lane(frames, "a")
    main = [e for e in a if "sequence_number" in e]
    assert main[-1]["type"] == "response.completed"
    after = a[len(main):]
    assert len(after) == 1 and is_limit(after[0], "a"), after
    assert is_limit(frames[-1], None) and code == 1001


def test_creates_and_errors_queued_at_the_limit_are_answered_on_their_lanes(aged: Server) -> None:
    """At the limit the default lane has a response running with a create and a malformed
    frame behind it, lane "x" a response running with a create behind it: each waiting create
    gets the limit error on its lane after its lane's response, the malformed frame its own
    error, in order; the running responses complete normally."""
    with ws_connect(aged.ws + "/responses", open_timeout=10) as ws:
        ws.send(create(metadata=SLOW))
        ws.send(create(input="queued"))
        ws.send("not json")
        ws.send(create(metadata=SLOW, stream_id="x"))
        ws.send(create(input="queued x", stream_id="x"))
        frames, code = drain(ws)
    assert code == 1001
    d = lane(frames, None)
    main = [e for e in d if "sequence_number" in e]
    assert_finished_normally(main)
    tail = d[len(main):]
    assert len(tail) == 3, [e.get("error") for e in tail]
    assert is_limit(tail[0], None)  # the queued create
    assert tail[1]["type"] == "error" and tail[1]["status"] == 400 and tail[1]["error"]["code"] != LIMIT  # the bad frame
    assert is_limit(tail[2], None) and tail[2] is frames[-1]  # why the connection closes
    x = lane(frames, "x")
    xmain = [e for e in x if "sequence_number" in e]
    assert_finished_normally(xmain)
    assert len(x) == len(xmain) + 1 and is_limit(x[-1], "x")


def test_openai_python_clients_hear_about_the_limit_on_their_lane(aged: Server) -> None:
    """openai-python's ``client.responses.connect()``: one response running on lane "main",
    a create on lane "side" after the limit: the side lane's error arrives before the main
    response completes, parsed as a ``ResponseWsError`` with its ``stream_id``; a later create
    on the main lane gets the same answer once its response is done."""
    client = OpenAI(api_key="k", base_url=aged.v1, max_retries=0)
    with client.responses.connect() as conn:
        conn.response.create(model="hotloop-sim", input="long", store=False, metadata=SLOW, stream_id="main")
        seen: list[Any] = []
        for e in conn:
            seen.append(e)
            if e.type == "response.created":
                break
        time.sleep(MAX_AGE + 0.3)
        conn.response.create(model="hotloop-sim", input="side", store=False, stream_id="side")
        conn.response.create(model="hotloop-sim", input="next", store=False, stream_id="main")
        order: list[tuple[str, str | None, str | None]] = []
        try:
            for e in conn:
                seen.append(e)
                code = e.error.code if e.type == "error" else None
                order.append((e.type, getattr(e, "stream_id", None), code))
                if e.type == "error" and e.stream_id is None:
                    break  # why the connection closes
        except ConnectionClosed:
            pass
    side = [o for o in order if o[1] == "side"]
    assert side == [("error", "side", LIMIT)]
    completed = order.index(("response.completed", "main", None))
    assert order.index(side[0]) < completed
    assert order[completed + 1] == ("error", "main", LIMIT)
    assert order[-1] == ("error", None, LIMIT)
    done = [e for e in seen if e.type == "response.completed"]
    assert len(done) == 1 and done[0].response.status == "completed" and done[0].response.output_text


def test_openai_python_default_lane_after_the_limit(aged: Server) -> None:
    """The default lane alone (Codex-like): the response running at the limit completes, the
    create sent after the limit is answered with the limit error, then the server closes."""
    client = OpenAI(api_key="k", base_url=aged.v1, max_retries=0)
    with client.responses.connect() as conn:
        conn.response.create(model="hotloop-sim", input="long", store=False, metadata=SLOW)
        time.sleep(MAX_AGE + 0.3)
        conn.response.create(model="hotloop-sim", input="next", store=False)
        events: list[Any] = []
        try:
            for e in conn:
                events.append(e)
        except ConnectionClosed:
            pass
    types = [e.type for e in events]
    done = types.index("response.completed")
    assert events[done].response.status == "completed" and events[done].response.output_text
    errs = events[done + 1:]
    assert errs and all(e.type == "error" and e.error.code == LIMIT and e.status == 400 for e in errs)


def test_warmup_without_input(server: Server) -> None:
    """``generate: false`` with only instructions and tools (no ``input``): a completed warm-up
    with empty output, and the next turn chains from it."""
    tools = [{"type": "function", "name": "lookup", "description": "d", "parameters": {"type": "object", "properties": {}}}]
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "instructions": "Be brief.", "tools": tools,
                            "generate": False, "store": False}))
        evs = []
        while True:
            e = json.loads(ws.recv(timeout=30))
            evs.append(e)
            if e["type"] in (*TERMINAL, "error"):
                break
        assert evs[-1]["type"] == "response.completed", evs[-1]
        warm = evs[-1]["response"]
        assert warm["status"] == "completed" and warm["output"] == [] and warm["usage"]["output_tokens"] == 0
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "instructions": "Be brief.", "tools": tools,
                            "tool_choice": "none", "input": "hello", "previous_response_id": warm["id"], "store": False}))
        evs = []
        while True:
            e = json.loads(ws.recv(timeout=30))
            evs.append(e)
            if e["type"] in (*TERMINAL, "error"):
                break
        assert evs[-1]["type"] == "response.completed", evs[-1]
        assert evs[-1]["response"]["previous_response_id"] == warm["id"]
