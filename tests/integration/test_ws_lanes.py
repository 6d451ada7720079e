"""Concurrent WebSocket lanes and ``response.steer`` against a real ``hotloop serve``.

The simulator is paced (``--sim-rate``) so overlap is visible; timing asserts are generous
(interleaving is asserted by event order, wall time only against a loose fraction of the sum).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from openai import OpenAI
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, run_server

TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")
RATE = 200  # tokens/s: a 60-token answer takes ~0.3 s


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(tmp_path_factory.mktemp("lanes"), "--sim-rate", str(RATE), "--store", "memory") as s:
        yield s


def create(model: str = "hotloop-sim", **kw: Any) -> str:
    kw.setdefault("input", "hi")
    kw.setdefault("store", False)
    return json.dumps({"type": "response.create", "model": model, **kw})


def recv(ws: Any, timeout: float = 30) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=timeout))


def collect(ws: Any, terminals: int, timeout: float = 60) -> list[dict[str, Any]]:
    """Events until ``terminals`` terminal events arrived."""
    out: list[dict[str, Any]] = []
    seen = 0
    deadline = time.monotonic() + timeout
    while seen < terminals:
        e = recv(ws, max(0.1, deadline - time.monotonic()))
        out.append(e)
        if e["type"] in TERMINAL:
            seen += 1
    return out


def lane_of(events: list[dict[str, Any]], lane: str | None) -> list[dict[str, Any]]:
    return [e for e in events if e.get("stream_id") == lane]


def assert_well_formed(events: list[dict[str, Any]]) -> None:
    """Per response: sequence numbers 0.. without gaps; the terminal event last."""
    by_resp: dict[str, list[int]] = {}
    current: dict[str | None, str] = {}
    for e in events:
        lane = e.get("stream_id")
        if e["type"] == "response.created":
            current[lane] = e["response"]["id"]
        if "sequence_number" in e and lane in current:
            by_resp.setdefault(current[lane], []).append(e["sequence_number"])
    for rid, seqs in by_resp.items():
        assert seqs == list(range(len(seqs))), (rid, seqs)


# -- lanes -----------------------------------------------------------------------------------


def test_two_lanes_stream_at_once_and_interleave(paced: Server) -> None:
    with ws_connect(paced.ws + "/responses") as ws:
        # each alone: the sum of the two is the sequential time
        t0 = time.monotonic()
        ws.send(create(metadata={"sim": "text,tokens:60"}, stream_id="a"))
        collect(ws, 1)
        ws.send(create(metadata={"sim": "text,tokens:80"}, stream_id="b"))
        collect(ws, 1)
        sequential = time.monotonic() - t0

        t0 = time.monotonic()
        ws.send(create(metadata={"sim": "text,tokens:60"}, stream_id="a"))
        ws.send(create(metadata={"sim": "text,tokens:80"}, stream_id="b"))
        events = collect(ws, 2)
        both = time.monotonic() - t0
    a, b = lane_of(events, "a"), lane_of(events, "b")
    assert a[-1]["type"] == b[-1]["type"] == "response.completed"
    assert len(a) + len(b) == len(events)  # every event names its lane
    # interleaved: lane b's deltas began before lane a finished
    first_b_delta = next(i for i, e in enumerate(events) if e.get("stream_id") == "b" and e["type"].endswith(".delta"))
    a_done = next(i for i, e in enumerate(events) if e.get("stream_id") == "a" and e["type"] == "response.completed")
    assert first_b_delta < a_done
    assert_well_formed(events)
    assert both < 0.75 * sequential, (both, sequential)


def test_same_lane_is_fifo_and_default_lane_has_no_stream_id(paced: Server) -> None:
    with ws_connect(paced.ws + "/responses") as ws:
        ws.send(create(metadata={"sim": "text,tokens:20"}))
        ws.send(create(metadata={"sim": "text,tokens:5"}))
        ws.send(create(metadata={"sim": "text,tokens:5"}, stream_id="x"))
        events = collect(ws, 3)
    default = lane_of(events, None)
    assert all("stream_id" not in e for e in default)
    kinds = [e["type"] for e in default]
    # one response after the other on the default lane, never overlapping
    assert kinds.count("response.created") == 2
    assert kinds.index("response.completed") < len(kinds) - 1 - kinds[::-1].index("response.created")
    assert lane_of(events, "x")[-1]["type"] == "response.completed"


def test_sixteen_in_flight_and_more_queued(paced: Server) -> None:
    n = 20
    with ws_connect(paced.ws + "/responses") as ws:
        t0 = time.monotonic()
        for i in range(n):
            ws.send(create(metadata={"sim": "text,tokens:40"}, stream_id=f"agent_{i}"))
        events = collect(ws, n, timeout=120)
        elapsed = time.monotonic() - t0
    created_order = [e["stream_id"] for e in events if e["type"] == "response.created"]
    completed = [e for e in events if e["type"] == "response.completed"]
    assert len(completed) == n and not [e for e in events if e["type"] == "error"]
    # at most 16 running at once: the 17th starts only after a first one completed
    running = peak = 0
    for e in events:
        if e["type"] == "response.created":
            running += 1
            peak = max(peak, running)
        elif e["type"] in TERMINAL:
            running -= 1
    assert peak == 16, peak
    assert len(set(created_order)) == n
    # 20 responses of 0.2 s in two waves, not twenty in a row
    assert elapsed < 0.75 * n * 40 / RATE, elapsed
    assert_well_formed(events)


def test_fork_from_another_lane_and_failed_fork_keeps_the_parent(paced: Server) -> None:
    with ws_connect(paced.ws + "/responses") as ws:
        ws.send(create(input="base", metadata={"sim": "text,tokens:5"}, stream_id="main"))
        [*_, done] = collect(ws, 1)
        parent = done["response"]["id"]
        # a fork on a new lane starts from main's latest response
        ws.send(create(input="fork", previous_response_id=parent, metadata={"sim": "text,tokens:5"}, stream_id="side"))
        [*_, fork] = collect(ws, 1)
        assert fork["type"] == "response.completed" and fork["stream_id"] == "side"
        assert fork["response"]["previous_response_id"] == parent
        # a failing fork (bad simulator directive) does not evict main's latest response
        ws.send(create(input="bad", previous_response_id=parent, metadata={"sim": "nonsense"}, stream_id="third"))
        [err] = collect(ws, 1)
        assert err["type"] == "error" and err["stream_id"] == "third"
        ws.send(create(input="again", previous_response_id=parent, metadata={"sim": "text,tokens:3"}, stream_id="main"))
        [*_, again] = collect(ws, 1)
        assert again["type"] == "response.completed"
        # main's latest is now `again`; side keeps its own latest (the fork)
        ws.send(create(input="side 2", previous_response_id=fork["response"]["id"], metadata={"sim": "text,tokens:3"}, stream_id="side"))
        assert collect(ws, 1)[-1]["type"] == "response.completed"
        # a same-lane failure evicts as before
        main_latest = again["response"]["id"]
        ws.send(create(input="bad", previous_response_id=main_latest, metadata={"sim": "nonsense"}, stream_id="main"))
        assert collect(ws, 1)[-1]["type"] == "error"
        ws.send(create(input="x", previous_response_id=main_latest, stream_id="main"))
        [gone] = collect(ws, 1)
        assert gone["error"]["code"] == "previous_response_not_found"


def test_a_fork_off_a_response_still_running_on_another_lane_says_so(paced: Server) -> None:
    """Another lane naming a response that has not ended: its output is not known, so the fork is
    refused with a message that says why (the code clients handle for a parent they cannot
    continue); the running response is not disturbed, and once it has completed the same fork
    works."""
    with ws_connect(paced.ws + "/responses") as ws:
        ws.send(create(input="base", metadata={"sim": "text,tokens:60"}, stream_id="main"))
        created = recv(ws)
        assert created["type"] == "response.created"
        parent = created["response"]["id"]
        ws.send(create(input="fork", previous_response_id=parent, stream_id="side"))
        events = collect(ws, 2)
        [err] = [e for e in events if e["type"] == "error"]
        assert err["stream_id"] == "side" and err["error"]["code"] == "previous_response_not_found"
        assert err["error"]["param"] == "previous_response_id" and "still in progress" in err["error"]["message"]
        [done] = [e for e in events if e["type"] == "response.completed"]
        assert done["response"]["id"] == parent and done["stream_id"] == "main"
        assert_well_formed([created, *events])
        ws.send(create(input="fork", previous_response_id=parent, metadata={"sim": "text,tokens:3"}, stream_id="side"))
        [*_, fork] = collect(ws, 1)
        assert fork["type"] == "response.completed" and fork["response"]["previous_response_id"] == parent, fork


def test_continuing_a_response_still_running_elsewhere_says_it_is_in_progress(paced: Server) -> None:
    """A stored response still streaming on one connection, named as the parent over HTTP or on
    another connection: the same refusal a lane of its own connection gets ("still in
    progress"), not "not found" while GET shows it ``in_progress``."""
    with ws_connect(paced.ws + "/responses") as ws, ws_connect(paced.ws + "/responses") as other:
        # 4 s at RATE: still running while the others ask on a loaded machine (60 tokens, 0.3 s,
        # had ended first under CI's load)
        ws.send(create(input="base", store=True, metadata={"sim": "text,tokens:800"}))
        parent = recv(ws)["response"]["id"]
        assert httpx.get(f"{paced.v1}/responses/{parent}", timeout=10).json()["status"] == "in_progress"
        r = httpx.post(f"{paced.v1}/responses", json={"model": "hotloop-sim", "input": "fork", "previous_response_id": parent}, timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "previous_response_not_found" and "still in progress" in err["message"], err
        other.send(create(input="fork", previous_response_id=parent))
        e = recv(other)
        assert e["type"] == "error" and "still in progress" in e["error"]["message"], e
        collect(ws, 1)


def test_closing_the_socket_cancels_every_lane(tmp_path: Path) -> None:
    with run_server(tmp_path, "--sim-rate", "50", "--store", "memory") as srv:
        with ws_connect(srv.ws + "/responses") as ws:
            for lane in ("a", "b", "c"):
                ws.send(create(metadata={"sim": "text,tokens:2000"}, stream_id=lane))
            seen: set[str] = set()
            while len(seen) < 3:
                e = recv(ws)
                if e["type"].endswith(".delta"):
                    seen.add(e["stream_id"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = httpx.get(srv.base + "/hotloop/stats").json()
            if stats.get("active_responses") == 0:
                break
            time.sleep(0.05)
        assert stats["active_responses"] == 0, stats


# -- steering --------------------------------------------------------------------------------


def test_steer_mid_text_stops_and_starts_a_successor(paced: Server) -> None:
    with ws_connect(paced.ws + "/responses") as ws:
        ws.send(create(input="write a lot", instructions="be brief", metadata={"sim": "text,tokens:400"}, stream_id="s"))
        events = []
        while True:
            e = recv(ws)
            events.append(e)
            if e["type"] == "response.output_text.delta" and len(events) > 8:
                break
        rid = events[0]["response"]["id"]
        ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "change of plan"}))
        events += collect(ws, 2)
    kinds = [e["type"] for e in events]
    acc = events[kinds.index("response.steer.accepted")]
    assert acc["steer"]["previous_response_id"] == rid and acc["steer"]["id"].startswith("steer_")
    assert acc["stream_id"] == "s"
    inc = events[kinds.index("response.incomplete")]
    assert inc["response"]["incomplete_details"] == {"reason": "steered"}
    text = inc["response"]["output"][0]["content"][0]["text"]
    assert text and inc["response"]["usage"]["output_tokens"] < 400  # what was generated so far
    assert kinds.index("response.steer.accepted") < kinds.index("response.incomplete")
    # the successor follows at once, inherits the settings and continues from the steered one
    succ = events[kinds.index("response.incomplete") + 1]
    assert succ["type"] == "response.created" and succ["stream_id"] == "s"
    assert succ["response"]["previous_response_id"] == rid
    assert succ["response"]["instructions"] == "be brief"
    assert events[-1]["type"] == "response.incomplete" or events[-1]["type"] == "response.completed"
    assert_well_formed(events)


def test_steer_during_a_tool_call_turn_waits_for_the_tool_output(paced: Server) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]
    with ws_connect(paced.ws + "/responses") as ws:
        # two calls paced at 10 tokens/s: the steering arrives once the first call was emitted
        ws.send(create(input="weather?", tools=tools, metadata={"sim": "tools:2,rate:10"}))
        first = recv(ws)
        rid = first["response"]["id"]
        second = recv(ws)
        ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "also in Paris"}]}]}))
        ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "and Rome"}))
        events = [first, second]
        while True:
            e = recv(ws)
            events.append(e)
            if e["type"] == "response.steer.pending" and sum(x["type"] == "response.steer.pending" for x in events) == 2:
                break
        kinds = [e["type"] for e in events]
        assert kinds.count("response.steer.accepted") == 2
        done = events[kinds.index("response.completed")]
        assert done["response"]["status"] == "completed"  # a tool-call turn is never cut short
        calls = [it for it in done["response"]["output"] if it["type"] == "function_call"]
        assert len(calls) == 2
        pending = [e for e in events if e["type"] == "response.steer.pending"]
        assert kinds.index("response.completed") < kinds.index("response.steer.pending")
        accepted = [e["steer"]["id"] for e in events if e["type"] == "response.steer.accepted"]
        assert [p["steer"]["id"] for p in pending] == accepted
        stubs = [{"type": "function_call_output", "call_id": c["call_id"], "name": "get_weather"} for c in calls]
        for p in pending:
            assert p["reason"] == "waiting_for_required_input" and p["required_input"] == stubs
        assert_well_formed(events)
        # nothing starts by itself: the client sends the explicit continuation (store: true so its
        # input items can be read back), and the queued input is prepended in submission order
        outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": "sunny"} for c in calls]
        ws.send(create(previous_response_id=rid, input=outputs, tools=tools, store=True, metadata={"sim": "text,tokens:3"}))
        cont = collect(ws, 1)
        assert cont[-1]["type"] == "response.completed"
        assert cont[0]["response"]["previous_response_id"] == rid
    listed = httpx.get(f"{paced.v1}/responses/{cont[0]['response']['id']}/input_items", params={"order": "asc", "limit": 100}).json()
    own = [it for it in listed["data"]][-4:]
    assert [it["type"] for it in own] == ["message", "message", "function_call_output", "function_call_output"]
    assert own[0]["content"][0]["text"] == "also in Paris"
    assert own[1]["content"][0]["text"] == "and Rome"


