"""Real OpenAI-compatible servers' answers, end to end: openai SDK -> ``hotloop serve``
(openai-compat backend, both transports, push delivery and the native lanes) -> the scripted mock.
See tests/unit/test_compat_audit.py for the servers these shapes come from."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import Server
from tests.integration.chat_backends import _fresh_mock, client_for, compat, transport  # noqa: F401
from tests.mock_chat_server import Event, MockChatServer, Reply, chunk

TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
    "strict": True,
}


def _events(server: Server, **body: Any) -> list[Any]:
    return list(client_for(server).responses.create(model="mock-model", input="weather?", tools=[TOOL], stream=True, **body))  # type: ignore[call-overload]


def test_arguments_as_a_json_object_become_a_function_call(compat: Server, mock: MockChatServer) -> None:
    """llama-server's ``"arguments": {...}``: the response failed (server_error) instead."""
    text = chunk({"content": "Checking."})
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    # a second call streamed live first, then sent its arguments whole, as an object
    live = {"index": 1, "id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    whole = {"index": 1, "function": {"arguments": {"city": "Oslo"}}}
    mock.push(Reply.stream([text, chunk({"tool_calls": [call]}), chunk({"tool_calls": [live]}), chunk({"tool_calls": [whole]}), chunk({}, "tool_calls")]))
    events = _events(compat)
    assert events[-1].type == "response.completed", events[-1]
    calls = [i for i in events[-1].response.output if i.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_1", "get_weather", {"city": "Paris"}),
        ("call_2", "get_weather", {"city": "Oslo"}),
    ]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [{"city": "Paris"}, {"city": "Oslo"}]


def test_a_server_that_rejects_stream_options_still_answers(compat: Server, mock: MockChatServer) -> None:
    """Azure OpenAI's 400 for stream_options reached the client as its own 400."""
    rejected = {"error": {"message": "Unrecognized request argument supplied: stream_options", "type": "invalid_request_error", "param": "", "code": None}}
    answer: list[Event] = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Sunny."}), chunk({}, "stop")]
    mock.push(Reply.error(400, rejected), Reply.stream(answer))
    events = _events(compat)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "Sunny."
    usage = events[-1].response.usage
    assert usage is not None and usage.output_tokens >= 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert [("stream_options" in r.json) for r in mock.requests] == [True, False]
