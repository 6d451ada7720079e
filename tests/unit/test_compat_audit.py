"""Chunk shapes and answers real OpenAI-compatible servers send, read by the openai-compat
backend over both transports, against the scripted mock (tests.mock_chat_server) on a real
loopback socket.

* llama-server (llama.cpp issue #20198) and TGI have sent ``function.arguments`` as a JSON
  *object* instead of a JSON-encoded string: read as the object's JSON text, not a malformed stream.
* Servers that give a tool-call delta no ``index`` and an empty ``id`` ("") on its later deltas:
  the empty id continues the call, as no id does.
* Servers and gateways that reject ``stream_options`` (Azure OpenAI's 400 "Unrecognized request
  argument supplied: stream_options", Mistral's 422 ``extra_forbidden``, Groq's and Databricks'
  400s): the request is sent again once without it (the answer then has no usage chunk), and
  the backend stops sending it; the client never sees a 400 for a field it did not send.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from hotloop import errors
from hotloop.backends.base import BackendRequest
from hotloop.backends.openai_compat import OpenAICompatBackend
from hotloop.config import Config
from hotloop.protocol.chunks import Finish, TextDelta, ToolCallDelta, Usage
from tests.mock_chat_server import Event, MockChatServer, Reply, chunk, text_events, usage

TIMEOUT = 10.0
TRANSPORTS = ["lean", "sdk"]


@pytest.fixture(scope="module")
def mock() -> Any:
    with MockChatServer() as m:
        yield m


def _run(transport: str, mock: MockChatServer, replies: list[Reply], turns: int = 1) -> list[tuple[list[Any], BaseException | None]]:
    """``turns`` requests through one backend; each one's chunks and the error it ended with."""

    async def main() -> list[tuple[list[Any], BaseException | None]]:
        backend = OpenAICompatBackend(
            Config(backend="openai-compat", base_url=mock.v1, model="mock-model", backend_transport=transport, backend_api_key="sk-test-key-0123")
        )
        await backend.start()
        mock.reset()
        mock.push(*replies)
        results: list[tuple[list[Any], BaseException | None]] = []
        try:
            for _ in range(turns):
                got: list[Any] = []
                exc: BaseException | None = None
                try:
                    req = BackendRequest(model="mock-model", instructions=None, items=[], tools=[], tool_choice="auto", parallel_tool_calls=True)
                    async for c in backend.stream(req):
                        got.append(c)
                except errors.HotloopError as e:
                    exc = e
                results.append((got, exc))
        finally:
            await backend.close()
        return results

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def _calls(got: list[Any]) -> dict[int, tuple[str | None, str | None, str]]:
    out: dict[int, tuple[str | None, str | None, str]] = {}
    for c in got:
        if isinstance(c, ToolCallDelta):
            cid, name, args = out.get(c.index, (None, None, ""))
            out[c.index] = (cid or c.call_id, name or c.name, args + c.arguments)
    return out


