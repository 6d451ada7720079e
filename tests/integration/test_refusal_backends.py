"""Refusals from a chat backend (``choices[0].delta.refusal``), end to end on real loopback sockets.

openai-python -> ``hotloop serve`` (subprocess; cerebras and openai-compat backends, lean and sdk
transports) -> :mod:`tests.mock_chat_server` streaming a refusal. The Responses API represents it
as a ``refusal`` content part of the output message, streamed with ``response.refusal.delta`` and
``response.refusal.done`` (never as ``output_text``), in SSE, WebSocket, JSON responses, stored
responses, and the history a follow-up turn renders for the backend.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.conftest import Server, run_server
from tests.integration.chat_backends import _fresh_mock, cerebras, client_for, compat, server, transport  # noqa: F401
from tests.mock_chat_server import Event, MockChatServer, Reply, Sleep, chunk, text_events, usage

TERMINAL = ("response.completed", "response.failed", "response.incomplete")
REFUSAL = "I'm sorry, but I can't help with that."
MODEL = "gpt-oss-120b"


def _split(text: str, pieces: int) -> list[str]:
    step = -(-len(text) // pieces)
    return [text[i : i + step] for i in range(0, len(text), step)]


def refusal_events(
    refusal: str = REFUSAL, *, text: str = "", after: str = "", pieces: int = 3, pace: float = 0.0
) -> list[Event]:
    """What OpenAI's chat completions stream for a refusal: a role chunk, then the refusal in
    ``delta.refusal`` pieces (``content`` null), finish ``stop``, a usage chunk. ``text``: some
    ordinary content first (the same assistant message), ``after``: content after it. ``pace``: seconds between chunks (so
    the lean transport reads them one by one and push delivery with lanes takes part)."""
    out: list[Event] = [chunk({"role": "assistant", "content": "", "refusal": None})]
    for part in _split(text, pieces) if text else []:
        out.append(chunk({"content": part}))
    for part in _split(refusal, pieces):
        out.append(chunk({"content": None, "refusal": part}))
    for part in _split(after, pieces) if after else []:
        out.append(chunk({"content": part}))
    out.append(chunk({}, "stop"))
    out.append(chunk(usage=usage(12, 9), choices=False))
    if pace:
        out = [e for ev in out for e in (Sleep(pace), ev)]
    return out


def raw_sse(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.v1 + "/responses", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    lines = raw.splitlines()
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    return events


REFUSAL_SEQUENCE = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.refusal.delta",
    "response.refusal.delta",
    "response.refusal.delta",
    "response.refusal.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def check_refusal_wire(events: list[dict[str, Any]]) -> None:
    """The exact wire shapes of a refusal-only response (openai-python's event types)."""
    assert [e["type"] for e in events] == REFUSAL_SEQUENCE
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added, part_added = events[2], events[3]
    item_id = added["item"]["id"]
    assert added["item"] == {"id": item_id, "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
    assert part_added == {
        "type": "response.content_part.added", "sequence_number": 3, "item_id": item_id, "output_index": 0,
        "content_index": 0, "part": {"type": "refusal", "refusal": ""},
    }
    deltas = events[4:7]
    for e in deltas:
        assert set(e) == {"type", "sequence_number", "item_id", "output_index", "content_index", "delta"}
        assert (e["item_id"], e["output_index"], e["content_index"]) == (item_id, 0, 0)
    assert "".join(e["delta"] for e in deltas) == REFUSAL
    done = events[7]
    assert done == {"type": "response.refusal.done", "sequence_number": 7, "item_id": item_id, "output_index": 0,
                    "content_index": 0, "refusal": REFUSAL}
    part = {"type": "refusal", "refusal": REFUSAL}
    assert events[8] == {"type": "response.content_part.done", "sequence_number": 8, "item_id": item_id,
                         "output_index": 0, "content_index": 0, "part": part}
    message = {"id": item_id, "type": "message", "status": "completed", "content": [part], "role": "assistant"}
    assert events[9]["item"] == message
    final = events[10]["response"]
    assert final["status"] == "completed" and final["output"] == [message]
    assert final["usage"]["output_tokens"] == 9


# ---------------------------------------------------------------------------------------------


def test_sse_stream_with_the_sdk_stream_helper(server: Server, mock: MockChatServer) -> None:
    mock.push(Reply.stream(refusal_events()), Reply.stream(refusal_events()))
    client = client_for(server)
    with client.responses.stream(model=MODEL, input="Tell me how to pick a lock.") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == REFUSAL_SEQUENCE
    assert "".join(e.delta for e in events if e.type == "response.refusal.delta") == REFUSAL
    (done,) = [e for e in events if e.type == "response.refusal.done"]
    assert done.refusal == REFUSAL and done.content_index == 0 and done.output_index == 0
    (part_added,) = [e for e in events if e.type == "response.content_part.added"]
    assert part_added.part.type == "refusal" and part_added.part.refusal == ""
    msg: Any = final.output[0]
    assert len(final.output) == 1
    assert msg.type == "message" and [(c.type, c.refusal) for c in msg.content] == [("refusal", REFUSAL)]
    assert final.output_text == ""  # a refusal is not output text
    # the same, byte-level: every field openai-python's event types declare
    check_refusal_wire(raw_sse(server, {"model": MODEL, "input": "Tell me how to pick a lock."}))


def test_websocket_refusal_then_a_follow_up_turn(server: Server, mock: MockChatServer) -> None:
    mock.push(Reply.stream(refusal_events()), Reply.stream(text_events("Lock picking is a hobby.")))
    client = client_for(server)
    with client.responses.connect() as conn:
        conn.response.create(model=MODEL, input="Tell me how to pick a lock.", store=False)
        events: list[Any] = []
        for e in conn:
            events.append(e)
            if e.type in TERMINAL:
                break
        check_refusal_wire([e.to_dict() for e in events])
        final = events[-1].response
        assert final.output_text == ""
        conn.response.create(model=MODEL, previous_response_id=final.id, input="Why not?", store=False)
        second: list[Any] = []
        for e in conn:
            second.append(e)
            if e.type in TERMINAL:
                break
        assert second[-1].type == "response.completed" and second[-1].response.output_text == "Lock picking is a hobby."
    messages = mock.requests[1].json["messages"]
    # the refusal goes back to the chat backend as the assistant's content text
    assert messages[-2:] == [{"role": "assistant", "content": REFUSAL}, {"role": "user", "content": "Why not?"}]


def test_json_response_stored_and_retrieved_and_followed_up(server: Server, mock: MockChatServer) -> None:
    mock.push(Reply.stream(refusal_events()), Reply.stream(text_events("Fine.")))
    client = client_for(server)
    first = client.responses.create(model=MODEL, input="Tell me how to pick a lock.", store=True)
    msg: Any = first.output[0]
    assert len(first.output) == 1
    assert msg.type == "message" and msg.status == "completed"
    assert [c.to_dict() for c in msg.content] == [{"type": "refusal", "refusal": REFUSAL}]
    assert first.output_text == ""
    got = client.responses.retrieve(first.id)
    assert [o.to_dict() for o in got.output] == [o.to_dict() for o in first.output]
    raw = httpx.get(f"{server.v1}/responses/{first.id}", timeout=10).json()
    assert raw["output"][0]["content"] == [{"type": "refusal", "refusal": REFUSAL}]
    second = client.responses.create(model=MODEL, input="Why not?", previous_response_id=first.id, store=True)
    assert second.output_text == "Fine."
    m1, m2 = mock.requests[0].json["messages"], mock.requests[1].json["messages"]
    assert m2[: len(m1)] == m1
    assert m2[len(m1) :] == [{"role": "assistant", "content": REFUSAL}, {"role": "user", "content": "Why not?"}]


def test_text_then_refusal_in_one_message_over_websocket_paced(server: Server, mock: MockChatServer) -> None:
    """Content, then a refusal, in one assistant message, one chunk per read (push delivery and
    the text lane take part on the lean transport): two content parts of one message item."""
    mock.push(Reply.stream(refusal_events(text="Well, let me see. ", pace=0.005)))
    client = client_for(server)
    with client.responses.connect() as conn:
        conn.response.create(model=MODEL, input="Tell me how to pick a lock.", store=False)
        events: list[Any] = []
        for e in conn:
            events.append(e)
            if e.type in TERMINAL:
                break
    raw = [e.to_dict() for e in events]
    assert [e["sequence_number"] for e in raw] == list(range(len(raw)))
    kinds = [e["type"] for e in raw]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3, "response.output_text.done",
        "response.content_part.done",
        "response.content_part.added", *["response.refusal.delta"] * 3, "response.refusal.done",
        "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]
    assert {e["content_index"] for e in raw if e["type"] == "response.output_text.delta"} == {0}
    assert {e["content_index"] for e in raw if e["type"] == "response.refusal.delta"} == {1}
    parts = [e["part"] for e in raw if e["type"] == "response.content_part.added"]
    assert parts == [{"type": "output_text", "annotations": [], "logprobs": [], "text": ""}, {"type": "refusal", "refusal": ""}]
    final = events[-1].response
    msg: Any = final.output[0]
    assert len(final.output) == 1
    assert [c.to_dict() for c in msg.content] == [
        {"type": "output_text", "annotations": [], "logprobs": [], "text": "Well, let me see. "},
        {"type": "refusal", "refusal": REFUSAL},
    ]
    assert final.output_text == "Well, let me see. "
    assert raw[-2]["item"] == final.output[0].to_dict()


def test_text_after_a_refusal_goes_to_a_third_part_through_the_text_lane(server: Server, mock: MockChatServer) -> None:
    """Text, refusal, text again (paced: on the lean transport the later text pieces are read by
    the native lane, which must number them with the third part's content_index)."""
    mock.push(Reply.stream(refusal_events(text="Well. ", after="Anything else?", pace=0.005)))
    events = raw_sse(server, {"model": MODEL, "input": "Tell me how to pick a lock."})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    by_part: dict[int, list[str]] = {}
    for e in events:
        if e["type"] in ("response.output_text.delta", "response.refusal.delta"):
            by_part.setdefault(e["content_index"], []).append(e["type"])
    assert by_part == {0: ["response.output_text.delta"] * 3, 1: ["response.refusal.delta"] * 3,
                       2: ["response.output_text.delta"] * 3}
    final = events[-1]["response"]
    assert final["output"][0]["content"] == [
        {"type": "output_text", "annotations": [], "logprobs": [], "text": "Well. "},
        {"type": "refusal", "refusal": REFUSAL},
        {"type": "output_text", "annotations": [], "logprobs": [], "text": "Anything else?"},
    ]
    dones = [(e["content_index"], e.get("text", e.get("refusal"))) for e in events
             if e["type"] in ("response.output_text.done", "response.refusal.done")]
    assert dones == [(0, "Well. "), (1, REFUSAL), (2, "Anything else?")]


def test_sqlite_store_keeps_the_refusal_part_across_a_restart(tmp_path: Any, mock: MockChatServer) -> None:
    """Stored in SQLite (written before the terminal event), read back by a fresh process: GET
    gives the refusal part, and a follow-up renders it from disk as the assistant's content."""
    env = {"HOTLOOP_BACKEND_API_KEY": "compat-key", "HOTLOOP_BACKEND_RETRIES": "0", "HOTLOOP_DATA_DIR": str(tmp_path / "data")}
    args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model", "--store", "sqlite",
            "--store-sync", "full")
    mock.push(Reply.stream(refusal_events()), Reply.stream(text_events("Fine.")))
    with run_server(tmp_path, *args, env=env) as s:
        first = client_for(s).responses.create(model=MODEL, input="Tell me how to pick a lock.", store=True)
    with run_server(tmp_path, *args, env=env) as s:
        client = client_for(s)
        got = client.responses.retrieve(first.id)
        assert [o.to_dict() for o in got.output] == [o.to_dict() for o in first.output]
        stored: Any = got.to_dict()
        assert stored["output"][0]["content"] == [{"type": "refusal", "refusal": REFUSAL}]
        assert got.output_text == ""
        second = client.responses.create(model=MODEL, input="Why not?", previous_response_id=first.id, store=True)
        assert second.output_text == "Fine."
    assert mock.requests[1].json["messages"][-2:] == [{"role": "assistant", "content": REFUSAL}, {"role": "user", "content": "Why not?"}]