def test_a_steered_response_cut_by_its_token_limit_after_complete_calls_waits_for_their_outputs(paced: Server) -> None:
    """A response whose token limit ends it incomplete after it emitted complete calls owes the
    client those calls as much as a completed one: a steer waits for their outputs (pending,
    the complete calls as stubs), instead of an automatic successor the model would read with
    calls and no outputs (which strict chat servers refuse)."""
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    with ws_connect(paced.ws + "/responses") as ws:
        ws.send(create(input="weather in paris and rome?", tools=tools, max_output_tokens=16, metadata={"sim": "tools:3,rate:40"}))
        first = recv(ws)
        rid = first["response"]["id"]
        ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "Also Berlin."}))
        events = [first]
        while not any(e["type"] in ("response.steer.pending", "response.steer.failed") for e in events) and not (
            sum(e["type"] == "response.created" for e in events) > 1
        ):
            events.append(recv(ws))
        kinds = [e["type"] for e in events]
        end = events[kinds.index("response.incomplete")]["response"]
        assert end["incomplete_details"] == {"reason": "max_output_tokens"}
        complete = [it for it in end["output"] if it["type"] == "function_call" and it["status"] == "completed"]
        assert complete and len(complete) < 3, end["output"]  # cut during a later call
        assert kinds[-1] == "response.steer.pending", kinds
        assert events[-1]["required_input"] == [
            {"type": "function_call_output", "call_id": c["call_id"], "name": "get_weather"} for c in complete]
        assert kinds.count("response.created") == 1  # nothing started by itself
        assert_well_formed(events)


