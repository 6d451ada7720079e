"""A chat backend's failures as a client sees them, the same on both transports.

``hotloop serve`` (subprocess) with the cerebras and openai-compat backends, each over the
``lean`` and the ``sdk`` transport, against :mod:`tests.mock_chat_server` on a real loopback
socket; the client is plain httpx (HTTP JSON and SSE) or a WebSocket.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import httpx
import pytest
from websockets.sync.client import connect

from tests.conftest import Server, raw_until_terminal, run_server
from tests.mock_chat_server import MockChatServer, Reply, Sleep, text_events

BROKEN = "The model backend closed the connection mid-stream."


@pytest.fixture(autouse=True)
def _fresh_mock(mock: MockChatServer) -> None:
    mock.reset()


@pytest.fixture(scope="module", params=["cerebras/lean", "cerebras/sdk", "compat/lean", "compat/sdk"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer) -> Iterator[Server]:
    kind, transport = str(request.param).split("/")
    env = {"HOTLOOP_BACKEND_TRANSPORT": transport, "HOTLOOP_BACKEND_RETRIES": "0", "HOTLOOP_BACKEND_TIMEOUT": "10"}
    if kind == "cerebras":
        env.update({"CEREBRAS_API_KEY": "csk-audit-key-0123", "CEREBRAS_BASE_URL": mock.url})
        args: tuple[str, ...] = ("--backend", "cerebras", "--model", "mock-model")
    else:
        env["HOTLOOP_BACKEND_API_KEY"] = "sk-audit-key-0123"
        args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model")
    with run_server(tmp_path_factory.mktemp(kind + "-" + transport), *args, "--store", "memory", env=env) as s:
        yield s


def _post(server: Server, stream: bool) -> httpx.Response:
    return httpx.post(server.v1 + "/responses", json={"model": "mock-model", "input": "x", "stream": stream}, timeout=30)


def _ws_error(server: Server) -> dict[str, Any]:
    with connect(server.ws + "/responses") as ws:
        ws.send(json.dumps({"type": "response.create", "model": "mock-model", "input": "x", "store": False}))
        events = raw_until_terminal(ws)
    assert [e["type"] for e in events] == ["error"]
    return events[0]


def test_a_backend_that_hangs_up_without_answering_is_a_502_on_every_transport(server: Server, mock: MockChatServer) -> None:
    """The backend accepts the connection, reads the request and closes it without a byte of
    answer (a crashed worker, a proxy dropping it). The lean transport said 502 "closed the
    connection mid-stream"; the sdk transports said 503 "Could not connect to the model
    backend." (it had connected), so one failure had two statuses and two stories."""
    for stream in (False, True):
        mock.push(Reply.hang_up())
        r = _post(server, stream)
        assert r.status_code == 502, r.text
        assert r.json()["error"] == {"message": BROKEN, "type": "server_error", "param": None, "code": "server_error"}
    mock.push(Reply.hang_up())
    frame = _ws_error(server)
    assert frame["status"] == 502 and frame["error"]["message"] == BROKEN
    assert len(mock.requests) == 3  # HOTLOOP_BACKEND_RETRIES=0: each was sent once


def test_a_redirect_is_reported_not_followed_on_every_transport(server: Server, mock: MockChatServer) -> None:
    """A backend (or a misconfigured base URL) answering 307: the lean transport reports it
    (502 "The model backend failed (HTTP 307)."). Over the sdk transport the Cerebras SDK
    followed it, re-sending the conversation to wherever Location pointed, and the
    openai-compat backend read the redirect's body as an empty stream ("closed the stream
    before finishing")."""
    here = mock.v1 + "/chat/completions"  # followed, the mock would answer it with the next reply
    mock.push(Reply.text(307, b"", {"location": here}), Reply.stream(text_events("followed")))
    r = _post(server, False)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"] == "The model backend failed (HTTP 307)."
    assert len(mock.requests) == 1  # never re-sent to the redirect's target


@pytest.mark.parametrize("status", [401, 403, 402])
def test_a_backend_refusing_hotloop_s_own_account_is_not_retried_by_the_sdk(server: Server, mock: MockChatServer, status: int) -> None:
    """A backend rejecting hotloop's credentials (401/403) or its account (402) answers every
    retry the same: the 502 said ``x-should-retry: true`` (as every 5xx), so the openai SDK sent
    the request three times for one call. It now says ``false``: one request."""
    from openai import InternalServerError, OpenAI

    for _ in range(3):
        mock.push(Reply.error(status, {"error": {"message": "no", "type": "invalid_request_error"}}))
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=2)
    with pytest.raises(InternalServerError) as ei:
        client.responses.create(model="mock-model", input="x")
    assert ei.value.status_code == 502 and ei.value.response.headers["x-should-retry"] == "false"
    assert len(mock.requests) == 1


