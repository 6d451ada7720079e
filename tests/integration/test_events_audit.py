"""Audit of the events and objects a client receives (wire reference §2.4-2.9), against a real
``hotloop serve`` on 127.0.0.1: the simulator (session ``server``) and the chat mock."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
from openai import OpenAI
from openai.types.responses import Response
from websockets.sync.client import connect

from tests.conftest import Server, raw_until_terminal, run_server
from tests.mock_chat_server import MockChatServer, Reply, tool_events

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
SEARCH = {"type": "function", "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


def _sse(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.v1 + "/responses", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]


# -- usage: input_tokens_details.cache_write_tokens ----------------------------------------------

SIM_CASES: list[dict[str, Any]] = [
    {"metadata": {"sim": "text,tokens:3"}},
    {"metadata": {"sim": "reasoning,tokens:3"}},
    {"metadata": {"sim": "tools:2"}, "tools": [WEATHER]},
    {"metadata": {"sim": "tokens:10"}, "max_output_tokens": 4},
    {"metadata": {"sim": "fail:server_error,tokens:3"}},
    {"metadata": {"sim": "error,tokens:3"}},
]


def _check_usage(response: dict[str, Any]) -> None:
    """The Response validates against openai-python's own model (every required field present,
    of its type), and its usage is the full object the real API sends."""
    Response.model_validate(response)
    u = response["usage"]
    assert u["input_tokens_details"] == {"cache_write_tokens": 0, "cached_tokens": u["input_tokens_details"]["cached_tokens"]}
    assert u["output_tokens_details"].keys() == {"reasoning_tokens"}
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]


@pytest.mark.parametrize("case", SIM_CASES, ids=lambda c: c["metadata"]["sim"])
def test_usage_has_cache_write_tokens_over_sse_and_json(server: Server, case: dict[str, Any]) -> None:
    """openai-python 3.x types ``input_tokens_details.cache_write_tokens`` as a required int
    (the real API sends ``0``): without it the SDK's Response fails validation and the attribute
    reads ``None``."""
    body = {"model": "hotloop-sim", "input": "hi", **case}
    events = _sse(server, body)
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete", "response.failed")
    assert final["response"]["usage"] is not None
    _check_usage(final["response"])
    for e in events:
        if "response" in e:  # created, in_progress: usage null, still a valid Response
            Response.model_validate(e["response"])
    r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
    if final["type"] != "response.failed":
        assert r.status_code == 200
        _check_usage(r.json())
        parsed = OpenAI(api_key="sk", base_url=server.v1, max_retries=0).responses.create(**body)
        assert parsed.usage is not None and parsed.usage.input_tokens_details.cache_write_tokens == 0


def test_usage_has_cache_write_tokens_over_websocket(server: Server) -> None:
    with connect(server.ws + "/responses") as ws:
        for case in SIM_CASES[:4]:
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi", **case}))
            events = raw_until_terminal(ws)
            _check_usage(events[-1]["response"])


# -- parallel calls whose backend repeats a call id ----------------------------------------------


@pytest.fixture(scope="module")
def compat(tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer) -> Iterator[Server]:
    args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model", "--store", "memory")
    with run_server(tmp_path_factory.mktemp("events-audit"), *args, env={"HOTLOOP_BACKEND_API_KEY": "k"}) as s:
        yield s


def _duplicate_ids_reply() -> Reply:
    # two parallel calls (indexes 0 and 1) that the backend gives the same id
    return Reply.stream(tool_events([("call_0", "search", '{"q":"a"}'), ("call_0", "search", '{"q":"b"}')]))


def test_parallel_calls_get_distinct_call_ids_when_the_backend_repeats_one(compat: Server, mock: MockChatServer) -> None:
    """A response's function calls are told apart by ``call_id`` (the client answers each with a
    ``function_call_output`` naming it): openai-python's stream helper raises "Response snapshot
    has conflicting output identities" and openai-node "duplicate output item identity" on two
    calls with one id."""
    mock.reset()
    mock.push(_duplicate_ids_reply())
    events = _sse(compat, {"model": "mock-model", "input": "hi", "tools": [SEARCH]})
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    ids = [i["call_id"] for i in added]
    assert len(ids) == 2 and ids[0] == "call_0" and ids[1] != "call_0" and ids[1].startswith("call_")
    assert [i["call_id"] for i in done] == ids == [o["call_id"] for o in final["output"]]
    assert [o["arguments"] for o in final["output"]] == ['{"q":"a"}', '{"q":"b"}']

    mock.reset()
    mock.push(_duplicate_ids_reply())
    client = OpenAI(api_key="sk", base_url=compat.v1, max_retries=0, timeout=30)
    with client.responses.stream(model="mock-model", input="hi", tools=[SEARCH]) as stream:  # type: ignore[list-item]
        for _ in stream:
            pass
        response = stream.get_final_response()
    calls = [o for o in response.output if o.type == "function_call"]
    assert len({c.call_id for c in calls}) == 2 and calls[0].call_id == "call_0"


@pytest.mark.parametrize("max_tool_calls", [None, 5])
def test_parallel_tool_calls_false_gives_at_most_one_call_whatever_the_backend_sends(
    compat: Server, mock: MockChatServer, max_tool_calls: int | None
) -> None:
    """``parallel_tool_calls: false`` is passed on, and held to: a backend that ignores it
    (Ollama, some chat templates) sends two calls, the response holds the first alone, as
    OpenAI's does."""
    mock.reset()
    mock.push(Reply.stream(tool_events([("call_a", "search", '{"q":"a"}'), ("call_b", "search", '{"q":"b"}')])))
    body: dict[str, Any] = {"model": "mock-model", "input": "hi", "tools": [SEARCH], "parallel_tool_calls": False}
    if max_tool_calls is not None:
        body["max_tool_calls"] = max_tool_calls
    events = _sse(compat, body)
    assert mock.requests[0].json["parallel_tool_calls"] is False
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [(o["call_id"], o["arguments"]) for o in final["output"]] == [("call_a", '{"q":"a"}')]
    assert [e["item"]["call_id"] for e in events if e["type"] == "response.output_item.added"] == ["call_a"]
    assert final["parallel_tool_calls"] is False

    mock.reset()  # (with the flag on, both)
    mock.push(Reply.stream(tool_events([("call_a", "search", '{"q":"a"}'), ("call_b", "search", '{"q":"b"}')])))
    both = _sse(compat, {**body, "parallel_tool_calls": True})[-1]["response"]
    assert [o["call_id"] for o in both["output"]] == ["call_a", "call_b"]
