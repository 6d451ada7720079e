"""The cerebras and openai-compat backends, end to end on real loopback sockets.

openai SDK -> ``hotloop serve`` (subprocess) -> backend (the real cerebras-cloud-sdk client, or
httpx) -> :mod:`tests.mock_chat_server`, which scripts each answer and records each request.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Server
from tests.integration.chat_backends import _fresh_mock, cerebras, client_for, compat, server, transport  # noqa: F401
from tests.mock_chat_server import Disconnect, MockChatServer, Reply, Sleep, chunk, paced_events, text_events, tool_events, usage

TERMINAL = ("response.completed", "response.failed", "response.incomplete")
SEARCH_TOOL = {
    "type": "function",
    "name": "search",
    "description": "Search the code base.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": False},
    "strict": True,
}


def sse_payloads(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.v1 + "/responses", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]


def is_cerebras(server: Server) -> bool:
    return "cerebras" in " ".join(server.proc.args)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------


def test_text_reasoning_and_usage_stream(server: Server, mock: MockChatServer) -> None:
    mock.push(Reply.stream(text_events("The answer is 42.", pieces=6, reasoning="Let me think.", use=usage(50, 9, cached=32, reasoning=3))))
    events = list(
        client_for(server).responses.create(
            model="gpt-oss-120b",
            instructions="Be brief.",
            input="What is the answer?",
            max_output_tokens=100,
            reasoning={"effort": "high"},
            prompt_cache_key="k1",
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert types[-1] == "response.completed"
    assert types.count("response.reasoning_text.delta") == 5 and types.count("response.output_text.delta") == 6
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == "The answer is 42."
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me think."
    u = final.usage
    # the backend's 32 cached tokens are not this key's own reused prefix (a first request has
    # none): its prompt cache is every key's, so they are not reported as cached
    assert (u.input_tokens, u.output_tokens, u.input_tokens_details.cached_tokens, u.output_tokens_details.reasoning_tokens) == (50, 9, 0, 3)

    (sent,) = mock.requests
    body = sent.json
    assert body["model"] == "gpt-oss-120b"
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the answer?"}]
    assert body["reasoning_effort"] == "high" and body["prompt_cache_key"] == "k1"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    if is_cerebras(server):
        assert body["max_completion_tokens"] == 100
        assert sent.headers["authorization"] == "Bearer test"
    else:
        assert body["max_tokens"] == 100
        assert sent.headers["authorization"] == "Bearer compat-key"


def test_cached_tokens_are_the_keys_own_reused_prefix_at_most_what_the_backend_cached(server: Server, mock: MockChatServer) -> None:
    """``cached_tokens`` with a backend that reports its own: never more than its prompt cache
    served (what it bills), never more than the tokens this key's request reuses (the backend's
    cache is shared by every key, so its count alone could reveal another key's prefix)."""
    client = client_for(server)
    mock.push(Reply.stream(text_events("First answer.", pieces=2, use=usage(40, 3, cached=30))))
    first = client.responses.create(model="gpt-oss-120b", input="Tell me something.", store=True)
    assert first.usage.input_tokens_details.cached_tokens == 0  # nothing of this key's was reused
    mock.push(Reply.stream(text_events("Second.", pieces=1, use=usage(5000, 2, cached=4000))))
    second = client.responses.create(model="gpt-oss-120b", input="And more?", previous_response_id=first.id, store=True)
    own = second.usage.input_tokens_details.cached_tokens
    assert 0 < own < 100 and second.usage.input_tokens == 5000  # the parent's items, as hotloop counts them
    mock.push(Reply.stream(text_events("Third.", pieces=1, use=usage(5000, 2, cached=1))))
    third = client.responses.create(model="gpt-oss-120b", input="And more?", previous_response_id=first.id, store=True)
    assert third.usage.input_tokens_details.cached_tokens == 1  # what the backend's cache served


