"""Request decoding and validation: every error names its param and uses the OpenAI shape."""

from __future__ import annotations

import json

import pytest

from hotloop import errors
from hotloop.protocol.request import (
    FunctionCall,
    FunctionCallOutput,
    InputImage,
    InputText,
    ItemReference,
    Message,
    OtherItem,
    Reasoning,
    decode_body,
    validate,
)


def prep(body: dict):
    return validate(decode_body(json.dumps(body)))


def err(body: dict | bytes) -> errors.HotloopError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(errors.HotloopError) as ei:
        validate(decode_body(raw))
    e = ei.value
    assert e.status == 400 and e.type == "invalid_request_error"
    return e


def test_string_input_is_one_user_message() -> None:
    p = prep({"model": "m", "input": "hi"})
    assert p.items == [Message(role="user", content=[InputText(text="hi")])]
    assert p.tool_choice == "auto" and p.parallel_tool_calls is True


def test_every_item_type_decodes() -> None:
    items = [
        {"role": "user", "content": "Hello"},
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Hi"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
            {"type": "input_file", "file_id": "file_1"},
        ]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Yo", "annotations": []}], "phase": "final"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "42"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}], "encrypted_content": "gAAA"},
        {"type": "item_reference", "id": "msg_0"},
        {"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": "*** Begin Patch"},
    ]
    p = prep({"model": "m", "input": items})
    kinds = [type(i) for i in p.items]
    assert kinds == [Message, Message, Message, Message, FunctionCall, FunctionCallOutput, FunctionCallOutput,
                     Reasoning, ItemReference, OtherItem]
    assert isinstance(p.items[2].content[1], InputImage)
    assert p.items[-1].data["name"] == "apply_patch"


def test_unknown_top_level_fields_ignored() -> None:
    p = prep({"model": "m", "input": "x", "generate": True, "client_metadata": {"a": "b"}, "brand_new": [1]})
    assert p.req.model == "m"


FN = {"type": "function", "name": "f"}


