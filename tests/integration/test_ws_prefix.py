"""Prefix reuse within a WebSocket connection: a client that resends the whole history in every
``response.create`` (no ``previous_response_id``) gets its prefix matched by raw bytes, as an HTTP
body is, with the token counts, usage and errors of a computation from scratch."""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect as ws_connect

from hotloop.protocol.session import FAST_DECODE_BYTES
from tests.conftest import Server, run_server

SIM = ("--sim-rate", "0", "--store", "memory")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    tmp = tmp_path_factory.mktemp("wsprefix")
    with run_server(tmp, *SIM) as s, run_server(tmp, *SIM, env={"HOTLOOP_PREFIX_CACHE_ENTRIES": "0"}) as ref:
        yield s, ref


def _turn(ws: Any, body: dict[str, Any]) -> dict[str, Any]:
    ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "metadata": {"sim": "tokens:3"}, **body}))
    while True:
        frame = json.loads(ws.recv(timeout=20))
        if frame["type"] in ("response.completed", "response.failed", "error"):
            return frame  # type: ignore[no-any-return]


def _prefix_stats(s: Server) -> dict[str, int]:
    return httpx.get(s.base + "/hotloop/stats", timeout=5).json()["prefix_cache"]  # type: ignore[no-any-return]


def _cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["input_tokens_details"]["cached_tokens"])


def test_full_history_frames_reuse_the_prefix_by_bytes(servers: tuple[Server, Server]) -> None:
    s, ref = servers
    before = _prefix_stats(s)
    history: list[dict[str, Any]] = []
    with ws_connect(s.ws + "/responses", open_timeout=10) as ws, ws_connect(ref.ws + "/responses", open_timeout=10) as rws:
        reused = 0
        for i in range(5):
            history.append({"role": "user", "content": f"turn {i} " + "tool output line\n" * 1000})
            frame = _turn(ws, {"input": history, "store": False})
            scratch = _turn(rws, {"input": history, "store": False})
            assert frame["type"] == scratch["type"] == "response.completed", (frame, scratch)
            resp, sresp = frame["response"], scratch["response"]
            assert resp["usage"]["input_tokens"] == sresp["usage"]["input_tokens"]
            assert _cached(sresp) == 0
            # the previous turn's whole input and the output it sent back
            assert _cached(resp) == reused
            assert (i == 0) == (reused == 0)
            history += resp["output"]
            r = httpx.post(ref.v1 + "/responses/input_tokens", json={"model": "hotloop-sim", "input": history}, timeout=10)
            reused = int(r.json()["input_tokens"])
    assert len(json.dumps(history)) > FAST_DECODE_BYTES
    after = _prefix_stats(s)
    assert after["body_hits"] - before["body_hits"] == 4  # every turn after the first, by its bytes


def test_an_error_after_a_reused_prefix_names_its_place_in_the_whole_input(servers: tuple[Server, Server]) -> None:
    s, ref = servers
    errors = []
    for server in (s, ref):
        with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
            history: list[dict[str, Any]] = [{"role": "user", "content": "start " + "x" * 20_000}]
            first = _turn(ws, {"input": history, "store": False})
            assert first["type"] == "response.completed"
            history += first["response"]["output"]
            history.append({"role": "user", "content": [{"type": "input_text"}]})  # no text
            errors.append(_turn(ws, {"input": history, "store": False}))
            # the connection is still usable afterwards
            assert _turn(ws, {"input": "hi", "store": False})["type"] == "response.completed"
    got, want = errors
    assert got["type"] == want["type"] == "error"
    assert got["error"] == want["error"], (got, want)
    assert got["error"]["param"].startswith(f"input[{len(history) - 1}]")


def test_frames_that_are_not_plain_creates_keep_their_errors(servers: tuple[Server, Server]) -> None:
    s, ref = servers
    big = "y" * (FAST_DECODE_BYTES + 10)
    frames = [
        {"type": "response.create", "model": "hotloop-sim", "input": [{"role": "user", "content": big}], "store": "no"},
        {"type": "response.append", "input": big},
        {"type": "response.create", "model": "hotloop-sim", "input": 7, "instructions": big},
    ]
    for frame in frames:
        answers = []
        for server in (s, ref):
            with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
                ws.send(json.dumps(frame))
                answers.append(json.loads(ws.recv(timeout=20)))
        assert answers[0]["type"] == "error" and answers[0]["error"] == answers[1]["error"], answers