@pytest.mark.parametrize("reason", ["abort", "error", "insufficient_system_resource", "time_limit", "cancelled"])
def test_a_generation_the_backend_aborted_fails_instead_of_completing(server: Server, mock: MockChatServer, reason: str) -> None:
    """vLLM and SGLang end an aborted generation with ``finish_reason: "abort"`` (DeepSeek one
    interrupted for want of capacity with ``insufficient_system_resource``, watsonx with
    ``time_limit`` or ``cancelled``): the response was read as ``completed`` with the partial
    text, as if the model had finished."""
    message = f"The model backend ended the response early (finish_reason '{reason}')."
    mock.push(Reply.stream(text_events("half an ans", finish=reason)))
    r = _post(server, False)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"] == message
    mock.push(Reply.stream(text_events("half an ans", finish=reason)))
    r = _post(server, True)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    last = events[-1]
    assert last["type"] == "response.failed", [e["type"] for e in events]
    assert last["response"]["error"]["message"] == message
    assert "response.completed" not in [e["type"] for e in events]


@pytest.mark.parametrize("reason", ["length", "model_length", "max_tokens"])
def test_a_token_limit_by_any_of_its_names_is_an_incomplete_response(server: Server, mock: MockChatServer, reason: str) -> None:
    """Mistral ends a generation at its context limit with ``model_length``: read as a normal
    end, the cut answer was ``completed``; it is ``incomplete`` (``max_output_tokens``), its
    message too, as with ``length``."""
    mock.push(Reply.stream(text_events("half an ans", finish=reason)))
    r = _post(server, False)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"