def test_an_error_in_a_continuation_names_the_clients_own_input(paced: Server) -> None:
    """Pending steering input goes before the continuation's own input; an error about that input
    still names its place in what the client sent, and the steering input comes back."""
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]
    with ws_connect(paced.ws + "/responses") as ws:
        ws.send(create(input="weather?", tools=tools, store=True, metadata={"sim": "tools:1,rate:10"}))
        rid = recv(ws)["response"]["id"]
        ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "and Rome"}))
        events = collect(ws, 1)
        while not any(e["type"] == "response.steer.pending" for e in events):
            events.append(recv(ws))
        [call] = [it for e in events if e["type"] == "response.completed" for it in e["response"]["output"]
                  if it["type"] == "function_call"]
        outputs = [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
                   {"type": "function_call_output", "call_id": "call_nope", "output": "x"}]
        ws.send(create(previous_response_id=rid, input=outputs, tools=tools))
        got = [recv(ws), recv(ws)]
        [err] = [e for e in got if e["type"] == "error"]
        assert err["error"]["param"] == "input[1].call_id", err
        [back] = [e for e in got if e["type"] == "response.steer.failed"]
        assert back["error"]["code"] == "successor_creation_failed"
        # the failed continuation evicted its parent from the connection; stored, it still runs
        ws.send(create(previous_response_id=rid, input=outputs[:1], tools=tools, metadata={"sim": "text,tokens:3"}))
        assert collect(ws, 1)[-1]["type"] == "response.completed"