def test_tool_calls_over_many_chunks_then_outputs(server: Server, mock: MockChatServer) -> None:
    client = client_for(server)
    args_a, args_b = '{"q":"def main"}', '{"q":"class Server"}'
    mock.push(Reply.stream(tool_events([("call_A", "search", args_a), ("call_B", "search", args_b)], pieces=7)))
    r1 = client.responses.create(model="gpt-oss-120b", input="Find main and Server.", tools=[SEARCH_TOOL])
    calls = [(o.call_id, o.name, o.arguments) for o in r1.output if o.type == "function_call"]
    assert calls == [("call_A", "search", args_a), ("call_B", "search", args_b)]
    assert r1.usage.input_tokens == 20 and r1.usage.output_tokens == 12

    mock.push(Reply.stream(text_events("Found both.")))
    r2 = client.responses.create(
        model="gpt-oss-120b",
        previous_response_id=r1.id,
        tools=[SEARCH_TOOL],
        input=[
            {"type": "function_call_output", "call_id": "call_A", "output": "main.py:1"},
            {"type": "function_call_output", "call_id": "call_B", "output": "server.py:9"},
        ],
    )
    assert r2.output_text == "Found both."
    first, second = mock.requests
    m1, m2 = first.json["messages"], second.json["messages"]
    assert m2[: len(m1)] == m1
    assert m2[len(m1) :] == [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_A", "type": "function", "function": {"name": "search", "arguments": args_a}},
                {"id": "call_B", "type": "function", "function": {"name": "search", "arguments": args_b}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_A", "content": "main.py:1"},
        {"role": "tool", "tool_call_id": "call_B", "content": "server.py:9"},
    ]
    assert first.json["tools"][0]["function"]["strict"] is True
    # byte-stable: the first request's messages are a byte prefix of the second request's
    assert messages_bytes(second.body).startswith(messages_bytes(first.body) + b",")
    # one pooled connection (possibly opened by an earlier test) served both requests
    assert mock.connections <= 1


def messages_bytes(body: bytes) -> bytes:
    """The ``messages`` array of a raw request body, without its closing bracket."""
    start = body.index(b'"messages":[')
    return body[start : body.index(b'],"tools":', start)]


def test_websocket_odd_tool_streams(cerebras: Server, mock: MockChatServer) -> None:
    """Arguments only in the final chunk, names arriving late, interleaved indices: over WebSocket."""
    odd = [
        chunk({"role": "assistant"}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "search"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"q":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"q":"one"}'}}, {"index": 1, "function": {"arguments": '"two"}'}}]}),
        chunk({}, "tool_calls"),
        chunk(usage=usage(30, 10), choices=False),
    ]
    mock.push(Reply.stream(odd), Reply.stream(text_events("ok")))
    client = client_for(cerebras)
    with client.responses.connect() as conn:
        conn.response.create(model="gpt-oss-120b", input="go", tools=[SEARCH_TOOL], store=False)
        events = []
        for e in conn:
            events.append(e)
            if e.type in TERMINAL:
                break
        final = events[-1].response
        assert events[-1].type == "response.completed"
        assert [(o.call_id, o.name, o.arguments) for o in final.output] == [("call_1", "search", '{"q":"one"}'), ("call_2", "search", '{"q":"two"}')]
        added = [e.item.name for e in events if e.type == "response.output_item.added"]
        assert added == ["search", "search"]  # names known when each item opened
        conn.response.create(
            model="gpt-oss-120b",
            previous_response_id=final.id,
            tools=[SEARCH_TOOL],
            store=False,
            input=[{"type": "function_call_output", "call_id": "call_1", "output": "1"}, {"type": "function_call_output", "call_id": "call_2", "output": "2"}],
        )
        second = []
        for e in conn:
            second.append(e)
            if e.type in TERMINAL:
                break
        assert second[-1].type == "response.completed" and second[-1].response.output_text == "ok"
    tool_msgs = [m for m in mock.requests[1].json["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == ["call_1", "call_2"]


def test_rate_limit_is_429_with_retry_header(cerebras: Server, mock: MockChatServer) -> None:
    headers = {"retry-after": "7", "x-ratelimit-reset-tokens-minute": "6.5", "x-ratelimit-remaining-tokens-minute": "0"}
    mock.push(Reply.error(429, {"message": "Tokens per minute limit exceeded", "type": "too_many_requests_error", "code": "token_quota_exceeded"}, headers))
    with pytest.raises(openai.RateLimitError) as ei:
        client_for(cerebras).responses.create(model="gpt-oss-120b", input="x")
    assert ei.value.code == "rate_limit_exceeded"
    assert ei.value.response.headers["retry-after"] == "7"
    # the backend's own rate-limit headers describe hotloop's account: never forwarded
    assert not [h for h in ei.value.response.headers if h.lower().startswith("x-ratelimit-")]
    assert len(mock.requests) == 1  # HOTLOOP_BACKEND_RETRIES=0: no retry


def test_rate_limit_retried_before_first_token(compat: Server, mock: MockChatServer) -> None:
    mock.push(Reply.error(429, {"error": {"message": "slow down"}}, {"retry-after-ms": "200"}), Reply.stream(text_events("after retry")))
    t0 = time.monotonic()
    r = client_for(compat).responses.create(model="mock-model", input="x")
    assert r.output_text == "after retry" and len(mock.requests) == 2
    assert time.monotonic() - t0 >= 0.2
    assert mock.requests[0].body == mock.requests[1].body
    # a delay longer than hotloop waits for is surfaced at once
    mock.push(Reply.error(429, {"error": {"message": "slow down"}}, {"retry-after": "3600"}))
    with pytest.raises(openai.RateLimitError):
        client_for(compat).responses.create(model="mock-model", input="x", stream=True)


def test_errors_before_the_first_token(cerebras: Server, mock: MockChatServer) -> None:
    client = client_for(cerebras)
    mock.push(Reply.error(500, {"message": "boom at /srv/model.py"}))
    with pytest.raises(openai.InternalServerError) as ei:
        client.responses.create(model="gpt-oss-120b", input="x")
    assert ei.value.code == "server_error" and "/srv" not in str(ei.value.body)
    ctx = {"message": "Please reduce the length of the messages or completion.", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}
    mock.push(Reply.error(400, ctx))
    with pytest.raises(openai.BadRequestError) as bi:
        client.responses.create(model="gpt-oss-120b", input="x", stream=True)
    assert bi.value.code == "context_length_exceeded"
    mock.push(Reply.error(401, {"message": "Wrong API key"}))
    with pytest.raises(openai.APIStatusError) as ai:
        client.responses.create(model="gpt-oss-120b", input="x")
    assert ai.value.status_code == 502 and "credentials" in ai.value.message
    n = len(mock.requests)
    img = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]
    with pytest.raises(openai.BadRequestError) as ii:
        client.responses.create(model="gpt-oss-120b", input=img)
    assert "image" in ii.value.message.lower() and len(mock.requests) == n  # never sent


def test_failures_mid_stream(cerebras: Server, mock: MockChatServer) -> None:
    head = text_events("partial answer", pieces=3)[:3]
    error_chunk = {"error": {"message": "internal", "type": "server_error", "code": "internal_error"}, "status_code": 500}
    mock.push(Reply.stream([*head, error_chunk]), Reply.stream([*head, Disconnect()], done=False))
    for _ in range(2):
        payloads = sse_payloads(cerebras, {"model": "gpt-oss-120b", "input": "x"})
        assert [p["type"] for p in payloads[-2:]] == ["error", "response.failed"]
        failed = payloads[-1]["response"]
        assert failed["error"]["code"] == "server_error"
        assert failed["output"][0]["status"] == "incomplete"
        assert "internal_error" not in json.dumps(payloads)


def test_stall_fails_within_the_idle_timeout(server: Server, mock: MockChatServer) -> None:
    mock.push(Reply.stream([*text_events("slow", pieces=2)[:2], Sleep(4.0)]))
    t0 = time.monotonic()
    payloads = sse_payloads(server, {"model": "gpt-oss-120b", "input": "x"})
    elapsed = time.monotonic() - t0
    assert payloads[-1]["type"] == "response.failed"
    assert payloads[-1]["response"]["error"]["code"] == "server_error"
    assert "stopped sending" in payloads[-1]["response"]["error"]["message"]
    assert elapsed < 3.0  # idle timeout 1 s, not the mock's 4 s stall


def test_disconnect_over_websocket_fails_the_response(compat: Server, mock: MockChatServer) -> None:
    mock.push(Reply.stream([*text_events("abc", pieces=3)[:3], Disconnect()], done=False), Reply.stream(text_events("fine")))
    with client_for(compat).responses.connect() as conn:
        conn.response.create(model="mock-model", input="x", store=False)
        events = []
        for e in conn:
            events.append(e)
            if e.type in TERMINAL:
                break
        assert events[-1].type == "response.failed"
        assert "error" not in [e.type for e in events]
        # the socket stays usable
        conn.response.create(model="mock-model", input="again", store=False)
        for e in conn:
            if e.type in TERMINAL:
                assert e.type == "response.completed" and e.response.output_text == "fine"
                break
    assert len(mock.requests) == 2  # a failure after the first token is never retried


def test_models_are_proxied(server: Server, mock: MockChatServer) -> None:
    ids = [m.id for m in client_for(server).models.list()]
    assert ids == ["gpt-oss-120b", "mock-model"]
    health = httpx.get(server.base + "/healthz").json()
    assert health["backend"] == ("cerebras" if is_cerebras(server) else "openai-compat")


def test_steering_with_a_chat_backend(server: Server, mock: MockChatServer) -> None:
    """The successor of a steered response is one more upstream request whose messages end with
    the partial assistant output and the steering input; the steered stream is abandoned."""
    mock.push(Reply.stream(paced_events(200, 0.02)), Reply.stream(text_events("ok")))
    client = client_for(server)
    with client.responses.connect() as conn:
        conn.response.create(model="mock-model" if not is_cerebras(server) else "gpt-oss-120b", input="go", store=False)
        events = []
        rid = None
        for e in conn:
            events.append(e)
            if e.type == "response.created" and rid is None:
                rid = e.response.id
            if e.type == "response.output_text.delta" and sum(x.type == "response.output_text.delta" for x in events) == 3:
                conn.response.steer(previous_response_id=rid, input="stop and say ok")
            if e.type == "response.completed":
                break
    kinds = [e.type for e in events]
    steered = events[kinds.index("response.incomplete")].response
    assert steered.incomplete_details.reason == "steered"
    partial = steered.output[0].content[0].text
    assert partial.startswith(" w0 w1 w2") and len(partial.split()) < 200
    assert events[-1].response.output_text == "ok" and events[-1].response.previous_response_id == rid
    assert len(mock.requests) == 2
    messages = mock.requests[1].json["messages"]
    assert messages[-2]["role"] == "assistant" and messages[-2]["content"] == partial
    last = messages[-1]
    text = last["content"] if isinstance(last["content"], str) else last["content"][0]["text"]
    assert last["role"] == "user" and text == "stop and say ok"
    deadline = time.monotonic() + 5
    while mock.stream_counts()[2] and time.monotonic() < deadline:
        time.sleep(0.02)
    done, gone, open_ = mock.stream_counts()
    assert gone >= 1 and open_ == 0  # the steered upstream stream was cancelled, not read to the end