def test_a_body_kept_open_after_done_does_not_hold_the_response_back(server: Server, mock: MockChatServer) -> None:
    """A backend that keeps its chunked body open after ``[DONE]``: the response ends at the
    ``[DONE]``, on either transport (the SDK transport's release waited up to its 1 s drain
    bound before the terminal event: a second on every turn of an agent loop); the next
    request is answered as ever."""
    mock.push(Reply(events=[*text_events("all of it"), "data: [DONE]\n\n", Sleep(3.0)]))
    t0 = time.monotonic()
    with httpx.stream("POST", server.v1 + "/responses", json={"model": "mock-model", "input": "x", "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"response.completed"' in line:
                break
        else:
            raise AssertionError("no response.completed")
    took = time.monotonic() - t0
    assert took < 0.75, took  # (the drain bound is 1 s, the body's end 3 s away)
    assert json.loads(line[6:])["response"]["output"][0]["content"][0]["text"] == "all of it"
    mock.push(Reply.stream(text_events("again")))
    r2 = _post(server, False)
    assert r2.status_code == 200 and r2.json()["output"][0]["content"][0]["text"] == "again"


@pytest.mark.parametrize(
    "body", [{"error": "Invalid value for 'temperature'"}, {"status_code": 429, "message": "Invalid value for 'temperature'"}]
)
def test_a_400_is_read_from_the_answer_itself_on_every_transport(server: Server, mock: MockChatServer, body: dict[str, Any]) -> None:
    """A 400 whose error message is a plain string, or whose body names another status: the
    client is told the backend's message, as a 400, on either transport (the Cerebras SDK's
    error object unwraps ``error`` and prefers a body's ``status_code``: its transport withheld
    the message, or answered a 429)."""
    mock.push(Reply.error(400, body))
    r = _post(server, False)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "Invalid value for 'temperature'" in err["message"], err


def _raw(delta: str, finish: str | None = None) -> str:
    fin = json.dumps(finish)
    return f'data: {{"id":"c","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{delta},"finish_reason":{fin}}}]}}\n\n'


def test_an_emoji_split_into_its_two_surrogate_escapes_is_one_character(server: Server, mock: MockChatServer) -> None:
    """A backend that cuts its text by UTF-16 unit sends an emoji's two halves in two chunks
    (valid JSON, refused by a strict UTF-8 decoder): the text and the tool call's arguments
    hold the emoji, and the response completes instead of failing as a malformed stream."""
    mock.push(Reply(events=[
        _raw('{"role":"assistant","content":"\\ud83d"}'), _raw('{"content":"\\ude00 hi \\ud83d"}'),
        _raw('{"content":"\\ude80"}'), _raw("{}", "stop"), "data: [DONE]\n\n",
    ]))
    r = _post(server, False)
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == "\U0001F600 hi \U0001F680"
    call = '{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":%s}}'
    mock.push(Reply(events=[
        _raw('{"tool_calls":[%s]}' % (call % '"{\\"s\\": \\"\\ud83d"')),
        _raw('{"tool_calls":[{"index":0,"function":{"arguments":"\\ude00\\"}"}}]}'), _raw("{}", "tool_calls"), "data: [DONE]\n\n",
    ]))
    r = _post(server, True)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed", [e["type"] for e in events]
    assert json.loads(events[-1]["response"]["output"][0]["arguments"]) == {"s": "\U0001F600"}


def test_an_error_event_without_an_error_wrapper_keeps_its_status(server: Server, mock: MockChatServer) -> None:
    """``event: error`` whose data is the error object itself (``{"message", "code": 429}``):
    its status was lost (read as an error object absent, so a 500, "The model backend failed
    (HTTP 500)"); a 429 is a 429, and its message is the backend's."""
    bare = 'event: error\ndata: {"message": "slow down", "code": 429}\n\n'
    mock.push(Reply.stream([bare], done=False))
    r = _post(server, False)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limit_exceeded"


def test_the_backends_own_context_length_refusal_keeps_a_websocket_parent(server: Server, mock: MockChatServer) -> None:
    """Over WebSocket a continuation that fails evicts its parent from the connection's cache,
    except an input over the model's window: a retry with less input or truncation "auto"
    continues it. That held for hotloop's own check, not for the backend's own refusal (a model
    whose window hotloop does not know): with store false, the retry found no parent."""
    mock.push(Reply.stream(text_events("hello there")))
    with connect(server.ws + "/responses") as ws:
        ws.send(json.dumps({"type": "response.create", "model": "mock-model", "input": "hi", "store": False}))
        rid = raw_until_terminal(ws)[-1]["response"]["id"]
        mock.push(Reply.error(400, {"error": {"message": "This model's maximum context length is 8192 tokens.",
                                              "type": "invalid_request_error", "code": "context_length_exceeded"}}))
        ws.send(json.dumps({"type": "response.create", "model": "mock-model", "input": "big " * 50, "store": False,
                            "previous_response_id": rid}))
        [refused] = raw_until_terminal(ws)
        assert refused["type"] == "error" and refused["error"]["code"] == "context_length_exceeded", refused
        mock.push(Reply.stream(text_events("again")))
        ws.send(json.dumps({"type": "response.create", "model": "mock-model", "input": "small", "store": False,
                            "previous_response_id": rid}))
        assert raw_until_terminal(ws)[-1]["type"] == "response.completed"


def test_a_whole_json_answer_instead_of_a_stream_is_read_on_every_transport(server: Server, mock: MockChatServer) -> None:
    """A backend that answers the streaming request with one JSON document: a server that
    ignores ``stream: true`` (its chat.completion), or one that answers an error with a 200.
    Both were a retried 502 "closed the stream before finishing": the completion was thrown
    away, and a context refusal (a 400 the client must act on) hidden."""
    json_type = {"content-type": "application/json"}
    completion = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "mock-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Whole answer"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    refusal = {"error": {"message": "This model's maximum context length is 4096 tokens.", "code": "context_length_exceeded"}}
    for stream in (False, True):
        mock.push(Reply(status=200, raw=json.dumps(completion).encode(), headers=json_type))
        r = _post(server, stream)
        assert r.status_code == 200, r.text
        final = r.json() if not stream else json.loads(r.text.strip().split("data: ")[-1])["response"]
        assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Whole answer"
        assert final["usage"]["output_tokens"] == 2
        mock.push(Reply(status=200, raw=json.dumps(refusal).encode(), headers=json_type))
        r = _post(server, stream)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded" and "x-should-retry" not in r.headers
    lone = json.dumps(completion).replace("Whole answer", "a\\ud83d").encode()  # a lone surrogate escape
    for raw in (b'{"neither": "a completion nor an error"}', b'{"a":' * 100_000 + b"1" + b"}" * 100_000, lone):
        mock.push(Reply(status=200, raw=raw, headers=json_type))
        r = _post(server, False)
        assert r.status_code == 502 and r.json()["error"]["message"] == "The model backend sent a malformed stream."
    assert "Traceback" not in server.logs()