def test_a_blocked_string_continuation_after_steering_names_input(tmp_path: Path) -> None:
    """A string input becomes a message after the pending steering input; a block of it still
    names ``input``, as it would without steering."""
    from tests.unit.test_secrets import POSITIVES

    token = next(secret for kind, _, secret, _ in POSITIVES if kind == "github_token")
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    with run_server(tmp_path, "--sim-rate", str(RATE), "--store", "memory", "--secrets", "block") as s:
        with ws_connect(s.ws + "/responses") as ws:
            ws.send(create(input="go", tools=tools, metadata={"sim": "tools:1,rate:10"}))
            rid = recv(ws)["response"]["id"]
            ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "and more"}))
            events = collect(ws, 1)
            while not any(e["type"] == "response.steer.pending" for e in events):
                events.append(recv(ws))
            ws.send(create(previous_response_id=rid, input=f"my key {token}", tools=tools))
            got = [recv(ws), recv(ws)]
        [err] = [e for e in got if e["type"] == "error"]
        assert err["error"]["code"] == "secret_detected", err
        assert err["error"]["param"] == "input"  # the client's string, after the steering input
        # a secret in the steering input itself is refused with the steer, before it cuts the
        # response (test_steer_audit): it never reaches a successor
        with ws_connect(s.ws + "/responses") as ws:
            ws.send(create(input="go", tools=tools, metadata={"sim": "tools:1,rate:10"}))
            rid = recv(ws)["response"]["id"]
            ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": f"steer key {token}"}))
            events = collect(ws, 1)
        [failed] = [e for e in events if e["type"] == "response.steer.failed"]
        assert failed["error"]["code"] == "secret_detected" and events[-1]["type"] == "response.completed"