def test_store_true_full_history_is_readable(servers: tuple[Server, Server]) -> None:
    s, _ = servers
    with ws_connect(s.ws + "/responses", open_timeout=10) as ws:
        history: list[dict[str, Any]] = [{"role": "user", "content": "a" * 20_000}]
        first = _turn(ws, {"input": history})["response"]
        history += first["output"] + [{"role": "user", "content": "b" * 100}]
        second = _turn(ws, {"input": history})["response"]
        whole = httpx.post(s.v1 + "/responses/input_tokens", json={"model": "hotloop-sim", "input": history[:-1]}, timeout=10)
        assert _cached(second) == whole.json()["input_tokens"] > first["usage"]["input_tokens"]  # input and output
    items = httpx.get(f"{s.v1}/responses/{second['id']}/input_items", params={"limit": 100, "order": "asc"}, timeout=5).json()
    assert [it.get("role") for it in items["data"]] == [it.get("role") for it in history]
    last = items["data"][-1]["content"]
    assert (last if isinstance(last, str) else last[0]["text"]) == "b" * 100


def _agent_tools() -> list[dict[str, Any]]:
    # ten tools of about 1.8 KB each: a frame that carries them is past FAST_DECODE_BYTES
    return [
        {
            "type": "function",
            "name": f"tool_{i}",
            "description": f"Tool {i}. " + "Reads, edits or runs what the agent asks for, then reports. " * 28,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
            "strict": False,
        }
        for i in range(10)
    ]


def _tools_stats(s: Server) -> dict[str, int]:
    return httpx.get(s.base + "/hotloop/stats", timeout=5).json()["tools_cache"]  # type: ignore[no-any-return]


def test_an_agents_tools_are_decoded_once_and_echoed_exactly(servers: tuple[Server, Server]) -> None:
    # The same tools with every turn, chained over a WebSocket and resent over HTTP: the server
    # with the caches decodes them once per key, and answers exactly as one that decodes them
    # every time (the echoed tools, the counted tokens).
    s, ref = servers
    tools = _agent_tools()
    assert len(json.dumps({"tools": tools})) > FAST_DECODE_BYTES
    before, ref_before = _tools_stats(s), _tools_stats(ref)
    settings = {"tools": tools, "tool_choice": "none", "instructions": "Work in small steps.", "store": False}
    with ws_connect(s.ws + "/responses", open_timeout=10) as ws, ws_connect(ref.ws + "/responses", open_timeout=10) as rws:
        prev: dict[str, str] = {}
        rprev: dict[str, str] = {}
        for i in range(3):
            new = {"input": [{"role": "user", "content": f"step {i}"}], **settings}
            frame = _turn(ws, {**new, **prev})
            scratch = _turn(rws, {**new, **rprev})
            assert frame["type"] == scratch["type"] == "response.completed", (frame, scratch)
            resp, sresp = frame["response"], scratch["response"]
            assert resp["tools"] == sresp["tools"] == tools
            if i == 0:  # the same input (later ones chain each server's own answers)
                assert resp["usage"]["input_tokens"] == sresp["usage"]["input_tokens"]
            assert (_cached(resp) > 0) == (_cached(sresp) > 0) == (i > 0)
            prev, rprev = {"previous_response_id": resp["id"]}, {"previous_response_id": sresp["id"]}
    history: list[dict[str, Any]] = []  # the same history to both: the same counts
    for i in range(2):
        history.append({"role": "user", "content": f"http step {i}"})
        got = [httpx.post(x.v1 + "/responses", json={"model": "hotloop-sim", "input": history, **settings}, timeout=20) for x in (s, ref)]
        assert got[0].status_code == got[1].status_code == 200, [g.text for g in got]
        a, b = got[0].json(), got[1].json()
        assert a["tools"] == b["tools"] == tools and a["usage"]["input_tokens"] == b["usage"]["input_tokens"]
        history += a["output"]
    after, ref_after = _tools_stats(s), _tools_stats(ref)
    # decoded once per spelling: the WebSocket frames (json.dumps) and httpx's compact JSON
    # differ in their bytes, and the bytes are the key
    assert after["misses"] - before["misses"] == 2
    assert after["hits"] - before["hits"] == 3  # the other three turns found them
    assert after["entries"] >= 1
    assert ref_after == ref_before  # no prefix cache there: decoded every time, nothing kept