@pytest.mark.parametrize(
    "body,param,code",
    [
        (b"{oops", None, "invalid_json"),
        (b"[]", None, "invalid_json"),
        ({"input": "x"}, "model", "missing_required_parameter"),
        ({"model": "m"}, "input", "missing_required_parameter"),
        ({"model": 1, "input": "x"}, "model", "invalid_type"),
        ({"model": "m" * 257, "input": "x"}, "model", "invalid_value"),
        # a control character: in no model id; a tab had merged two ledger rows in Redis
        ({"model": "m\tx", "input": "x"}, "model", "invalid_value"),
        ({"model": "m\n", "input": "x"}, "model", "invalid_value"),
        ({"model": "m", "input": 5}, "input", "invalid_type"),
        ({"model": "m", "input": ["bare string"]}, "input[0]", "invalid_type"),
        ({"model": "m", "input": [{"content": "no role"}]}, "input[0].type", "missing_required_parameter"),
        ({"model": "m", "input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "invalid_value"),
        ({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "missing_required_parameter"),
        ({"model": "m", "input": "x", "temperature": 3}, "temperature", "invalid_value"),
        ({"model": "m", "input": "x", "top_p": -0.1}, "top_p", "invalid_value"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"model": "m", "input": "x", "truncation": "sometimes"}, "truncation", "invalid_value"),
        ({"model": "m", "input": "x", "prompt_cache_retention": "forever"}, "prompt_cache_retention", "invalid_value"),
        ({"model": "m", "input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
        ({"model": "m", "input": "x", "metadata": {"k": "v" * 513}}, "metadata.k", "invalid_value"),
        ({"model": "m", "input": "x", "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice", "invalid_value"),
        ({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "invalid_value"),
        ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "invalid_value"),
        ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name", "missing_required_parameter"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema", "missing_required_parameter"),
        ({"model": "m", "input": "x", "background": True}, "background", "unsupported_parameter"),
        ({"model": "m", "input": "x", "stream_id": ""}, "stream_id", "invalid_stream_id"),
        ({"model": "m", "input": "x", "stream_id": "lane\n"}, "stream_id", "invalid_stream_id"),
        ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f\n"}]}, "tools[0].name", "invalid_value"),
        # absent (or null) is missing; present with another type is a type error
        ({"model": "m", "input": "x", "tools": [{"type": 5}]}, "tools[0].type", "invalid_type"),
        ({"model": "m", "input": "x", "tools": [{"name": "f"}]}, "tools[0].type", "missing_required_parameter"),
        ({"model": "m", "input": "x", "tools": [FN], "tool_choice": {"type": "function", "name": 5}}, "tool_choice.name", "invalid_type"),
        ({"model": "m", "input": "x", "tools": [FN], "tool_choice": {"type": "function"}}, "tool_choice.name", "missing_required_parameter"),
        ({"model": "m", "input": "x", "tools": [FN], "tool_choice": {"type": None}}, "tool_choice.type", "missing_required_parameter"),
        ({"model": "m", "input": "x", "tools": [FN], "tool_choice": {"type": ["function"]}}, "tool_choice.type", "invalid_type"),
        # values that are not strings, not even hashable, where a name or an id is looked up
        ({"model": "m", "input": "x", "tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": [1]}]}}, "tool_choice.tools[0]", "invalid_value"),
        ({"model": "m", "input": "x", "tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": {"n": "f"}}]}}, "tool_choice.tools[0]", "invalid_value"),
        ({"model": "m", "input": [{"type": "custom_thing", "id": [1, 2]}]}, "input[0].id", "invalid_type"),
        ({"model": "m", "input": [{"type": "custom_thing", "id": {"a": 1}}]}, "input[0].id", "invalid_type"),
        ({"model": "m", "input": [{"type": "custom_thing", "id": 7}]}, "input[0].id", "invalid_type"),
    ],
)
def test_errors_name_their_param(body, param, code) -> None:
    e = err(body)
    assert e.param == param
    assert e.code == code
    assert set(e.body()) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "body, param, message",
    [
        (b'{"model":"m","input":"x","temperature":1e400}', "temperature", "Invalid value for 'temperature': the number is out of range."),
        (b'{"model":"m","input":"x","max_output_tokens":' + b"9" * 5000 + b"}", "max_output_tokens", "Invalid value for 'max_output_tokens': the number is out of range."),
        (b'{"model":"m","input":"x","max_output_tokens":' + b"9" * 400 + b"}", "max_output_tokens", "Invalid 'max_output_tokens': " + "9" * 30 + "... is out of range; it must be between 1 and 2147483647."),
        (b'{"model":"m","input":"x","max_tool_calls":2147483648}', "max_tool_calls", "Invalid 'max_tool_calls': 2147483648 is out of range; it must be between 1 and 2147483647."),
        # inside a free-form value the decoder names no key ("[...]"): the param names the value
        (b'{"model":"m","input":"x","tools":[{"type":"function","name":"f","parameters":{"type":"object","x":1e400}}]}', "tools[0]", "Invalid value for 'tools[0]': a number in it is out of range."),
        (b'{"model":"m","input":"x","metadata":{"k":1e400}}', "metadata", "Invalid value for 'metadata': a number in it is out of range."),
        (b'{"model":"m","input":[{"role":"user","content":"x","extra":1e400}]}', "input[0]", "Invalid value for 'input[0]': a number in it is out of range."),
        (b'{"model":"m","input":"x","tool_choice":{"type":"function","x":[1e400]}}', "tool_choice", "Invalid value for 'tool_choice': a number in it is out of range."),
    ],
)
def test_numbers_out_of_range_name_their_value_in_json_terms(body: bytes, param: str, message: str) -> None:
    e = err(body)
    assert (e.param, e.code, e.message) == (param, "invalid_value", message)


def test_unknown_tool_types_kept_until_forced() -> None:
    p = prep({"model": "m", "input": "x", "tools": [{"type": "web_search"}, {"type": "function", "name": "f"}]})
    assert list(p.function_tools) == ["f"] and len(p.tools) == 2
    e = err({"model": "m", "input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}})
    assert e.param == "tool_choice" and e.code == "unsupported_parameter"


def test_function_tool_strict_defaults_true() -> None:
    p = prep({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]})
    assert p.function_tools["f"].strict is True


def test_an_item_kept_verbatim_holds_a_bounded_number_of_values() -> None:
    """An item of a type hotloop keeps verbatim is walked by the classifiers and encoded for its
    fingerprint and the store: 8 MB of empty objects (2.7 million values) held the event loop for
    seconds. Above MAX_VERBATIM_VALUES it is a 400 naming the item, found with a bounded walk."""
    from hotloop.protocol.request import MAX_VERBATIM_VALUES, json_weight

    ok = {"type": "custom_tool_call_output", "call_id": "c", "output": [{} for _ in range(MAX_VERBATIM_VALUES // 2)]}
    assert type(prep({"model": "m", "input": [{"role": "user", "content": "hi"}, ok]}).items[1]) is OtherItem
    big = {"type": "x_blob", "data": [{} for _ in range(MAX_VERBATIM_VALUES + 10)]}
    e = err({"model": "m", "input": [{"role": "user", "content": "hi"}, big]})
    assert e.code == "invalid_value" and e.param == "input[1]" and "x_blob" in e.message
    # the walk: values (keys included) and, with chars, string lengths; it stops at its limit
    assert json_weight({"a": ["bc", 1, None]}, 100) == 1 + 1 + 1 + (1 + 2) + 1 + 1
    assert json_weight({"a": ["bc", 1, None]}, 100, chars=False) == 6
    assert json_weight([[]] * 10**6, 1000) == 1000