def test_a_steer_larger_than_a_turn_may_add_leaves_the_response_running(tmp_path: Path) -> None:
    """Over --max-turn-input-bytes, a steer was accepted, cut the running response, and its
    successor failed to start: now it fails at once, and the response runs on."""
    with run_server(tmp_path, "--sim-rate", str(RATE), "--store", "memory", "--max-turn-input-bytes", "2000") as srv:
        with ws_connect(srv.ws + "/responses") as ws:
            ws.send(create(input="write", metadata={"sim": "text,tokens:30"}))
            rid = recv(ws)["response"]["id"]
            ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "x" * 5000}))
            events = collect(ws, 1)
    kinds = [e["type"] for e in events]
    [failed] = [e for e in events if e["type"] == "response.steer.failed"]
    assert failed["error"]["code"] == "input_too_large" and "response.steer.accepted" not in kinds
    assert kinds[-1] == "response.completed" and events[-1]["response"]["id"] == rid


def test_a_successor_that_cannot_start_is_told_in_the_steer_failed_not_an_error_frame(tmp_path: Path) -> None:
    """A steer whose automatic successor is refused when it starts (here: its input over the
    model's context window): the steers' ``response.steer.failed`` says why, and no bare
    ``error`` frame comes on the lane, where it read as the failure of the client's own next
    request there (queued behind it, which then runs)."""
    from tests.integration.test_context_window import MODEL, PARAGRAPH, limits_file

    with run_server(tmp_path, "--sim-rate", str(RATE), "--store", "memory", "--model-limits", str(limits_file(tmp_path))) as srv:
        with ws_connect(srv.ws + "/responses") as ws:
            ws.send(create(model=MODEL, input="write", metadata={"sim": "text,tokens:30"}, stream_id="a"))
            rid = recv(ws)["response"]["id"]
            ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": PARAGRAPH * 8}))
            ws.send(create(model=MODEL, input="next", metadata={"sim": "text,tokens:3"}, stream_id="a"))
            events = [e for e in collect(ws, 2) if not e["type"].endswith(".delta")]
            while not any(e["type"] == "response.steer.failed" for e in events):
                events.append(recv(ws))
    kinds = [e["type"] for e in events]
    assert "error" not in kinds, kinds
    assert kinds.count("response.steer.accepted") == 1
    ends = [e for e in events if e["type"] in ("response.incomplete", "response.completed")]
    assert ends[0]["response"]["id"] == rid and ends[0]["response"]["incomplete_details"] == {"reason": "steered"}
    [failed] = [e for e in events if e["type"] == "response.steer.failed"]
    assert failed["error"]["code"] == "successor_creation_failed" and failed["stream_id"] == "a"
    assert "maximum context length" in failed["error"]["message"], failed
    assert failed["steer"]["input"] == PARAGRAPH * 8  # the input it could not commit, back
    assert ends[-1]["type"] == "response.completed" and ends[-1]["response"]["id"] != rid  # the client's own runs


