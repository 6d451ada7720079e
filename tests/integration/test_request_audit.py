"""Request bodies the official SDKs type as valid, sent to a real server (HTTP and WebSocket).

Each of these was refused with a 400 before: values added to the SDKs' enums
(``prompt_cache_retention: "in_memory"``, ``service_tier: "fast"``), fields the SDKs type as
nullable (``store``, ``stream``, a function tool's ``strict``) and an ``item_reference`` sent
without its optional ``type``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import OpenAI
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, raw_until_terminal

WAIT = 30.0
MODEL = "hotloop-sim"


def _post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.v1 + "/responses", json=body, timeout=WAIT)


def _ok(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    r = _post(server, body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    out: dict[str, Any] = r.json()
    assert out["status"] == "completed"
    return out


# --- values of the current SDKs' enums ----------------------------------------------------------


@pytest.mark.parametrize("value", ["in_memory", "in-memory", "24h"])
def test_prompt_cache_retention_both_spellings_accepted_and_echoed(server: Server, value: str) -> None:
    # openai-python 3.x types Literal["in_memory", "24h"]; SDKs up to 2.32 wrote "in-memory"
    out = _ok(server, {"model": MODEL, "input": "hi", "prompt_cache_retention": value})
    assert out["prompt_cache_retention"] == value


def test_prompt_cache_retention_from_the_sdk(server: Server) -> None:
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=0)
    resp = client.responses.create(model=MODEL, input="hi", prompt_cache_retention="in_memory")
    assert resp.status == "completed" and resp.prompt_cache_retention == "in_memory"


def test_prompt_cache_retention_outside_its_domain_still_refused(server: Server) -> None:
    r = _post(server, {"model": MODEL, "input": "hi", "prompt_cache_retention": "forever"})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "Invalid value for 'prompt_cache_retention': 'forever'. Supported values are: "
        "'in_memory', 'in-memory' and '24h'.",
        "type": "invalid_request_error",
        "param": "prompt_cache_retention",
        "code": "invalid_value",
    }


@pytest.mark.parametrize("tier", ["fast", "ultrafast", "priority", "flex"])
def test_service_tiers_of_the_sdk_accepted_and_echoed(server: Server, tier: str) -> None:
    # openai-python 3.57 ServiceTier: auto, default, flex, scale, priority, fast, ultrafast
    out = _ok(server, {"model": MODEL, "input": "hi", "service_tier": tier})
    assert out["service_tier"] == tier


def test_unknown_service_tier_still_refused(server: Server) -> None:
    r = _post(server, {"model": MODEL, "input": "hi", "service_tier": "turbo"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("service_tier", "invalid_value")


def test_reasoning_effort_max_of_the_sdk_accepted_and_echoed(server: Server) -> None:
    # openai-python 3.57 ReasoningEffort ends with "max"; a chat backend is asked for "high"
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=0)
    resp = client.responses.create(model=MODEL, input="hi", reasoning={"effort": "max"})
    assert resp.status == "completed" and resp.reasoning is not None and resp.reasoning.effort == "max"


# --- fields the SDKs type as nullable: null means the default -----------------------------------


def test_store_null_is_the_default_true(server: Server) -> None:
    out = _ok(server, {"model": MODEL, "input": "hi", "store": None})
    assert out["store"] is True
    got = httpx.get(server.v1 + f"/responses/{out['id']}", timeout=WAIT)  # stored: retrievable
    assert got.status_code == 200, got.text
    assert got.json()["id"] == out["id"]


def test_stream_null_is_a_json_answer(server: Server) -> None:
    out = _ok(server, {"model": MODEL, "input": "hi", "stream": None})
    assert out["object"] == "response"


def test_wrong_type_for_store_still_refused(server: Server) -> None:
    r = _post(server, {"model": MODEL, "input": "hi", "store": "yes"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == ("store", "invalid_type", "invalid_request_error")
    assert "`" not in err["message"] and "NoneType" not in err["message"]


def test_function_tool_strict_null_accepted(server: Server) -> None:
    # openai-python FunctionToolParam: strict: Required[Optional[bool]]
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}, "strict": None}
    out = _ok(server, {"model": MODEL, "input": "hi", "tools": [tool], "tool_choice": "required"})
    assert [o["type"] for o in out["output"]] == ["function_call"]
    assert out["output"][0]["name"] == "get_weather"
    assert out["tools"][0]["name"] == "get_weather"


def test_function_tool_strict_of_another_type_still_refused(server: Server) -> None:
    tool = {"type": "function", "name": "f", "strict": "yes"}
    r = _post(server, {"model": MODEL, "input": "hi", "tools": [tool]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("tools[0].strict", "invalid_type")


# --- item_reference without its optional type ---------------------------------------------------


def _stored_user_item(server: Server) -> str:
    first = _ok(server, {"model": MODEL, "input": [{"role": "user", "content": "remember me"}]})
    items = httpx.get(server.v1 + f"/responses/{first['id']}/input_items", timeout=WAIT)
    assert items.status_code == 200, items.text
    (item,) = items.json()["data"]
    assert item["content"] == [{"type": "input_text", "text": "remember me"}]
    return str(item["id"])


def test_item_reference_without_type_resolves(server: Server) -> None:
    # openai-python ItemReference: id: Required[str], type: Optional[Literal["item_reference"]]
    ref = _stored_user_item(server)
    typed = _ok(server, {"model": MODEL, "input": [{"type": "item_reference", "id": ref}, {"role": "user", "content": "go on"}]})
    for spelled in ({"id": ref}, {"id": ref, "type": None}):
        out = _ok(server, {"model": MODEL, "input": [spelled, {"role": "user", "content": "go on"}]})
        # the referenced item counts as the typed reference's does
        assert out["usage"]["input_tokens"] == typed["usage"]["input_tokens"]


def test_item_reference_without_type_to_an_unknown_id_is_item_not_found(server: Server) -> None:
    r = _post(server, {"model": MODEL, "input": [{"id": "msg_nope"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("input[0]", "item_not_found")


def test_item_without_type_role_or_id_still_missing_type(server: Server) -> None:
    r = _post(server, {"model": MODEL, "input": [{"content": "x"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("input[0].type", "missing_required_parameter")


# --- the same over WebSocket (§1.3: the frame carries the same fields) --------------------------


def test_websocket_frames_with_sdk_values_complete(server: Server) -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": None}
    frames = [
        {"store": None, "stream": None},
        {"prompt_cache_retention": "in_memory", "service_tier": "fast"},
        {"tools": [tool]},
    ]
    with ws_connect(server.ws + "/responses", open_timeout=WAIT) as ws:
        for extra in frames:
            ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "hi", **extra}))
            events = raw_until_terminal(ws)
            assert events[-1]["type"] == "response.completed", events[-1]
            resp = events[-1]["response"]
            if "store" in extra:
                assert resp["store"] is True
            if "service_tier" in extra:
                assert (resp["service_tier"], resp["prompt_cache_retention"]) == ("fast", "in_memory")
        # a value outside the domain is still a request-scoped error frame with a status
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "hi", "service_tier": "turbo"}))
        (frame,) = raw_until_terminal(ws)
        assert frame["type"] == "error" and frame["status"] == 400
        assert (frame["error"]["param"], frame["error"]["code"]) == ("service_tier", "invalid_value")


# --- a required tool call no backend can make ---------------------------------------------------


@pytest.mark.parametrize(
    "choice",
    [
        "required",
        {"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]},
    ],
    ids=["required", "allowed_tools-required"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_required_tool_call_with_only_unsupported_tools_is_a_400_before_streaming(
    server: Server, choice: Any, stream: bool
) -> None:
    # hosted tools are kept but never called (only function tools reach a backend): forcing a
    # call among them used to answer 200 with text, the forced call silently dropped
    body = {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}], "tool_choice": choice, "stream": stream}
    r = _post(server, body)
    assert r.status_code == 400, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "tool_choice", "unsupported_parameter")


def test_required_with_a_function_among_hosted_tools_still_calls_it(server: Server) -> None:
    tools = [{"type": "web_search"}, {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    for choice in ("required", {"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}, {"type": "function", "name": "f"}]}):
        out = _ok(server, {"model": MODEL, "input": "hi", "tools": tools, "tool_choice": choice})
        assert [(o["type"], o["name"]) for o in out["output"]] == [("function_call", "f")]


def test_allowed_tools_auto_with_only_hosted_tools_still_answers(server: Server) -> None:
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search"}]}
    out = _ok(server, {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}], "tool_choice": choice})
    assert [o["type"] for o in out["output"]] == ["message"]
