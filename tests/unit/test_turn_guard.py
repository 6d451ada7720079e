"""The size guard's measure (hotloop.pipeline.guard): each item's compact JSON, counted until
the limit is passed, and the two limits' boundaries."""

from __future__ import annotations

import msgspec
import pytest

from hotloop.pipeline import guard
from hotloop.protocol.request import (
    FunctionCall, FunctionCallOutput, InputImage, InputText, ItemReference, Message, OtherItem, Reasoning,
)

ITEMS = [
    Message(role="user", content=[InputText(text="héllo wörld ✓"), InputImage(image_url="data:image/png;base64,AAAA")]),
    FunctionCall(call_id="c1", name="sh", arguments='{"cmd": "ls"}'),
    FunctionCallOutput(call_id="c1", output="x" * 2000),
    OtherItem(type="custom_tool_call", data={"type": "custom_tool_call", "input": "patch", "call_id": "c2"}),
]


def test_bytes_are_each_items_compact_json_in_utf8() -> None:
    expected = sum(len(msgspec.json.encode(it)) for it in ITEMS)
    assert guard.input_bytes(ITEMS) == expected
    assert expected > sum(len(msgspec.json.encode(it).decode()) for it in ITEMS)  # UTF-8 bytes, not characters


def test_counting_stops_once_the_limit_is_passed() -> None:
    first = len(msgspec.json.encode(ITEMS[0]))
    assert guard.input_bytes(ITEMS, limit=first - 1) == first  # stopped after the first item
    assert guard.input_bytes(ITEMS, limit=10**9) == guard.input_bytes(ITEMS)


def test_the_limits_are_inclusive() -> None:
    n = guard.input_bytes(ITEMS)
    guard.check(ITEMS, max_items=len(ITEMS), max_bytes=n)
    with pytest.raises(guard.InputTooLarge) as info:
        guard.check(ITEMS, max_items=len(ITEMS) - 1, max_bytes=n)
    assert (info.value.status, info.value.code, info.value.param) == (400, "input_too_large", "input")
    assert f"at most {len(ITEMS) - 1} new items" in info.value.message
    with pytest.raises(guard.InputTooLarge) as info:
        guard.check(ITEMS, max_items=len(ITEMS), max_bytes=n - 1)
    assert info.value.body() == {
        "message": info.value.message, "type": "invalid_request_error", "param": "input", "code": "input_too_large",
    }
    assert f"the {n - 1} bytes" in info.value.message


def test_a_turn_starts_after_the_last_item_a_model_produced() -> None:
    user = Message(role="user", content="go")
    out = FunctionCallOutput(call_id="c1", output="ok")
    assert guard.turn_start([user, user]) == 0  # a first turn: all of it
    assert guard.turn_start([user, Message(role="assistant", content="hi"), user]) == 2
    assert guard.turn_start([user, Message(role="developer", content="be brief"), user]) == 0
    assert guard.turn_start(ITEMS) == 4  # a custom tool call, last: nothing after it
    assert guard.turn_start(ITEMS[:3]) == 2  # after the function call: its output
    assert guard.turn_start([user, Reasoning(summary=[]), out]) == 2
    other = OtherItem(type="custom_tool_call_output", data={"type": "custom_tool_call_output", "call_id": "c2", "output": "x"})
    assert guard.turn_start([*ITEMS, other, user]) == 4  # a tool's output is the client's
    assert guard.turn_start([{"type": "message", "role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]) == 1
    assert guard.turn_start([{"type": "local_shell_call"}, {"type": "local_shell_call_output"}]) == 1
    # a stored item named by reference (how the Vercel AI SDK sends a model's earlier output)
    assert guard.turn_start([user, ItemReference(id="msg_0123"), user]) == 2
    assert guard.turn_start([{"role": "user", "content": "a"}, {"type": "item_reference", "id": "fc_1"}, out]) == 2