def test_steer_failures(paced: Server) -> None:
    with ws_connect(paced.ws + "/responses") as ws:
        ws.send(create(metadata={"sim": "text,tokens:3"}, stream_id="q"))
        [*_, done] = collect(ws, 1)
        rid = done["response"]["id"]
        steer = lambda **kw: json.dumps({"type": "response.steer", **kw})  # noqa: E731
        ws.send(steer(previous_response_id=rid, input="late"))
        e = recv(ws)
        assert e["type"] == "response.steer.failed" and e["error"]["code"] == "response_already_completed"
        assert e["steer"] == {"input": "late", "previous_response_id": rid} and e["stream_id"] == "q"
        ws.send(steer(previous_response_id="resp_nope", input="x"))
        e = recv(ws)
        assert e["error"]["code"] == "response_not_found" and "stream_id" not in e
        for bad in (
            {"previous_response_id": rid, "input": "x", "stream_id": "q"},
            {"previous_response_id": rid, "input": [{"role": "assistant", "content": "x"}]},
            {"previous_response_id": rid, "input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]},
            {"previous_response_id": rid, "input": []},
            {"previous_response_id": rid, "input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
            # a part type that is not a string, not even hashable (it once ended the connection)
            {"previous_response_id": rid, "input": [{"role": "user", "content": [{"type": []}]}]},
            {"previous_response_id": rid, "input": [{"role": "user", "content": [{"type": {"x": 1}}]}]},
            {"input": "x"},
        ):
            ws.send(steer(**bad))
            e = recv(ws)
            assert e["type"] == "response.steer.failed" and e["error"]["code"] == "invalid_input", (bad, e)
            assert e["error"]["type"] == "invalid_request_error" and "id" not in e["steer"]
        # the socket stays usable
        ws.send(create(metadata={"sim": "text,tokens:3"}))
        assert collect(ws, 1)[-1]["type"] == "response.completed"


_SLOW_STORE_WRITE = """
import asyncio, sys
import hotloop.pipeline.post as post

flush = post.Persistence.flush

async def slow_flush(self):
    await asyncio.sleep(0.4)  # the store's write (--store-sync full) takes a while
    return await flush(self)

post.Persistence.flush = slow_flush
from hotloop.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_steer_while_the_terminal_event_waits_for_the_store(tmp_path: Path) -> None:
    """With --store-sync full the terminal event waits for the store's write: a steer arriving
    then was accepted (or refused) with a number after the terminal event's, sent before it, so
    the response's numbers went backwards on the wire. The response is ending: refused, numbered 0."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    with run_server(tmp_path, "--sim-rate", "400", "--store-sync", "full", entry=("-c", _SLOW_STORE_WRITE)) as srv:
        with ws_connect(srv.ws + "/responses") as ws:
            ws.send(create(input="go", tools=tools, store=True, metadata={"sim": "tools:1"}))
            events = [recv(ws)]
            rid = events[0]["response"]["id"]
            while True:  # until the stream pauses after the call's arguments: its end waits for the store
                try:
                    events.append(json.loads(ws.recv(timeout=0.2)))
                except TimeoutError:
                    if events[-1]["type"] == "response.function_call_arguments.delta":
                        break
            ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "late"}))
            while events[-1]["type"] != "response.completed":
                events.append(recv(ws, 5))
            with pytest.raises(TimeoutError):
                ws.recv(timeout=0.3)  # nothing pending, no successor
    [failed] = [e for e in events if e["type"].startswith("response.steer.")]
    assert failed["type"] == "response.steer.failed" and failed["error"]["code"] == "response_not_active"
    assert failed["sequence_number"] == 0
    numbered = [e["sequence_number"] for e in events if not e["type"].startswith("response.steer.")]
    assert numbered == list(range(len(numbered)))


