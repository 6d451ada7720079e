"""Reasoning as a summary with a chat backend (cerebras and openai-compat dialects, lean and sdk
transports; :mod:`tests.mock_chat_server` records what reaches the backend).

A backend's ``delta.reasoning`` is streamed as the reasoning item's summary when the request sets
``reasoning.summary``, and the item, sent back with only its summary (what Codex sends, and
any client that keeps the summary text), or reached through ``previous_response_id`` or an
``item_reference`` (the AI SDK with ``store: true``), goes back to a backend that takes
reasoning history (cerebras) as that history; openai-compat sends none.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.conftest import Server
from tests.integration.chat_backends import _fresh_mock, cerebras, client_for, compat, server, transport  # noqa: F401
from tests.mock_chat_server import MockChatServer, Reply, Sleep, text_events, usage

MODEL = "gpt-oss-120b"
THOUGHT = "The user greets me; I should greet back."
TERMINAL = ("response.completed", "response.failed", "response.incomplete")


def chats(mock: MockChatServer) -> list[list[dict[str, Any]]]:
    """The messages of each chat request the backend received."""
    return [r.json["messages"] for r in mock.requests if r.path.endswith("/chat/completions")]


def is_cerebras(server: Server) -> bool:
    return "cerebras" in " ".join(server.proc.args)  # type: ignore[arg-type]


def sse(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.v1 + "/responses", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def reply(text: str = "Hello!", pace: float = 0.0) -> Reply:
    events = text_events(text, pieces=5, reasoning=THOUGHT, use=usage(20, 10, reasoning=5))
    if pace:  # one chunk per read: push delivery (and the lanes it offers) takes part
        events = [e for x in events for e in (Sleep(pace), x)]
    return Reply.stream(events)


def assistant_history(server: Server, messages: list[dict[str, Any]]) -> dict[str, Any]:
    (msg,) = [m for m in messages if m["role"] == "assistant"]
    if is_cerebras(server):
        assert msg.get("reasoning") == THOUGHT
    else:
        assert "reasoning" not in msg  # openai-compat sends no reasoning history
    return msg


def test_streamed_as_summary_then_sent_back_stateless(server: Server, mock: MockChatServer) -> None:
    mock.push(reply(pace=0.005), reply("Again!"))
    first = sse(server, {"model": MODEL, "input": "Hi", "store": False, "reasoning": {"summary": "auto"}})
    types = [e["type"] for e in first]
    assert "response.reasoning_text.delta" not in types
    deltas = "".join(e["delta"] for e in first if e["type"] == "response.reasoning_summary_text.delta")
    assert deltas == THOUGHT
    final = first[-1]["response"]
    rs, msg = final["output"]
    # store: false: with the reasoning sealed, the one way such a client can send it back (protocol.sealed)
    assert rs == {"id": rs["id"], "type": "reasoning", "encrypted_content": rs["encrypted_content"],
                  "summary": [{"type": "summary_text", "text": THOUGHT}]}  # fmt: skip
    assert rs["encrypted_content"].startswith("hl1.")
    assert msg["content"][0]["text"] == "Hello!"
    # a stateless follow-up (store: false) sending the item back with its summary only
    follow: Any = [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": rs["id"], "summary": [{"type": "summary_text", "text": deltas}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}], "id": msg["id"]},
        {"role": "user", "content": "Again"},
    ]
    second = client_for(server).responses.create(model=MODEL, input=follow, store=False, reasoning={"summary": "auto"})
    assert second.output_text == "Again!"
    messages = chats(mock)[1]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert assistant_history(server, messages)["content"] == "Hello!"


def test_chained_by_previous_response_id(server: Server, mock: MockChatServer) -> None:
    mock.push(reply(), reply("Again!"), reply("Fourth!"), reply("Third!"), reply("Fifth!"))
    client = client_for(server)
    first = client.responses.create(model=MODEL, input="Hi", reasoning={"summary": "auto"})
    assert first.output[0].type == "reasoning" and [s.text for s in first.output[0].summary] == [THOUGHT]  # type: ignore[union-attr]
    second = client.responses.create(model=MODEL, input="Again", previous_response_id=first.id, reasoning={"summary": "auto"})
    assert second.output_text == "Again!"
    assistant_history(server, chats(mock)[1])
    # the AI SDK's next turn (store: true): the earlier output referred to by id
    refs: Any = [{"role": "user", "content": "Hi"}, *({"type": "item_reference", "id": o.id} for o in first.output),
            {"role": "user", "content": "Again"}]  # fmt: skip
    assert client.responses.create(model=MODEL, input=refs, reasoning={"summary": "auto"}).output_text == "Fourth!"
    assistant_history(server, chats(mock)[2])
    # over WebSocket, from the connection's cache (store: false)
    with client.responses.connect() as conn:
        conn.response.create(model=MODEL, input="Hi", store=False, reasoning={"summary": "auto"})
        events: list[Any] = []
        for e in conn:
            events.append(e)
            if e.type in TERMINAL:
                break
        assert "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta") == THOUGHT
        conn.response.create(model=MODEL, input="Again", store=False, previous_response_id=events[-1].response.id)
        for e in conn:
            if e.type in TERMINAL:
                assert e.type == "response.completed"
                break
    assert len(chats(mock)) == 5
    assistant_history(server, chats(mock)[4])