# -- tool-call arguments as a JSON object --------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_arguments_sent_as_a_json_object_are_read_as_its_json_text(transport: str, mock: MockChatServer) -> None:
    """llama-server (ggml-org/llama.cpp#20198) and TGI sent ``"arguments": {"city": "Paris"}``:
    hotloop failed the whole response as "a malformed stream" (502)."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    empty = {"index": 1, "id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}
    reply = Reply.stream([chunk({"role": "assistant"}), chunk({"tool_calls": [call]}), chunk({"tool_calls": [empty]}), chunk({}, "tool_calls")])
    [(got, exc)] = _run(transport, mock, [reply])
    assert exc is None, exc
    calls = _calls(got)
    assert calls[0][:2] == ("call_1", "get_weather") and json.loads(calls[0][2]) == {"city": "Paris", "days": 2}
    assert calls[1][:2] == ("call_2", "now") and json.loads(calls[1][2]) == {}
    assert got[-1] == Finish("tool_calls")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_arguments_as_an_object_after_string_pieces_are_still_one_call(transport: str, mock: MockChatServer) -> None:
    """A call whose name came first and whose arguments came whole, as an object, in a later delta."""
    first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    rest = {"index": 0, "function": {"arguments": {"q": "x"}}}
    reply = Reply.stream([chunk({"tool_calls": [first]}), chunk({"tool_calls": [rest]}), chunk({}, "tool_calls")])
    [(got, exc)] = _run(transport, mock, [reply])
    assert exc is None, exc
    assert _calls(got) == {0: ("call_1", "f", '{"q":"x"}')}


# -- an empty id on a delta without index ---------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_empty_id_without_index_continues_the_call(transport: str, mock: MockChatServer) -> None:
    """Without ``index``, a delta whose ``id`` is "" started a new, nameless call: the response
    failed with "a tool call without a name" (502)."""
    first = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    more = {"id": "", "type": "function", "function": {"arguments": ":1}"}}
    reply = Reply.stream([chunk({"tool_calls": [first]}), chunk({"tool_calls": [more]}), chunk({}, "tool_calls")])
    [(got, exc)] = _run(transport, mock, [reply])
    assert exc is None, exc
    assert _calls(got) == {0: ("call_1", "f", '{"a":1}')}


# -- stream_options rejected ---------------------------------------------------------------------

AZURE_400 = {
    "error": {
        "message": "Unrecognized request argument supplied: stream_options",
        "type": "invalid_request_error",
        "param": "",
        "code": None,
    }
}
MISTRAL_422 = {
    "object": "error",
    "message": {"detail": [{"type": "extra_forbidden", "loc": ["body", "stream_options", "include_usage"], "msg": "Extra inputs are not permitted", "input": True}]},
    "type": "invalid_request_error",
    "param": None,
    "code": None,
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("status,body", [(400, AZURE_400), (422, MISTRAL_422)], ids=["azure-400", "mistral-422"])
def test_a_server_that_rejects_stream_options_is_asked_again_without_it(
    transport: str, status: int, body: Any, mock: MockChatServer
) -> None:
    """The client got a 400 ``invalid_request_error`` for a field hotloop adds itself, on every request."""
    answer: list[Event] = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hi"}), chunk({}, "stop")]
    replies = [Reply.error(status, body), Reply.stream(answer), Reply.stream(answer)]
    results = _run(transport, mock, replies, turns=2)
    for got, exc in results:
        assert exc is None, exc
        assert got == [TextDelta("Hi"), Finish("stop")]
    sent = [r.json for r in mock.requests]
    assert len(sent) == 3  # the rejected request, its second try, and the next turn's only one
    assert sent[0]["stream_options"] == {"include_usage": True}
    for again in sent[1:]:
        assert "stream_options" not in again and again["stream"] is True
        assert {k: v for k, v in again.items()} == {k: v for k, v in sent[0].items() if k != "stream_options"}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_another_400_is_not_sent_again(transport: str, mock: MockChatServer) -> None:
    """A 400 about something else is the client's to see, once, and stream_options stays."""
    bad = {"error": {"message": "temperature must be at most 2", "type": "invalid_request_error", "param": "temperature", "code": None}}
    results = _run(transport, mock, [Reply.error(400, bad), Reply.stream(text_events("ok", pieces=1))], turns=2)
    (got, exc), (got2, exc2) = results
    assert got == [] and isinstance(exc, errors.InvalidRequest) and "temperature" in str(exc)
    assert exc2 is None and isinstance(got2[-2], Usage) and got2[-1] == Finish("stop")
    assert len(mock.requests) == 2 and all(r.json["stream_options"] == {"include_usage": True} for r in mock.requests)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_server_that_rejects_stream_options_twice_gets_its_400_through(transport: str, mock: MockChatServer) -> None:
    """Asked again without stream_options and still rejected: that answer is the client's, once."""
    again = {"error": {"message": "stream_options and something else", "type": "invalid_request_error", "param": None, "code": None}}
    [(got, exc)] = _run(transport, mock, [Reply.error(400, AZURE_400), Reply.error(400, again), Reply.stream(text_events("x"))])
    assert got == [] and isinstance(exc, errors.InvalidRequest) and exc.status == 400
    assert len(mock.requests) == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_usage_only_in_a_final_chunk_without_choices(transport: str, mock: MockChatServer) -> None:
    """vLLM/SGLang/llama.cpp with include_usage: the usage comes alone, ``choices: []``."""
    events: list[Event] = [chunk({"content": "Hi"}), chunk({}, "stop"), chunk(usage=usage(7, 1), choices=False)]
    [(got, exc)] = _run(transport, mock, [Reply.stream(events)])
    assert exc is None and got == [TextDelta("Hi"), Usage(7, 1, 0, 0), Finish("stop")]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_validation_error_that_quotes_the_body_does_not_drop_stream_options(transport: str, mock: MockChatServer) -> None:
    """FastAPI servers (vLLM) quote the request body in a 400/422: "stream_options" appears in
    it though the server accepts the field. Asked again once, still rejected: stream_options
    stays for the next request (its usage is not lost for good)."""
    quoted = {"object": "error", "message": "[{'loc': ('body', 'messages'), 'msg': 'Field required', 'input': {'stream_options': {'include_usage': True}}}]", "type": "BadRequestError", "code": 400}
    replies = [Reply.error(400, quoted), Reply.error(400, quoted), Reply.stream(text_events("ok", pieces=1))]
    (got, exc), (got2, exc2) = _run(transport, mock, replies, turns=2)
    assert got == [] and isinstance(exc, errors.InvalidRequest)
    assert exc2 is None and got2[-1] == Finish("stop")
    assert [("stream_options" in r.json) for r in mock.requests] == [True, False, True]