def test_too_many_pending_steers(paced: Server) -> None:
    with ws_connect(paced.ws + "/responses") as ws:
        tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
        ws.send(create(input="go", tools=tools, metadata={"sim": "tools:2,rate:5"}))
        rid = recv(ws)["response"]["id"]
        for i in range(9):
            ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": f"s{i}"}))
        events = []
        while len([e for e in events if e["type"].startswith("response.steer.")]) < 9:
            events.append(recv(ws))
        codes = [e.get("error", {}).get("code") for e in events if e["type"] == "response.steer.failed"]
        assert codes == ["too_many_pending_steers"]
        assert sum(e["type"] == "response.steer.accepted" for e in events) == 8


def test_openai_sdk_steers_through_the_connection(paced: Server) -> None:
    client = OpenAI(api_key="k", base_url=paced.v1, max_retries=0)
    with client.responses.connect() as conn:
        conn.response.create(model="hotloop-sim", input="long", store=False, metadata={"sim": "text,tokens:400"})
        rid = None
        kinds = []
        for e in conn:
            kinds.append(e.type)
            if e.type == "response.created" and rid is None:
                rid = e.response.id
            if e.type == "response.output_text.delta" and kinds.count("response.output_text.delta") == 3:
                conn.response.steer(previous_response_id=rid, input="shorter please")
            if e.type == "response.incomplete":
                assert e.response.incomplete_details.reason == "steered"
            if e.type in ("response.completed", "response.failed"):
                break
        assert "response.steer.accepted" in kinds and "response.incomplete" in kinds
        assert kinds.count("response.created") == 2


