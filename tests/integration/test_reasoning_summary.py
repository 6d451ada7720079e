"""Reasoning as a summary (``reasoning.summary``) through a real ``hotloop serve`` (the simulator's
``reasoning`` directive): SSE with the openai SDK's ``responses.stream()`` helper, JSON, WebSocket
mode and GET all carry the same reasoning item, its summary being the model's reasoning verbatim;
without ``reasoning.summary`` the raw ``reasoning_text`` stream is unchanged."""

from __future__ import annotations

import json
from typing import Any

import httpx
from openai import OpenAI
from openai.types.responses import (
    ResponseReasoningSummaryPartAddedEvent,
    ResponseReasoningSummaryPartDoneEvent,
    ResponseReasoningSummaryTextDeltaEvent,
    ResponseReasoningSummaryTextDoneEvent,
)
from websockets.sync.client import connect as ws_connect

from hotloop.bench.loop import StreamCheck

SUMMARY_EVENTS = [
    "response.reasoning_summary_part.added",
    "response.reasoning_summary_text.delta",
    "response.reasoning_summary_text.done",
    "response.reasoning_summary_part.done",
]


def client_for(server: Any) -> OpenAI:
    return OpenAI(api_key="sk-test", base_url=server.v1, max_retries=0, timeout=30)


def body(prompt: str, summary: str | None = "auto", **kw: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "hotloop-sim", "input": prompt, "metadata": {"sim": "reasoning,tokens:8"}, **kw}
    if summary is not None:
        b["reasoning"] = {"summary": summary}
    return b


def checked(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sc = StreamCheck()
    for e in events:
        sc.feed(e)
    assert sc.finish() == []
    return events


def summary_of(events: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The streamed summary text (its deltas), after checking the summary events' shape; and the
    final response."""
    types = [e["type"] for e in events]
    assert "response.reasoning_text.delta" not in types and "response.content_part.added" in types  # (the message's)
    final = events[-1]["response"]
    rs = final["output"][0]
    assert rs["type"] == "reasoning" and rs["id"].startswith("rs_")
    assert events[2]["type"] == "response.output_item.added" and events[2]["item"] == {"id": rs["id"], "type": "reasoning", "summary": []}
    assert events[3]["type"] == SUMMARY_EVENTS[0]
    head = types.index(SUMMARY_EVENTS[2])
    assert set(types[4:head]) == {SUMMARY_EVENTS[1]}
    assert types[head : head + 3] == [SUMMARY_EVENTS[2], SUMMARY_EVENTS[3], "response.output_item.done"]
    for e in events[3 : head + 2]:
        assert (e["item_id"], e["output_index"], e["summary_index"]) == (rs["id"], 0, 0)
    text = "".join(e["delta"] for e in events[4:head])
    assert text and events[head]["text"] == text
    assert events[head + 1]["part"] == {"type": "summary_text", "text": text}
    assert rs == {"id": rs["id"], "type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}
    assert events[head + 2]["item"] == rs
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return text, final


def sse_events(server: Any, b: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.v1 + "/responses", json={**b, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    blocks = [blk for blk in raw.split("\n\n") if blk.strip()]
    events = []
    for blk in blocks:
        head, data = blk.split("\n")
        e = json.loads(data[len("data: "):])
        assert head == "event: " + e["type"]
        events.append(e)
    return checked(events)


def ws_events(server: Any, b: dict[str, Any]) -> list[dict[str, Any]]:
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        ws.send(json.dumps({"type": "response.create", **b}))
        events = []
        while True:
            e = json.loads(ws.recv(timeout=30))
            events.append(e)
            if e["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
                return checked(events)


def test_sse_json_websocket_and_get_agree(server: Any) -> None:
    b = body("Think about the weather, then answer.")
    sse = sse_events(server, b)
    text, final = summary_of(sse)
    ws = ws_events(server, b)
    ws_text, ws_final = summary_of(ws)
    assert ws_text == text  # the simulator answers one input the same way
    assert [e["type"] for e in ws] == [e["type"] for e in sse]
    r = httpx.post(server.v1 + "/responses", json=b, timeout=30)
    assert r.status_code == 200
    js = r.json()
    assert js["status"] == "completed" and js["reasoning"]["summary"] == "auto"
    assert js["output"][0]["summary"] == [{"type": "summary_text", "text": text}] and "content" not in js["output"][0]
    for resp in (final, ws_final, js):
        got = httpx.get(f"{server.v1}/responses/{resp['id']}", timeout=10)
        assert got.status_code == 200 and got.json() == resp


def test_every_summary_setting_and_none(server: Any) -> None:
    for summary in ("concise", "detailed"):
        text, final = summary_of(sse_events(server, body("Plan a trip.", summary)))
        assert final["reasoning"]["summary"] == summary and text
    raw = sse_events(server, body("Plan a trip.", None))
    types = [e["type"] for e in raw]
    assert "response.reasoning_text.delta" in types and not set(SUMMARY_EVENTS) & set(types)
    rs = raw[-1]["response"]["output"][0]
    assert rs["summary"] == [] and rs["content"][0]["type"] == "reasoning_text" and rs["content"][0]["text"]
    explicit_null = sse_events(server, {**body("Plan a trip.", None), "reasoning": {"effort": "low", "summary": None}})
    assert [e["type"] for e in explicit_null] == types


def test_openai_sdk_stream_helper(server: Any) -> None:
    """The real SDK's ``responses.stream()`` parses every summary event into its typed event and
    accumulates the final response."""
    client = client_for(server)
    with client.responses.stream(
        model="hotloop-sim", input="Reason first.", reasoning={"summary": "auto"}, metadata={"sim": "reasoning,tokens:8"}
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = {type(e) for e in events}
    assert {ResponseReasoningSummaryPartAddedEvent, ResponseReasoningSummaryTextDeltaEvent,
            ResponseReasoningSummaryTextDoneEvent, ResponseReasoningSummaryPartDoneEvent} <= kinds  # fmt: skip
    deltas = "".join(e.delta for e in events if isinstance(e, ResponseReasoningSummaryTextDeltaEvent))
    assert deltas
    rs = final.output[0]
    assert rs.type == "reasoning" and [s.text for s in rs.summary] == [deltas] and not rs.content
    assert final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the non-streaming call, parsed by the SDK
    r = client.responses.create(model="hotloop-sim", input="Reason first.", reasoning={"summary": "auto"},
                                metadata={"sim": "reasoning,tokens:8"})  # fmt: skip
    assert r.output[0].type == "reasoning" and [s.text for s in r.output[0].summary] == [deltas]


def test_openai_sdk_websocket(server: Any) -> None:
    client = client_for(server)
    with client.responses.connect() as conn:
        conn.response.create(model="hotloop-sim", input="Reason first.", reasoning={"summary": "auto"},
                             metadata={"sim": "reasoning,tokens:8"})  # fmt: skip
        events: list[Any] = []
        for e in conn:
            events.append(e)
            if e.type == "response.completed":
                break
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert deltas and [s.text for s in events[-1].response.output[0].summary] == [deltas]
