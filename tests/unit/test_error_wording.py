"""Validation errors speak JSON: no Python type names, the exact ``param`` path, clipped echoes."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from hotloop import errors
from hotloop.protocol.request import convert_body, decode_body, json_terms, validate
from hotloop.protocol.session import RunCreate, SendError, Session

PYTHON_NAMES = re.compile(r"\b(str|int|NoneType|None|dict|list|float|bool|tuple|bytes|set)\b|`")
LONG = "q" * 5000
WRONG: list[Any] = [None, 7, 1.5, True, "text", [], [1], {}, {"a": 1}, LONG]

MSG = {"type": "message", "role": "user", "content": "hi"}


def _req(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


def _bodies() -> list[tuple[str, dict[str, Any]]]:
    """(param that must be named, request body) pairs: one wrong-typed value per field."""
    out: list[tuple[str, dict[str, Any]]] = []
    top = [
        "model", "input", "instructions", "previous_response_id", "store", "stream", "stream_options", "tools",
        "tool_choice", "parallel_tool_calls", "max_output_tokens", "max_tool_calls", "temperature", "top_p",
        "top_logprobs", "text", "reasoning", "metadata", "include", "truncation", "prompt_cache_key",
        "prompt_cache_retention", "user", "safety_identifier", "service_tier", "generate", "stream_id",
    ]
    for field in top:
        for v in WRONG:
            out.append((field, _req(**{field: v})))
    nested: list[tuple[str, dict[str, Any]]] = []
    for v in WRONG:
        nested += [
            ("text.format", _req(text={"format": v})),
            ("text.format.type", _req(text={"format": {"type": v}})),
            ("text.verbosity", _req(text={"verbosity": v})),
            ("reasoning.effort", _req(reasoning={"effort": v})),
            ("reasoning.summary", _req(reasoning={"summary": v})),
            ("include[0]", _req(include=[v])),
            ("input[0]", _req(input=[v])),
            ("input[1].role", _req(input=[MSG, {"type": "message", "role": v, "content": "x"}])),
            ("input[0].content", _req(input=[{"type": "message", "role": "user", "content": v}])),
            ("input[0].content[0]", _req(input=[{"type": "message", "role": "user", "content": [v]}])),
            ("input[0].content[0].type", _req(input=[{"role": "user", "content": [{"type": v, "text": "x"}]}])),
            ("input[0].content[0].text", _req(input=[{"role": "user", "content": [{"type": "input_text", "text": v}]}])),
            ("input[0].call_id", _req(input=[{"type": "function_call", "call_id": v, "name": "f", "arguments": "{}"}])),
            ("input[0].name", _req(input=[{"type": "function_call", "call_id": "c", "name": v, "arguments": "{}"}])),
            ("input[0].arguments", _req(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": v}])),
            ("input[0].output", _req(input=[{"type": "function_call_output", "call_id": "c", "output": v}])),
            ("input[0].summary", _req(input=[{"type": "reasoning", "summary": v}])),
            ("input[0].id", _req(input=[{"type": "item_reference", "id": v}])),
            ("input[0].type", _req(input=[{"type": v, "role": "user", "content": "x"}])),
            ("tools[0]", _req(tools=[v])),
            ("tools[0].name", _req(tools=[{"type": "function", "name": v}])),
            ("tools[0].parameters", _req(tools=[{"type": "function", "name": "f", "parameters": v}])),
            ("tools[0].strict", _req(tools=[{"type": "function", "name": "f", "strict": v}])),
            ("tools[0].description", _req(tools=[{"type": "function", "name": "f", "description": v}])),
            ("tool_choice", _req(tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": v})),
            ("tool_choice.mode", _req(tools=[{"type": "function", "name": "f"}], tool_choice={"type": "allowed_tools", "mode": v, "tools": [{"type": "function", "name": "f"}]})),
            ("metadata.k", _req(metadata={"k": v})),
        ]
    return out + nested


def _error(body: dict[str, Any], ws: bool) -> errors.HotloopError | None:
    try:
        validate(convert_body(body) if ws else decode_body(json.dumps(body)), websocket=ws)
    except errors.HotloopError as exc:
        return exc
    return None


@pytest.mark.parametrize("ws", [False, True], ids=["http", "websocket"])
def test_no_python_type_names_and_exact_params(ws: bool) -> None:
    rejected = 0
    for field, body in _bodies():
        exc = _error(body, ws)
        if exc is None:
            continue  # a value of the right type after all (e.g. a string where one is expected)
        rejected += 1
        msg = exc.message
        assert not PYTHON_NAMES.search(msg), (field, msg)
        assert len(msg) < 400, (field, msg)
        assert LONG not in msg and "q" * 101 not in msg, (field, msg)
        assert exc.param is not None and (exc.param == field or exc.param.startswith(field)), (field, exc.param, msg)
        assert exc.status == 400 and exc.type == "invalid_request_error"
    assert rejected > 250


def test_wording_examples() -> None:
    exc = _error(_req(input=[{"role": "user", "content": [{"type": "input_text", "text": None}]}]), False)
    assert exc is not None and exc.param == "input[0].content[0].text"
    assert exc.message == "Invalid type for 'input[0].content[0].text': expected a string, but got null instead."
    exc = _error(_req(input=5), True)
    assert exc is not None and exc.message == (
        "Invalid type for 'input': expected a string, an array or null, but got an integer instead."
    )
    exc = _error(_req(max_output_tokens=1.5), False)
    assert exc is not None and "expected an integer or null, but got a number instead" in exc.message
    exc = _error(_req(store={}), False)  # null is store's default (the SDKs type it Optional[bool])
    assert exc is not None and "expected a boolean or null, but got an object instead" in exc.message
    exc = _error(_req(tools=[{"type": "function", "name": "f", "strict": "yes"}]), False)
    assert exc is not None and exc.message == "Invalid type for 'tools[0].strict': expected a boolean or null, but got a string instead."
    exc = _error(_req(reasoning={"effort": LONG}), False)
    assert exc is not None and exc.message == f"Invalid value for 'reasoning.effort': '{'q' * 100}...' is not a supported value."
    exc = _error(_req(previous_response_id=LONG), False)
    assert exc is None  # looked up later: the not-found error clips it
    assert errors.PreviousResponseNotFound(LONG).message == f"Previous response with id '{'q' * 100}...' not found."


def test_json_terms_rewrites_every_decoder_name() -> None:
    assert json_terms("Expected `str`, got `NoneType`") == "expected a string, but got null instead"
    assert json_terms("Expected `dict`, got `list`") == "expected an object, but got an array instead"
    assert json_terms("Expected `int` >= 0") == "expected an integer >= 0"
    assert json_terms("Expected `float | bool`, got `tuple`") == "expected a number or a boolean, but got an array instead"
    assert not PYTHON_NAMES.search(json_terms("Something about `bytes` and `set`"))


def test_websocket_frame_errors_are_json_worded() -> None:
    session = Session(opened_at=0.0, max_age=3600.0, max_queued=8)
    for kind in (None, 5, [1, 2], {"a": None}, LONG):
        (action,) = session.receive(json.dumps({"type": kind}), 1.0)
        assert isinstance(action, SendError)
        msg = action.error.message
        assert not PYTHON_NAMES.search(msg) and len(msg) < 300, msg
    # (store: null is its default, true: the SDKs type it Optional[bool])
    (action,) = session.receive(json.dumps({"type": "response.create", "model": "m", "store": "yes"}), 1.0)
    assert isinstance(action, SendError) and action.error.param == "store"
    assert action.error.message == "Invalid type for 'store': expected a boolean or null, but got a string instead."
    (action,) = session.receive(json.dumps({"type": "response.create", "model": "m", "input": [{"role": "user", "content": None}]}), 1.0)
    assert isinstance(action, RunCreate)
    with pytest.raises(errors.InvalidType) as ei:
        validate(action.request, websocket=True)
    assert ei.value.param == "input[0].content"
    assert ei.value.message == "Invalid type for 'input[0].content': expected a string or an array, but got null instead."