def test_openai_beta_client_two_lanes_and_a_steer(paced: Server) -> None:
    """client.beta.responses.connect(): lanes via stream_id, steering one lane while the other runs;
    the SDK parses every event (steering ones included) into its typed classes."""
    client = OpenAI(api_key="k", base_url=paced.v1, max_retries=0)
    with client.beta.responses.connect() as conn:
        conn.response.create(model="hotloop-sim", input="a", store=False, metadata={"sim": "text,tokens:300"}, stream_id="a")
        conn.response.create(model="hotloop-sim", input="b", store=False, metadata={"sim": "text,tokens:60"}, stream_id="b")
        events = []
        terminals = {"a": 0, "b": 0}
        rid_a = None
        for e in conn:
            events.append(e)
            lane = getattr(e, "stream_id", None)
            if e.type == "response.created" and lane == "a" and rid_a is None:
                rid_a = e.response.id
            if e.type == "response.output_text.delta" and lane == "a" and rid_a is not None and sum(
                getattr(x, "stream_id", None) == "a" and x.type == "response.output_text.delta" for x in events
            ) == 5:
                conn.response.steer(previous_response_id=rid_a, input="wrap up")
            if e.type in ("response.completed", "response.incomplete", "response.failed") and lane in terminals:
                terminals[lane] += 1
            if terminals["a"] == 2 and terminals["b"] == 1:
                break
    by_lane = {lane: [e.type for e in events if getattr(e, "stream_id", None) == lane] for lane in ("a", "b")}
    assert len(by_lane["a"]) + len(by_lane["b"]) == len(events)
    assert "response.steer.accepted" in by_lane["a"] and "response.incomplete" in by_lane["a"]
    assert by_lane["a"].count("response.created") == 2 and by_lane["b"][-1] == "response.completed"
    accepted = next(e for e in events if e.type == "response.steer.accepted")
    assert type(accepted).__name__.endswith("SteerAcceptedEvent") and accepted.steer.previous_response_id == rid_a
    steered = next(e for e in events if e.type == "response.incomplete")
    assert steered.response.incomplete_details.reason == "steered"


def test_an_unpaced_lane_does_not_starve_another(server: Server) -> None:
    """With the simulator unpaced (every chunk ready at once) two lanes still alternate: each
    lane's run yields to the loop between its batches.

    Lane b starts only once its frame has arrived; if the client is descheduled between its two
    sends for longer than lane a's whole stream (a loaded 2-vCPU machine), a finishes alone. So
    the property must hold in one of three attempts: a server that starves lanes fails all three.
    """
    results = []
    for _ in range(3):
        with ws_connect(server.ws + "/responses", max_size=None) as ws:
            for lane in ("a", "b"):
                ws.send(create(metadata={"sim": "text,tokens:2000"}, stream_id=lane))
            events = collect(ws, 2)
        order = [e["stream_id"] for e in events]
        switches = sum(1 for x, y in zip(order, order[1:]) if x != y)
        done = [i for i, e in enumerate(events) if e["type"] == "response.completed"]
        results.append((switches, done[0] / len(events)))
        # not one lane's 2000 deltas, then the other's; both finish near the end, together
        if switches > 500 and done[0] > len(events) * 0.8:
            return
    raise AssertionError(f"lanes did not alternate in any attempt (switches, first completion): {results}")
