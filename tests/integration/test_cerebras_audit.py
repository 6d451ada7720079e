"""The cerebras backend against a mock that answers as Cerebras Cloud does (cerebras.md).

``hotloop serve --backend cerebras`` (subprocess) over the ``lean`` and ``sdk`` transports,
``HOTLOOP_BACKEND_RETRIES=1``, pointed at :mod:`tests.mock_chat_server` on a real loopback socket.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import Server, run_server
from tests.mock_chat_server import Event, MockChatServer, Reply, chunk, text_events, usage

KEY = "csk-cerebras-audit-0123456789"


@pytest.fixture(autouse=True)
def _fresh_mock(mock: MockChatServer) -> None:
    mock.reset()


@pytest.fixture(scope="module", params=["lean", "sdk"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer) -> Iterator[Server]:
    env = {
        "HOTLOOP_BACKEND_TRANSPORT": str(request.param),
        "CEREBRAS_API_KEY": KEY,
        "CEREBRAS_BASE_URL": mock.url,
        "CEREBRAS_CUSTOM_HEADERS": "X-Org-Tag: audit\nX-Team: loop",
        "HOTLOOP_BACKEND_RETRIES": "1",
        "HOTLOOP_BACKEND_TIMEOUT": "10",
        "HOTLOOP_BACKEND_IDLE_TIMEOUT": "5",
    }
    args = ("--backend", "cerebras", "--model", "gpt-oss-120b", "--store", "memory")
    with run_server(tmp_path_factory.mktemp("cerebras-audit-" + str(request.param)), *args, env=env) as s:
        yield s


def _post(server: Server, **extra: Any) -> httpx.Response:
    body = {"model": "gpt-oss-120b", "input": "x", **extra}
    return httpx.post(server.v1 + "/responses", json=body, timeout=30)


# -- retries as the SDK (and the docs) describe them -------------------------------------------


def test_a_409_conflict_is_retried(server: Server, mock: MockChatServer) -> None:
    """cerebras.md: the SDK retries 408, 409, 429 and >=500 (hotloop turns its retries off and
    decides them itself). A 409 was a 502 with ``x-should-retry: false``, never retried."""
    mock.push(Reply.error(409, {"message": "Conflict, please retry", "type": "conflict_error"}), Reply.stream(text_events("ok")))
    r = _post(server)
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == "ok"
    assert len(mock.requests) == 2


@pytest.mark.parametrize(("status", "header"), [(500, {"retry-after": "1"}), (408, {"retry-after-ms": "1000"})])
def test_a_retry_waits_for_the_delay_the_backend_asked(server: Server, mock: MockChatServer, status: int, header: dict[str, str]) -> None:
    """cerebras.md: retries honour ``retry-after-ms`` and ``retry-after``. hotloop read them
    only on 429 and 503: a 500 or 408 asking for a second was retried after 0.25 s."""
    mock.push(Reply.error(status, {"message": "busy", "type": "server_error"}, header), Reply.stream(text_events("ok")))
    t0 = time.monotonic()
    r = _post(server)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert len(mock.requests) == 2
    assert elapsed >= 0.9, f"retried after {elapsed:.3f}s, the backend asked for 1s"


# -- what held (the checks are kept so that it keeps holding) ---------------------------------


def test_the_sdk_s_headers_and_custom_headers_reach_cerebras(server: Server, mock: MockChatServer) -> None:
    mock.push(Reply.stream(text_events("ok")))
    assert _post(server).status_code == 200
    (sent,) = mock.requests
    h = sent.headers
    assert h["authorization"] == f"Bearer {KEY}"
    assert h["user-agent"].startswith("AsyncCerebras/Python ")
    assert h["x-org-tag"] == "audit" and h["x-team"] == "loop"  # CEREBRAS_CUSTOM_HEADERS
    assert h["content-type"] == "application/json" and h["accept"] == "text/event-stream"


def test_a_cerebras_429_waits_for_the_exhausted_bucket_and_hides_hotloop_s_quota(server: Server, mock: MockChatServer) -> None:
    headers = {
        "x-ratelimit-limit-requests-day": "14400",
        "x-ratelimit-limit-tokens-minute": "60000",
        "x-ratelimit-remaining-requests-day": "14000",
        "x-ratelimit-remaining-tokens-minute": "0",
        "x-ratelimit-reset-requests-day": "33011.4",
        "x-ratelimit-reset-tokens-minute": "45.5",  # over 20 s: not waited out, passed on
    }
    body = {"message": "Tokens per minute limit exceeded - too many tokens processed.", "type": "too_many_requests_error",
            "param": "quota", "code": "token_quota_exceeded"}
    mock.push(Reply.error(429, body, headers))
    r = _post(server)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert "try again in 45.5s" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "46"
    assert not any(k.lower().startswith("x-ratelimit") for k in r.headers)
    assert len(mock.requests) == 1


def test_cerebras_context_wording_is_context_length_exceeded(server: Server, mock: MockChatServer) -> None:
    body = {"message": "Please reduce the length of the messages or completion. Current length is 42328 while limit is 40000",
            "type": "invalid_request_error", "param": "messages", "code": "wrong_api_format"}
    mock.push(Reply.error(400, body))
    r = _post(server)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_an_error_chunk_mid_stream_keeps_its_status(server: Server, mock: MockChatServer) -> None:
    """cerebras.md: ``ErrorChunkResponse{error{code,message,param,type,id},status_code}``."""
    err = {"error": {"code": "context_length_exceeded", "message": "Please reduce the length of the messages or completion.",
                     "param": "messages", "type": "invalid_request_error", "id": "e1"}, "status_code": 400}
    mock.push(Reply.stream([err], done=False))
    r = _post(server)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert KEY not in r.text


def test_reasoning_usage_and_time_info_as_cerebras_streams_them(server: Server, mock: MockChatServer) -> None:
    """gpt-oss and GLM stream reasoning in ``delta.reasoning`` (text_parsed, their default);
    the last chunk carries finish_reason, usage and time_info together."""
    last = chunk({}, "stop", usage(40, 7, cached=0, reasoning=3))
    last["time_info"] = {"queue_time": 0.001, "prompt_time": 0.002, "completion_time": 0.003, "total_time": 0.006, "created": 1.0}
    last["system_fingerprint"] = "fp"
    events: list[Event] = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning": "Think."}), chunk({"content": "Done."}), last]
    mock.push(Reply.stream(events))
    r = _post(server)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["type"] for o in out["output"]] == ["reasoning", "message"]
    assert out["output"][0]["content"][0]["text"] == "Think."
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == 3 and out["usage"]["input_tokens"] == 40
    sent = mock.requests[0].json
    assert sent["stream_options"] == {"include_usage": True} and "max_tokens" not in sent


def test_models_are_listed_from_cerebras(server: Server, mock: MockChatServer) -> None:
    r = httpx.get(server.v1 + "/models", timeout=10)
    assert r.status_code == 200
    assert "gpt-oss-120b" in [m["id"] for m in r.json()["data"]]
    assert all(json.dumps(m).find(KEY) < 0 for m in r.json()["data"])


def _cerebras_chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    """A chunk as Cerebras writes it: its own fields around OpenAI's (system_fingerprint,
    service_tier, logprobs and reasoning_logprobs null, ``tokens`` in the delta)."""
    return {
        "id": "chatcmpl-c0ffee",
        "choices": [{"delta": {**delta, "tokens": None}, "finish_reason": finish, "index": 0, "logprobs": None, "reasoning_logprobs": None}],
        "created": 1_760_000_000,
        "model": "gpt-oss-120b",
        "system_fingerprint": "fp_70185065a4",
        "service_tier": "default",
        "object": "chat.completion.chunk",
        **extra,
    }


def test_cerebras_shaped_chunks_stream_whole_over_sse(server: Server, mock: MockChatServer) -> None:
    """Every delta of a Cerebras-shaped stream (reasoning, text, a tool call's arguments)
    reaches an SSE client, the pushed and lane paths included."""
    reasoning = [f"r{i} " for i in range(30)]
    text = [f"t{i} " for i in range(30)]
    args = ['{"q"', ': "', "abc", '"}']
    events: list[Event] = [_cerebras_chunk({"role": "assistant"})]
    events += [_cerebras_chunk({"reasoning": r}) for r in reasoning]
    events += [_cerebras_chunk({"content": t}) for t in text]
    events.append(_cerebras_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "search", "arguments": ""}}]}))
    events += [_cerebras_chunk({"tool_calls": [{"index": 0, "type": "function", "function": {"arguments": a}}]}) for a in args]
    time_info = {"queue_time": 0.0001, "prompt_time": 0.001, "completion_time": 0.02, "total_time": 0.03, "created": 1.7e9}
    events.append(_cerebras_chunk({}, "tool_calls", usage=usage(30, 65, reasoning=30), time_info=time_info))
    mock.push(Reply.stream(events))
    tool = {"type": "function", "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
    with httpx.stream("POST", server.v1 + "/responses", json={"model": "gpt-oss-120b", "input": "x", "tools": [tool], "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    payloads = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    deltas: dict[str, str] = {}
    for p in payloads:
        if p["type"].endswith(".delta"):
            deltas[p["type"]] = deltas.get(p["type"], "") + p["delta"]
    assert deltas["response.reasoning_text.delta"] == "".join(reasoning)
    assert deltas["response.output_text.delta"] == "".join(text)
    assert deltas["response.function_call_arguments.delta"] == "".join(args)
    final = payloads[-1]
    assert final["type"] == "response.completed", final["type"]
    assert [o["type"] for o in final["response"]["output"]] == ["reasoning", "message", "function_call"]
    assert final["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 30


@pytest.mark.parametrize("status", [400, 401, 402, 403, 422, 500])
def test_a_cerebras_error_quoting_hotloop_s_key_never_repeats_it(server: Server, mock: MockChatServer, status: int) -> None:
    body = {"message": f"Invalid API key {KEY} for org", "type": "invalid_request_error", "param": "api_key", "code": "wrong_api_format"}
    mock.push(Reply.error(status, body), Reply.error(status, body))  # a 500 is retried once
    r = _post(server)
    assert r.status_code in (400, 502), r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert KEY not in r.text and KEY not in str(r.headers)
    assert KEY not in server.logs()


def test_a_5xx_that_outlasts_the_retries_passes_on_when_to_come_back(server: Server, mock: MockChatServer) -> None:
    """As a 503 did: the backend's own retry-after (never its x-ratelimit-* headers) reaches
    the client with the 502, so the client's SDK waits as long before it retries."""
    headers = {"retry-after": "1", "x-ratelimit-remaining-requests-day": "0", "x-ratelimit-reset-requests-day": "9000"}
    mock.push(*[Reply.error(500, {"message": "busy", "type": "server_error"}, headers)] * 2)
    r = _post(server)
    assert r.status_code == 502, r.text
    assert r.headers["retry-after"] == "1" and r.headers["retry-after-ms"] == "1000"
    assert not any(k.lower().startswith("x-ratelimit") for k in r.headers)
    assert len(mock.requests) == 2