@pytest.mark.parametrize("kind", ["eight tools", "one small tool"])
def test_smaller_frames_take_their_tools_from_the_cache_too(servers: tuple[Server, Server], kind: str) -> None:
    # Frames under FAST_DECODE_BYTES (eight tools of about 600 bytes, in frames of OFFERED_BYTES
    # or more; or one tool of 221 bytes, in frames under 1 KB): decoded with the tools from the
    # cache, answered as by a server that decodes them every time.
    from hotloop.bench.turns import TOOL

    s, ref = servers
    if kind == "eight tools":
        tools = [{**t, "name": f"small_{i}", "description": t["description"][:500]} for i, t in enumerate(_agent_tools()[:8])]
    else:
        tools = [TOOL]
        assert len(json.dumps({"type": "response.create", "input": "small step 0", "tools": tools, "previous_response_id": "resp_" + "0" * 32})) < 1024
    before, ref_before = _tools_stats(s), _tools_stats(ref)
    settings = {"tools": tools, "tool_choice": "auto", "store": False}
    with ws_connect(s.ws + "/responses", open_timeout=10) as ws, ws_connect(ref.ws + "/responses", open_timeout=10) as rws:
        prev: dict[str, str] = {}
        rprev: dict[str, str] = {}
        for i in range(3):
            new = {"input": [{"role": "user", "content": f"small step {i}"}], **settings}
            assert len(json.dumps({"type": "response.create", **new, **prev})) < FAST_DECODE_BYTES
            frame = _turn(ws, {**new, **prev})
            scratch = _turn(rws, {**new, **rprev})
            assert frame["type"] == scratch["type"] == "response.completed", (frame, scratch)
            resp, sresp = frame["response"], scratch["response"]
            assert resp["tools"] == sresp["tools"] == tools
            if i == 0:
                assert resp["usage"]["input_tokens"] == sresp["usage"]["input_tokens"]
            prev, rprev = {"previous_response_id": resp["id"]}, {"previous_response_id": sresp["id"]}
        # a bad tool in a small frame: the ordinary error, on both
        bad = {"input": "x", "tools": tools + [tools[0]]}
        err, rerr = _turn(ws, bad), _turn(rws, bad)
        assert err["type"] == rerr["type"] == "error" and err["error"] == rerr["error"], (err, rerr)
    after, ref_after = _tools_stats(s), _tools_stats(ref)
    # one miss for the tools, two hits; the bad array is looked up and never kept: once in a
    # small frame (its tools converted by their JSON), twice in a larger one (by its bytes, then
    # by their JSON after the ordinary decode)
    bad_lookups = 2 if kind == "eight tools" else 1
    assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (1 + bad_lookups, 2)
    assert after["entries"] - before["entries"] <= 1 and ref_after == ref_before


# -- hypothesis: over WebSocket, the incremental paths equal a computation from scratch ---------

_TEXT = st.text(alphabet="abc xyz=:\n_-é", min_size=1, max_size=60)


@st.composite
def _conversations(draw: Any) -> list[tuple[list[str], str, int]]:
    """Turns: each one's new user texts, how it is sent (``full``: the whole history, no
    ``previous_response_id``; ``chain``: the latest response; ``fork``: an earlier one, the
    number picks which) and that number."""
    turns = []
    for _ in range(draw(st.integers(2, 7))):
        texts = draw(st.lists(_TEXT, min_size=1, max_size=3))
        turns.append((texts, draw(st.sampled_from(["full", "chain", "fork"])), draw(st.integers(0, 99))))
    return turns


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_conversations())
def test_ws_incremental_paths_equal_a_computation_from_scratch(servers: tuple[Server, Server], case: Any) -> None:
    """On one socket, in any mix: a whole history matched by its prefix, a continuation of the
    latest response (the connection's cache) and a fork off an earlier one (the store): each
    turn's ``input_tokens`` is that of its whole history counted from scratch (on a server
    without a prefix cache), and its ``cached_tokens`` that of the history it continues, which
    the turn sent before it and its output (0 for the first)."""
    s, ref = servers

    def scratch(history: list[dict[str, Any]]) -> int:
        r = httpx.post(ref.v1 + "/responses/input_tokens", json={"model": "hotloop-sim", "input": history}, timeout=20)
        assert r.status_code == 200, r.text
        return int(r.json()["input_tokens"])

    history: list[dict[str, Any]] = []
    earlier: list[tuple[str, list[dict[str, Any]]]] = []  # each response: its id, its history with its output
    # a conversation of its own: the server's prefix cache keeps every example's (one key)
    first = [{"role": "user", "content": f"conversation {uuid.uuid4().hex}"}]
    with ws_connect(s.ws + "/responses", open_timeout=10) as ws:
        for texts, mode, pick in case:
            new, first = first + [{"role": "user", "content": t} for t in texts], []
            body: dict[str, Any] = {"store": True}
            if mode != "full" and earlier:
                rid, history = earlier[-1] if mode == "chain" else earlier[pick % len(earlier)]
                history = list(history)
                body.update(previous_response_id=rid, input=new)
            else:
                body["input"] = history + new
            before = scratch(history) if history else 0
            history += new
            frame = _turn(ws, body)
            assert frame["type"] == "response.completed", frame
            resp = frame["response"]
            assert resp["usage"]["input_tokens"] == scratch(history)
            assert _cached(resp) == before
            history += resp["output"]
            earlier.append((resp["id"], list(history)))
