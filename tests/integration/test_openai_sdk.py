"""The real openai SDK against a real ``hotloop serve`` process: HTTP, SSE and WebSocket mode."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

TEXT_SEQUENCE_HEAD = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_SEQUENCE_TAIL = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def client_for(server, **kw) -> OpenAI:
    return OpenAI(api_key="sk-test", base_url=server.v1, max_retries=0, timeout=30, **kw)


def check_text_stream(events: list) -> None:
    types = [e.type for e in events]
    assert types[:4] == TEXT_SEQUENCE_HEAD
    assert types[-4:] == TEXT_SEQUENCE_TAIL
    middle = types[4:-4]
    assert middle and set(middle) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.status == "completed"
    assert final.output_text == deltas
    item_id = events[2].item.id
    assert final.output[0].id == item_id
    assert all(e.item_id == item_id for e in events if e.type == "response.output_text.delta")
    u = final.usage
    assert u.input_tokens > 0 and u.output_tokens == len(middle)
    assert u.total_tokens == u.input_tokens + u.output_tokens


def test_http_json(server) -> None:
    client = client_for(server)
    r = client.responses.create(model="hotloop-sim", input="Say hello.")
    assert r.status == "completed"
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.model == "hotloop-sim"


def test_the_text_format_is_echoed_with_its_type(server) -> None:
    """``text`` as the client sent it, its format's ``type`` included when it is the default
    (Codex sends only a verbosity; the SDK types the format by its ``type``)."""
    client = client_for(server)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}
    cases = [
        ({"verbosity": "low"}, {"format": {"type": "text"}, "verbosity": "low"}),
        ({"format": {"type": "text"}}, {"format": {"type": "text"}, "verbosity": "medium"}),
        ({}, {"format": {"type": "text"}, "verbosity": "medium"}),
        ({"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
         {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}, "verbosity": "medium"}),
    ]
    for sent, echoed in cases:
        r = client.responses.create(model="hotloop-sim", input="x", text=sent)
        assert r.text.format.type == echoed["format"]["type"]
        raw = client.responses.with_raw_response.create(model="hotloop-sim", input="x", text=sent).http_response.json()
        assert raw["text"] == echoed, sent
        with client.responses.stream(model="hotloop-sim", input="x", text=sent) as stream:
            events = list(stream)
        assert events[0].response.text.format.type == echoed["format"]["type"]
        assert events[-1].response.text.model_dump(exclude_none=True, by_alias=True) == echoed


def test_http_sse_stream(server) -> None:
    client = client_for(server)
    events = list(client.responses.create(model="hotloop-sim", input="Say hello.", stream=True))
    check_text_stream(events)


def test_stream_helper(server) -> None:
    client = client_for(server)
    with client.responses.stream(model="hotloop-sim", input="Tell me something.") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) and deltas


def test_sse_wire_framing(server) -> None:
    body = {"model": "hotloop-sim", "input": "hi", "stream": True}
    with httpx.stream("POST", server.v1 + "/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("req_")
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b]
    for b in blocks:
        event_line, data_line = b.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        payload = json.loads(data_line[len("data: ") :])
        assert payload["type"] == event_line[len("event: ") :]
    assert "[DONE]" not in raw


def test_websocket_chain(server) -> None:
    client = client_for(server)
    with client.responses.connect() as conn:
        conn.response.create(model="hotloop-sim", input="hello", store=False)
        first = []
        for e in conn:
            first.append(e)
            if e.type == "response.completed":
                break
        check_text_stream(first)
        rid = first[-1].response.id
        conn.response.create(
            model="hotloop-sim",
            input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "again"}]}],
            previous_response_id=rid,
            store=False,
        )
        second = []
        for e in conn:
            second.append(e)
            if e.type == "response.completed":
                break
        check_text_stream(second)
        final = second[-1].response
        assert final.previous_response_id == rid
        # the whole first turn is a cached prefix of the second
        first_usage = first[-1].response.usage
        assert final.usage.input_tokens_details.cached_tokens >= first_usage.input_tokens
        assert final.usage.input_tokens > first_usage.total_tokens


def test_websocket_errors_keep_socket_usable(server) -> None:
    client = client_for(server)
    with client.responses.connect() as conn:
        conn.response.create(model="hotloop-sim", input="x", previous_response_id="resp_missing", store=False)
        e = conn.recv()
        assert e.type == "error"
        assert e.status == 400
        assert e.error.code == "previous_response_not_found"
        assert e.error.param == "previous_response_id"
        conn.send_raw("this is not json")
        e = conn.recv()
        assert e.type == "error" and e.status == 400 and e.error.type == "invalid_request_error"
        conn.send_raw(json.dumps({"type": "response.create", "input": "no model"}))
        e = conn.recv()
        assert e.type == "error" and e.error.param == "model"
        conn.send_raw(json.dumps({"type": "response.create", "model": 5, "input": "x"}))
        e = conn.recv()
        assert e.type == "error" and e.error.param == "model"
        conn.send_raw(json.dumps({"type": "response.bogus"}))
        e = conn.recv()
        assert e.type == "error" and e.error.param == "type"
        # Codex's acknowledgement gets no reply; the next create works normally
        conn.send_raw(json.dumps({"type": "response.processed", "response_id": "resp_x"}))
        conn.response.create(model="hotloop-sim", input="still alive", store=False)
        types = []
        for ev in conn:
            types.append(ev.type)
            if ev.type == "response.completed":
                break
        assert types[0] == "response.created" and types[-1] == "response.completed"


def test_http_errors(server) -> None:
    client = client_for(server)
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="hotloop-sim", input="x", previous_response_id="resp_nope")
    assert ei.value.code == "previous_response_not_found"
    assert ei.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="hotloop-sim", input="x", temperature=7, stream=True)
    assert ei.value.param == "temperature"
    cases = [
        (b"{not json", None),
        (b"[1,2]", None),
        (json.dumps({"input": "x"}).encode(), "model"),
        (json.dumps({"model": "m"}).encode(), "input"),
        (json.dumps({"model": 3, "input": "x"}).encode(), "model"),
        (json.dumps({"model": "m", "input": [{"type": "message", "role": "user", "content": 5}]}).encode(), "input[0].content"),
    ]
    for body, param in cases:
        r = httpx.post(server.v1 + "/responses", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param, (body, err)
        assert "Traceback" not in r.text
        assert r.headers["x-request-id"].startswith("req_")


def test_models_and_health(server) -> None:
    client = client_for(server)
    ids = [m.id for m in client.models.list()]
    assert "hotloop-sim" in ids
    assert client.models.retrieve("hotloop-sim").id == "hotloop-sim"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    h = httpx.get(server.base + "/healthz").json()
    assert h["status"] == "ok" and h["backend"] == "simulator"
