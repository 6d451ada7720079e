"""Request validation, sans I/O: SDK-valid values accepted on both decode paths (HTTP body and
WebSocket frame), and the exact errors for what stays invalid."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hotloop import errors
from hotloop.protocol.request import ItemReference, Message, convert_body, decode_body, validate


def _prep(body: dict[str, Any], ws: bool):
    return validate(convert_body(body) if ws else decode_body(json.dumps(body)), websocket=ws)


def _err(body: dict[str, Any], ws: bool) -> errors.HotloopError:
    with pytest.raises(errors.HotloopError) as ei:
        _prep(body, ws)
    assert ei.value.status == 400 and ei.value.type == "invalid_request_error"
    return ei.value


BASE = {"model": "m", "input": "x"}
FN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("ws", [False, True], ids=["http", "websocket"])
def test_nullable_fields_take_their_defaults(ws: bool) -> None:
    p = _prep({**BASE, "store": None, "stream": None, "tools": [{**FN, "strict": None}]}, ws)
    assert p.req.store is True and p.req.stream is False
    assert p.function_tools["f"].strict is True
    assert p.tools == [{**FN, "strict": None}]  # echoed as sent


@pytest.mark.parametrize("ws", [False, True], ids=["http", "websocket"])
def test_sdk_enum_values(ws: bool) -> None:
    for value in ("in_memory", "in-memory", "24h"):
        assert _prep({**BASE, "prompt_cache_retention": value}, ws).req.prompt_cache_retention == value
    for tier in ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast"):
        assert _prep({**BASE, "service_tier": tier}, ws).req.service_tier == tier
    e = _err({**BASE, "prompt_cache_retention": "in memory"}, ws)
    assert (e.param, e.code) == ("prompt_cache_retention", "invalid_value")


@pytest.mark.parametrize("ws", [False, True], ids=["http", "websocket"])
def test_item_reference_type_is_optional(ws: bool) -> None:
    p = _prep({**BASE, "input": [{"id": "msg_1"}, {"id": "msg_2", "type": None}, {"role": "user", "content": "x"}]}, ws)
    assert p.items[:2] == [ItemReference(id="msg_1"), ItemReference(id="msg_2")]
    assert type(p.items[2]) is Message
    e = _err({**BASE, "input": [{"id": 5}]}, ws)
    assert (e.param, e.code) == ("input[0].id", "invalid_type")
    e = _err({**BASE, "input": [{"content": "x"}]}, ws)
    assert (e.param, e.code) == ("input[0].type", "missing_required_parameter")


@pytest.mark.parametrize("ws", [False, True], ids=["http", "websocket"])
def test_required_call_needs_a_function_tool(ws: bool) -> None:
    e = _err({**BASE, "tools": [{"type": "web_search"}, {"type": "custom", "name": "c"}], "tool_choice": "required"}, ws)
    assert (e.param, e.code, e.message) == (
        "tool_choice",
        "unsupported_parameter",
        "Invalid 'tool_choice': 'required' needs a function tool; tools of type 'web_search' are not "
        "supported by this server.",
    )
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]}
    e = _err({**BASE, "tools": [{"type": "web_search"}, FN], "tool_choice": choice}, ws)
    assert (e.param, e.code, e.message) == (
        "tool_choice",
        "unsupported_parameter",
        "Invalid 'tool_choice': the allowed tools name no function tool this server can call.",
    )
    # with a function among them, or mode auto, nothing changes
    assert _prep({**BASE, "tools": [{"type": "web_search"}, FN], "tool_choice": "required"}, ws).tool_choice == "required"
    auto = {**choice, "mode": "auto"}
    assert _prep({**BASE, "tools": [{"type": "web_search"}], "tool_choice": auto}, ws).tool_choice == auto
