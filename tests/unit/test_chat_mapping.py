"""Responses <-> chat completions mapping (hotloop.backends.chat), sans-I/O."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from hotloop import errors
from hotloop.backends.base import BackendRequest
from hotloop.backends.chat import (
    CEREBRAS,
    OPENAI_COMPAT,
    ChatChunk,
    ChunkAssembler,
    RenderCache,
    TransientBackendError,
    encode_request,
    render,
    retry_after,
    status_error,
)
from hotloop.protocol.chunks import Finish, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from hotloop.protocol.events import ws_error
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import (
    FunctionTool,
    Item,
    TextFormat,
    decode_body,
    decode_items,
    validate,
)
from hotloop.protocol.turn import Turn

DIALECTS = [CEREBRAS, OPENAI_COMPAT]

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def items(raw: list[dict[str, Any]]) -> list[Item]:
    return decode_items(raw)


def request(raw_items: list[dict[str, Any]] | str = "hi", **kw: Any) -> BackendRequest:
    base: dict[str, Any] = {
        "model": "gpt-oss-120b",
        "instructions": None,
        "items": items(raw_items) if isinstance(raw_items, list) else decode_items(raw_items),
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
    }
    base.update(kw)
    return BackendRequest(**base)


def tool(name: str, **kw: Any) -> FunctionTool:
    return FunctionTool(name=name, parameters={"type": "object", "properties": {"q": {"type": "string"}}}, **kw)


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def fcall(call_id: str, name: str = "search", args: str = '{"q":"x"}') -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": args}


def fout(call_id: str, output: str = "result") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def reasoning(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict[str, Any] | None = None) -> ChatChunk:
    obj: dict[str, Any] = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return msgspec.json.decode(json.dumps(obj), type=ChatChunk)


def tc(index: int | None, *, id: str | None = None, name: str | None = None, args: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if index is not None:
        d["index"] = index
    if id is not None:
        d["id"] = id
    fn: dict[str, Any] = {}
    if name is not None:
        fn["name"] = name
    if args is not None:
        fn["arguments"] = args
    d["function"] = fn
    return {"tool_calls": [d]}


def assemble(chunks: list[ChatChunk]) -> list[Any]:
    a = ChunkAssembler()
    out: list[Any] = []
    for c in chunks:
        out += a.feed(c)
    return out + a.end()


def through_turn(chunks: list[Any]) -> dict[str, Any]:
    """Feed assembled chunks to the real turn machine (raises TurnStateError on a contract break)."""
    p = validate(decode_body(json.dumps({"model": "m", "input": "hi"})))
    ids = IdGen(deterministic=True)
    turn = Turn(response_object(p, ids.new("resp"), 1000), ids=ids, clock=lambda: 1001.0)
    turn.start()
    for c in chunks:
        turn.feed(c)
    assert turn.done
    return turn.response


def calls_of(response: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(o["call_id"], o["name"], o["arguments"]) for o in response["output"] if o["type"] == "function_call"]


# ---------------------------------------------------------------------------------------------
# rendering messages
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_roles_and_text(dialect) -> None:
    req = request(
        [
            {"type": "message", "role": "system", "content": "sys"},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
            {"role": "user", "content": "plain"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}, {"type": "output_text", "text": "y"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        ],
        instructions="be brief",
    )
    msgs = render(req, dialect)["messages"]
    assert msgs == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "sys"},
        {"role": dialect.developer_role, "content": "dev"},
        {"role": "user", "content": "plain"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "xy"},
        {"role": "assistant", "content": "no"},
    ]
    assert CEREBRAS.developer_role == "developer" and OPENAI_COMPAT.developer_role == "system"


def test_images() -> None:
    parts = [{"type": "input_text", "text": "what is this"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}]
    req = request([{"type": "message", "role": "user", "content": parts}])
    assert render(req, OPENAI_COMPAT)["messages"][0]["content"] == [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
    ]
    with pytest.raises(errors.UnsupportedParameter) as ei:
        render(req, CEREBRAS)
    assert ei.value.status == 400 and "cerebras" in ei.value.message and "image" in ei.value.message.lower()
    files = request([{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}])
    for d in DIALECTS:
        with pytest.raises(errors.UnsupportedParameter):
            render(files, d)
    img_out = request([fcall("c1"), {"type": "function_call_output", "call_id": "c1", "output": [parts[1]]}])
    with pytest.raises(errors.UnsupportedParameter):
        render(img_out, CEREBRAS)  # a backend that reads no images: refused wherever they are
    file_out = request([fcall("c1"), {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_file", "file_id": "f"}]}])
    with pytest.raises(errors.UnsupportedParameter):
        render(file_out, OPENAI_COMPAT)


def test_images_in_tool_outputs_follow_the_turns_tool_messages() -> None:
    """A tool's output with images (Codex's view_image, an AI SDK tool result): a chat tool
    message holds text only, so its images follow the turn's tool messages as a user message
    naming the call; the results of the turn's calls stay right after them."""
    png = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}
    jpg = {"type": "input_image", "image_url": "https://example.com/b.jpg", "detail": "high"}
    req = request(
        [
            user("look at these"),
            fcall("c1"),
            fcall("c2"),
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "a.png:"}, png]},
            {"type": "function_call_output", "call_id": "c2", "output": [jpg]},
            assistant("two images"),
        ]
    )
    msgs = render(req, OPENAI_COMPAT)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "user", "user", "assistant"]
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": "a.png:"}
    assert msgs[3] == {"role": "tool", "tool_call_id": "c2", "content": ""}
    assert msgs[4] == {"role": "user", "content": [
        {"type": "text", "text": "Images from the output of tool call c1:"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "auto"}},
    ]}
    assert msgs[5]["content"][1] == {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg", "detail": "high"}}
    # the request's last items: the images end it (what the model answers next)
    tail = request([user("go"), fcall("c1"), {"type": "function_call_output", "call_id": "c1", "output": [png]}])
    assert [m["role"] for m in render(tail, OPENAI_COMPAT)["messages"]] == ["user", "assistant", "tool", "user"]
    # the cached rendering of a conversation extended turn by turn gives the same bytes (one
    # that ends with images is not kept: the next outputs would go before them; the longer
    # conversation is rendered whole, and starts with the same bytes)
    cache = RenderCache(OPENAI_COMPAT)
    items = list(tail.items)
    first = cache.render(items)
    longer = items + list(request([assistant("seen"), user("and now")]).items)
    assert b"".join(first) == b"".join(cache.render(items))
    assert b"".join(cache.render(longer)).startswith(b"".join(first) + b",")


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_text_after_calls_joins_the_message_that_holds_them(dialect) -> None:
    """hotloop's own output can be [function_call, message] (text that came while a call was
    open), or text between calls: rendered as an assistant message after the one with the
    calls, the calls' results no longer followed them, which strict chat servers refuse."""
    req = request(
        [
            user("find"),
            assistant("Let me look."),
            fcall("call_a"),
            assistant("Looking it up."),
            fcall("call_b"),
            {"type": "custom_tool_call", "call_id": "k", "name": "patch", "input": "x"},
            fout("call_a", "A"),
            fout("call_b", "B"),
            fcall("call_c"),
            assistant("And this."),
            fout("call_c", "C"),
        ]
    )
    msgs = render(req, dialect)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant", "tool"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["call_a", "call_b"]
    assert msgs[1]["content"].startswith("Let me look.\n\nLooking it up.\n\n{") and "custom_tool_call" in msgs[1]["content"]
    assert msgs[4]["content"] == "And this." and [c["id"] for c in msgs[4]["tool_calls"]] == ["call_c"]


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_function_calls_merge_and_outputs_match(dialect) -> None:
    req = request(
        [
            user("find"),
            assistant("Let me look."),
            fcall("call_a", args='{"q":"a"}'),
            fcall("call_b", args='{"q":"b"}'),
            fout("call_a", "A"),
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "B1"}, {"type": "input_text", "text": "B2"}]},
            fcall("call_c"),
            fcall("call_d"),
            fout("call_c"),
            fout("call_d"),
            assistant("done"),
        ]
    )
    msgs = render(req, dialect)["messages"]
    assert msgs[1] == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "search", "arguments": '{"q":"a"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "search", "arguments": '{"q":"b"}'}},
        ],
    }
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_a", "content": "A"}
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_b", "content": "B1B2"}
    # calls without a preceding text message: one assistant message, no content key
    assert msgs[4] == {
        "role": "assistant",
        "tool_calls": [
            {"id": "call_c", "type": "function", "function": {"name": "search", "arguments": '{"q":"x"}'}},
            {"id": "call_d", "type": "function", "function": {"name": "search", "arguments": '{"q":"x"}'}},
        ],
    }
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant", "tool", "tool", "assistant"]
    # every tool message answers a call of the assistant message before it
    ids = {c["id"] for m in msgs if m["role"] == "assistant" for c in m.get("tool_calls", [])}
    assert {m["tool_call_id"] for m in msgs if m["role"] == "tool"} == ids


def test_reasoning_history() -> None:
    req = request([user("q"), reasoning("think "), reasoning("more"), fcall("c1"), fout("c1"), reasoning("again"), assistant("answer"), user("next"), reasoning("orphan"), user("x")])
    cb = render(req, CEREBRAS)["messages"]
    assert cb[1] == {"role": "assistant", "reasoning": "think more", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q":"x"}'}}]}
    assert cb[3] == {"role": "assistant", "content": "answer", "reasoning": "again"}
    assert all("orphan" not in json.dumps(m) for m in cb)
    oc = render(req, OPENAI_COMPAT)["messages"]
    assert all("reasoning" not in m for m in oc)
    assert [m["role"] for m in oc] == [m["role"] for m in cb]


def test_other_items_are_rendered_as_json_text() -> None:
    raw = [
        user("patch it"),
        {"type": "custom_tool_call", "call_id": "ct1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "ct1", "output": "ok"},
    ]
    msgs = render(request(raw), CEREBRAS)["messages"]
    assert msgs[1]["role"] == "assistant" and json.loads(msgs[1]["content"]) == raw[1]
    assert msgs[2]["role"] == "user" and json.loads(msgs[2]["content"]) == raw[2]
    # the item's own key order is kept (stable as long as the item is)
    assert msgs[1]["content"].startswith('{"type":"custom_tool_call","call_id":"ct1"')


# ---------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------


def test_tools_and_settings() -> None:
    tools = [
        FunctionTool(name="search", description="Search.", parameters={"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": False}),
        FunctionTool(name="noargs", strict=False),
    ]
    req = request(
        tools=tools,
        parallel_tool_calls=False,
        max_output_tokens=256,
        temperature=0.2,
        top_p=0.9,
        reasoning_effort="minimal",
        prompt_cache_key="agent-7",
        service_tier="flex",
        user="u1",
        metadata={"sim": "x"},
    )
    cb = render(req, CEREBRAS)
    assert cb["tools"] == [
        {"type": "function", "function": {"name": "search", "description": "Search.", "parameters": tools[0].parameters, "strict": True}},
        {
            "type": "function",
            "function": {
                "name": "noargs", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}, "strict": False,
            },
        },
    ]
    assert "tool_choice" not in cb  # auto is the default
    assert cb["parallel_tool_calls"] is False
    assert cb["max_completion_tokens"] == 256 and "max_tokens" not in cb
    assert cb["reasoning_effort"] == "low"
    assert (cb["temperature"], cb["top_p"], cb["prompt_cache_key"], cb["service_tier"], cb["user"]) == (0.2, 0.9, "agent-7", "flex", "u1")
    assert cb["stream"] is True and cb["stream_options"] == {"include_usage": True}
    assert "metadata" not in cb
    oc = render(req, OPENAI_COMPAT)
    assert oc["max_tokens"] == 256 and "max_completion_tokens" not in oc
    assert "service_tier" not in oc
    assert render(request(reasoning_effort="xhigh"), CEREBRAS)["reasoning_effort"] == "high"
    assert render(request(reasoning_effort="max"), CEREBRAS)["reasoning_effort"] == "high"
    assert render(request(reasoning_effort="medium"), CEREBRAS)["reasoning_effort"] == "medium"
    assert "service_tier" not in render(request(service_tier="scale"), CEREBRAS)
    bare = render(request(), CEREBRAS)
    assert list(bare) == ["model", "messages", "stream", "stream_options"]


def test_tool_choice_forms() -> None:
    tools = [tool("a"), tool("b"), tool("c")]

    def r(choice: Any, dialect=CEREBRAS) -> dict[str, Any]:
        return render(request(tools=tools, tool_choice=choice), dialect)

    assert r("none")["tool_choice"] == "none" and len(r("none")["tools"]) == 3
    assert r("required")["tool_choice"] == "required"
    # named function: emulated on Cerebras, native elsewhere
    named = r({"type": "function", "name": "b"})
    assert [t["function"]["name"] for t in named["tools"]] == ["b"] and named["tool_choice"] == "required"
    native = r({"type": "function", "name": "b"}, OPENAI_COMPAT)
    assert len(native["tools"]) == 3 and native["tool_choice"] == {"type": "function", "function": {"name": "b"}}
    # allowed_tools: filtered, order of the tools list kept, mode passed on
    for d in DIALECTS:
        allowed = r({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "c"}, {"type": "function", "name": "a"}]}, d)
        assert [t["function"]["name"] for t in allowed["tools"]] == ["a", "c"] and allowed["tool_choice"] == "required"
        auto = r({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "b"}]}, d)
        assert [t["function"]["name"] for t in auto["tools"]] == ["b"] and "tool_choice" not in auto
    hosted_only = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]}
    with pytest.raises(errors.UnsupportedParameter):
        r(hosted_only)
    # no tools: no tool fields at all
    assert "tool_choice" not in render(request(tool_choice="none"), CEREBRAS)


def test_response_formats() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = TextFormat(type="json_schema", name="answer", schema=schema, strict=True)
    assert render(request(text_format=fmt), CEREBRAS)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    described = TextFormat(type="json_schema", name="answer", schema=schema, description="An answer.")
    assert render(request(text_format=described), OPENAI_COMPAT)["response_format"]["json_schema"] == {
        "name": "answer", "description": "An answer.", "schema": schema,
    }
    assert render(request(text_format=TextFormat(type="json_object")), CEREBRAS)["response_format"] == {"type": "json_object"}
    assert "response_format" not in render(request(text_format=TextFormat(type="text")), CEREBRAS)


def test_byte_stable_rendering() -> None:
    history = [
        user("hello"),
        reasoning("plan"),
        assistant("hi"),
        fcall("c1", args='{"q":"\\u00e9t\\u00e9 ok"}'),
        fout("c1", "été"),
        {"type": "custom_tool_call", "name": "x", "call_id": "z", "input": "y"},
    ]
    tools = [tool("search", description="d")]
    a = encode_request(request(json.loads(json.dumps(history)), tools=tools, instructions="sys"), CEREBRAS)
    b = encode_request(request(json.loads(json.dumps(history)), tools=[tool("search", description="d")], instructions="sys"), CEREBRAS)
    assert a == b
    # the next turn renders the earlier messages byte for byte, then the new ones
    longer = encode_request(request(history + [user("more")], tools=tools, instructions="sys"), CEREBRAS)
    msgs_a = json.dumps(json.loads(a)["messages"], separators=(",", ":"), ensure_ascii=False)
    prefix = msgs_a[:-1]  # drop the closing bracket
    assert longer.decode().find('"messages":' + prefix + ",") != -1
    assert b'"model":"gpt-oss-120b","messages":[' in a[:40]


# ---------------------------------------------------------------------------------------------
# assembling the stream
# ---------------------------------------------------------------------------------------------


def test_text_reasoning_usage_finish() -> None:
    out = assemble(
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning": "hm"}),
            chunk({"reasoning_content": "m"}),
            chunk({"content": "Hel"}),
            chunk({"content": "lo"}),
            chunk({}, "stop"),
            msgspec.json.decode(
                json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 2}}}),
                type=ChatChunk,
            ),
        ]
    )
    assert out == [
        ReasoningDelta("hm"),
        ReasoningDelta("m"),
        TextDelta("Hel"),
        TextDelta("lo"),
        Usage(input_tokens=9, output_tokens=5, cached_tokens=4, reasoning_tokens=2),
        Finish("stop"),
    ]
    assert assemble([chunk({"content": "x"}, "length")])[-1] == Finish("length")
    # a usage chunk whose choices are null, or absent, as some servers send it
    for extra in ({"choices": None}, {}):
        raw = json.dumps({**extra, "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
        tail = assemble([chunk({"content": "x"}, "stop"), msgspec.json.decode(raw, type=ChatChunk)])
        assert tail == [TextDelta("x"), Usage(input_tokens=3, output_tokens=1), Finish("stop")]
    assert assemble([chunk({}, "function_call")])[-1] == Finish("tool_calls")
    assert assemble([chunk({}, "weird")])[-1] == Finish("stop")


def test_sequential_calls_stream_live() -> None:
    a = ChunkAssembler()
    first = a.feed(chunk(tc(0, id="call_1", name="search", args="")))
    assert first == [ToolCallDelta(0, "", "call_1", "search")]
    assert a.feed(chunk(tc(0, args='{"q":'))) == [ToolCallDelta(0, '{"q":')]
    assert a.feed(chunk(tc(0, args='"a"}'))) == [ToolCallDelta(0, '"a"}')]
    # call 0 is complete JSON: call 1 opens at once
    assert a.feed(chunk(tc(1, id="call_2", name="search", args='{"q"'))) == [ToolCallDelta(1, '{"q"', "call_2", "search")]
    assert a.feed(chunk(tc(1, args=':"b"}'))) == [ToolCallDelta(1, ':"b"}')]
    end = a.end()
    assert end == [Finish("stop")]
    resp = through_turn([*first, ToolCallDelta(0, '{"q":'), ToolCallDelta(0, '"a"}'), ToolCallDelta(1, '{"q"', "call_2", "search"), ToolCallDelta(1, ':"b"}'), *end])
    assert calls_of(resp) == [("call_1", "search", '{"q":"a"}'), ("call_2", "search", '{"q":"b"}')]


def test_arguments_only_in_final_chunk() -> None:
    chunks = [
        chunk(tc(0, id="call_1", name="a")),
        chunk(tc(1, id="call_2", name="b")),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":1}'}}, {"index": 1, "function": {"arguments": '{"y":2}'}}]}, "tool_calls"),
    ]
    out = assemble(chunks)
    resp = through_turn(out)
    assert calls_of(resp) == [("call_1", "a", '{"x":1}'), ("call_2", "b", '{"y":2}')]
    # the first call streamed live, the second waited for the end
    assert out[0] == ToolCallDelta(0, "", "call_1", "a")


def test_name_in_a_later_chunk() -> None:
    a = ChunkAssembler()
    assert a.feed(chunk(tc(0, id="call_1"))) == []
    assert a.feed(chunk(tc(0, args='{"q":'))) == []
    assert a.feed(chunk(tc(0, name="search", args='"z"'))) == [ToolCallDelta(0, '{"q":"z"', "call_1", "search")]
    assert a.feed(chunk(tc(0, name="search", args="}"))) == [ToolCallDelta(0, "}")]  # repeated name ignored
    resp = through_turn([ToolCallDelta(0, '{"q":"z"', "call_1", "search"), ToolCallDelta(0, "}"), *a.end()])
    assert calls_of(resp) == [("call_1", "search", '{"q":"z"}')]


def test_the_buffered_bound_counts_what_is_held_now_not_all_ever_held() -> None:
    """Arguments that come before their call's name are held until it comes; the 16 MiB bound
    counted every byte ever held in the response, so 20 calls of 1 MiB, each held a moment,
    failed a sound stream."""
    from hotloop.backends.chat.assemble import MAX_BUFFERED_BYTES

    a = ChunkAssembler()
    n = 20
    big = '{"a":"' + "x" * (1 << 20) + '"}'
    assert n * len(big) > MAX_BUFFERED_BYTES
    for i in range(n):
        a.feed(chunk(tc(i, args=big)))  # held: no name yet
        a.feed(chunk(tc(i, id=f"c{i}", name="f")))  # opened: what it held goes out
    out = a.feed(chunk({}, "tool_calls")) + a.end()
    assert sum(1 for c in out if isinstance(c, Finish)) == 1


def test_interleaved_indices_are_buffered_in_order() -> None:
    chunks = [
        chunk({"content": "Checking."}),
        chunk(tc(0, id="c0", name="a", args='{"k":')),
        chunk(tc(1, id="c1", name="b", args='{"m":')),
        chunk(tc(0, args='"v0"}')),
        chunk({"content": " more text"}),
        chunk(tc(2, id="c2", name="c", args="{}")),
        chunk(tc(1, args='"v1"}')),
        chunk({}, "tool_calls"),
    ]
    out = assemble(chunks)
    resp = through_turn(out)  # no TurnStateError
    assert calls_of(resp) == [("c0", "a", '{"k":"v0"}'), ("c1", "b", '{"m":"v1"}'), ("c2", "c", "{}")]
    texts = [o["content"][0]["text"] for o in resp["output"] if o["type"] == "message"]
    assert texts == ["Checking.", " more text"]
    assert [o["type"] for o in resp["output"]] == ["message", "function_call", "function_call", "message", "function_call"]
    indices = [c.index for c in out if isinstance(c, ToolCallDelta)]
    assert indices == sorted(indices)


@pytest.mark.parametrize("whole_first", [False, True])
def test_interleaved_calls_cut_by_a_token_limit_end_incomplete(whole_first: bool) -> None:
    """Two calls whose arguments interleave, then ``finish_reason: "length"``: each call whose
    arguments are not whole ends ``incomplete`` (the first was closed ``completed`` by the
    second's opening, with arguments no client can run); one that was whole stays completed."""
    first = '{"path":"/tmp/x"}' if whole_first else '{"path":"/tmp/x","mode"'
    chunks = [
        chunk(tc(0, id="call_a", name="f", args="")),
        chunk(tc(1, id="call_b", name="g", args="")),
        chunk(tc(0, args=first[:9])),
        chunk(tc(1, args='{"q":"hel')),
        chunk(tc(0, args=first[9:])),
        chunk({}, "length"),
    ]
    resp = through_turn(assemble(chunks))
    assert resp["status"] == "incomplete"
    calls = [(o["call_id"], o["status"], o["arguments"]) for o in resp["output"]]
    assert calls == [("call_a", "completed" if whole_first else "incomplete", first), ("call_b", "incomplete", '{"q":"hel')]


def test_text_after_an_unfinished_call_waits() -> None:
    a = ChunkAssembler()
    assert a.feed(chunk(tc(0, id="c0", name="a", args='{"k"'))) == [ToolCallDelta(0, '{"k"', "c0", "a")]
    assert a.feed(chunk({"content": "hmm"})) == []
    assert a.feed(chunk(tc(0, args=':1}'))) == [ToolCallDelta(0, ":1}")]
    assert a.end() == [TextDelta("hmm"), Finish("stop")]


def test_missing_index_and_missing_name() -> None:
    out = assemble([chunk(tc(None, id="c0", name="a", args='{"a":')), chunk(tc(None, args="1}")), chunk(tc(None, id="c1", name="b", args="{}"))])
    assert calls_of(through_turn(out)) == [("c0", "a", '{"a":1}'), ("c1", "b", "{}")]
    with pytest.raises(errors.BackendError):
        assemble([chunk(tc(0, id="c0", args="{}"))])


def test_sealed_call_rejects_more_arguments() -> None:
    a = ChunkAssembler()
    a.feed(chunk(tc(0, id="c0", name="a", args="{}")))
    a.feed(chunk({"content": "x"}))  # seals call 0
    assert a.feed(chunk(tc(0, args="  "))) == []  # whitespace is harmless
    with pytest.raises(errors.BackendError):
        a.feed(chunk(tc(0, args="oops")))


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_retry_after_headers() -> None:
    assert retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after({"retry-after": "3"}) == 3.0
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:05 GMT"}, now=1445412480.0) == pytest.approx(5.0)
    assert retry_after({"x-ratelimit-reset-tokens-minute": "12.5", "x-ratelimit-reset-requests-day": "40000"}) == 12.5
    exhausted = {
        "x-ratelimit-reset-tokens-minute": "12.5",
        "x-ratelimit-remaining-tokens-minute": "3000",
        "x-ratelimit-reset-requests-day": "400.0",
        "x-ratelimit-remaining-requests-day": "0",
    }
    assert retry_after(exhausted) == 400.0
    assert retry_after({"x-ratelimit-reset-tokens": "1m30s"}) == 90.0
    assert retry_after({"x-ratelimit-reset-requests": "250ms"}) == 0.25
    assert retry_after({"retry-after": "soon"}) is None
    assert retry_after({}) is None
    # at most a day, however far off the backend says (it became a 302-digit header)
    day = 86400.0
    assert retry_after({"retry-after-ms": "1e305"}) == day
    assert retry_after({"retry-after": "Tue, 31 Dec 9999 23:59:59 GMT"}) == day
    assert retry_after({"x-ratelimit-reset-requests-day": "9e99"}) == day
    assert retry_after({"x-ratelimit-reset-requests-day": "9e99", "x-ratelimit-remaining-requests-day": "0"}) == day
    unavailable = status_error(503, {"retry-after": "99999999"}, {"message": "busy"}, backend="test", model="m1")
    assert unavailable.headers["retry-after"] == "86400", unavailable.headers


def test_status_errors() -> None:
    def err(status: int, body: Any, headers: dict[str, str] | None = None) -> errors.HotloopError:
        return status_error(status, headers or {}, body, backend="test", model="m1")

    rl = err(429, {"message": "Too many tokens"}, {"retry-after": "2", "x-ratelimit-reset-tokens-minute": "2.5", "x-request-id": "abc"})
    assert isinstance(rl, errors.RateLimited) and rl.status == 429 and rl.code == "rate_limit_exceeded"
    assert rl.retry_after == 2.0 and rl.headers["retry-after"] == "2"
    # the backend's x-ratelimit-* headers describe hotloop's own account: neither on the HTTP 429
    # nor in a WebSocket error frame
    assert not [h for h in rl.headers if h.startswith("x-ratelimit-")]
    assert b"x-ratelimit" not in ws_error(rl)[1] and b'"retry-after":"2"' in ws_error(rl)[1]
    rl = err(429, {"message": "Too many tokens"}, {"x-ratelimit-reset-tokens-minute": "2.5", "x-ratelimit-remaining-tokens-minute": "0"})
    assert rl.retry_after == 2.5 and rl.headers == {"retry-after": "3", "retry-after-ms": "2500"}  # delta-seconds: whole
    big = err(429, {}, {"retry-after": "2299690000"})
    assert big.headers == {"retry-after": "86400", "retry-after-ms": "86400000"}  # at most a day; never 2.29969e+09
    assert "x-request-id" not in rl.headers and "Too many tokens" not in rl.message
    ctx = err(400, {"message": "Please reduce the length of the messages or completion.", "type": "invalid_request_error", "code": "context_length_exceeded"})
    assert isinstance(ctx, errors.ContextLengthExceeded) and ctx.code == "context_length_exceeded" and ctx.status == 400
    assert isinstance(err(400, {"error": {"message": "This model's maximum context length is 8192 tokens."}}), errors.ContextLengthExceeded)
    # llama.cpp's server: an integer code, its kind as the type
    llama = err(400, {"error": {"code": 400, "message": "request (4476 tokens) exceeds the available context size (4096 tokens)",
                                "type": "exceed_context_size_error", "n_prompt_tokens": 4476, "n_ctx": 4096}})
    assert isinstance(llama, errors.ContextLengthExceeded) and llama.param == "input"
    assert isinstance(err(400, {"error": {"code": 400, "message": "too big", "type": "exceed_context_size_error"}}), errors.ContextLengthExceeded)
    vllm = "The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make sure that `max_model_len` is no smaller than the number of text tokens."
    assert isinstance(err(400, {"object": "error", "message": vllm, "type": "BadRequestError", "code": 400}), errors.ContextLengthExceeded)
    # a long delay reads as Codex parses it ("try again in Ns"), not as 3.6e+03s
    assert "Please try again in 3600s." in err(429, {}, {"retry-after": "3600"}).message
    assert "Please try again in 1.5s." in err(429, {}, {"retry-after": "1.5"}).message
    bad = err(400, {"error": {"message": "tools[0]: bad\x00 schema", "type": "invalid_request_error"}})
    assert type(bad) is errors.InvalidRequest and bad.message == "The model backend rejected the request: tools[0]: bad  schema"
    long = err(422, {"message": "x" * 5000})
    assert type(long) is errors.InvalidRequest and len(long.message) < 400
    auth = err(401, {"message": "Wrong API Key sk-secret"})
    assert type(auth) is errors.BackendError and auth.status == 502 and "sk-secret" not in auth.message
    assert type(err(403, "forbidden")) is errors.BackendError
    assert isinstance(err(404, {"message": "Model m1 does not exist"}), errors.ModelNotFound)
    assert type(err(404, "<html>nope</html>")) is errors.BackendError
    assert isinstance(err(500, "boom"), TransientBackendError) and err(500, "boom").status == 502
    assert isinstance(err(503, None), errors.BackendUnavailable)
    assert isinstance(err(504, None), errors.BackendTimeout)
    for e in (err(500, {"message": "internal trace at /srv/x.py"}), err(503, "db down")):
        assert "/srv" not in e.message and "db down" not in e.message


def test_a_backend_400_shows_its_json_message_without_internals_or_credentials(caplog) -> None:  # noqa: ANN001
    """Of a backend's 400, a client sees the message of a JSON error object only: not a body
    that is text or HTML, not a traceback, and never a credential (the backends' own keys, and
    whatever the secret scanner knows), which the server's log does not show either."""
    from hotloop.backends.chat.statuses import _WITHHELD, status_error, withhold

    def err(status: int, body: object) -> errors.HotloopError:
        return status_error(status, {}, body, backend="b", model="m")

    own = "sk-backendSECRET-abcdef123456"
    withhold(own)
    try:
        for body in (
            "<html>Traceback (most recent call last): secret</html>",
            "plain text from a proxy",
            {"error": {"message": "Traceback (most recent call last):\n  File /opt/x.py"}},
            {"error": {"message": "<HTML><body>bad gateway</body></HTML>"}},
            # a server's internals without a traceback's first line: a frame, a path, a class
            {"error": {"message": '1 validation error for ChatCompletionRequest input_type=NoneType] File "/srv/vllm/entrypoints/openai/protocol.py", line 312'}},
            {"error": {"message": "sqlite3.OperationalError: no such table: quotas (/var/lib/gw/gw.db)"}},
            {"error": {"message": "AttributeError: 'dict' object has no attribute 'get'"}},
            {"message": "KeyError: 'model' in handler.py:12"},
        ):
            e = err(400, body)
            assert type(e) is errors.InvalidRequest and e.message == "The model backend rejected the request."
        # what tells the client what to fix still shows
        for shown in ("Unsupported value: 'temperature' must be at most 2.",
                      "max_tokens must be at least 1, got 0.", "Error: the model gpt-x does not exist"):
            assert err(400, {"error": {"message": shown}}).message == f"The model backend rejected the request: {shown}"
        ghp = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
        with caplog.at_level("WARNING", logger="hotloop.backends"):
            e = err(400, {"error": {"message": f"bad key {own} near {ghp} in tools[0]"}})
        assert e.message == "The model backend rejected the request: bad key [REDACTED] near [REDACTED:github_token] in tools[0]"
        assert own not in caplog.text and ghp not in caplog.text and "[REDACTED]" in caplog.text
        for status in (413, 422):
            assert own not in err(status, {"message": own}).message
    finally:
        _WITHHELD.discard(own)


# ---------------------------------------------------------------------------------------------
# incremental rendering (RenderCache) gives the same bytes as rendering from scratch
# ---------------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_a_message_between_calls_and_their_outputs_goes_after_the_outputs(dialect) -> None:
    """A steer's successor has its steering input before the outputs of the parent's calls
    (prepended, as ``response.steer.pending`` says); a chat server wants the tool messages right
    after the assistant message with ``tool_calls`` (OpenAI refuses anything between): the
    message goes after the outputs, whether the turn is rendered whole or continues a cached
    rendering; a message no output follows stays where it is."""
    first = items([user("weather?"), fcall("call_1"), fcall("call_2")])
    steered = first + items([user("Use Celsius please."), fout("call_1", "21C"), fout("call_2", "18C"), user("and?")])
    cache = RenderCache(dialect)
    for conversation in (first, steered):
        req = msgspec.structs.replace(request([]), items=conversation)
        assert encode_request(req, dialect, cache) == encode_request(req, dialect)
    assert cache.hits == 1
    msgs = render(msgspec.structs.replace(request([]), items=steered), dialect)["messages"]
    assert [(m["role"], m.get("content")) for m in msgs] == [
        ("user", "weather?"), ("assistant", None), ("tool", "21C"), ("tool", "18C"),
        ("user", "Use Celsius please."), ("user", "and?")]
    # no output follows: as it was sent (a strict server refuses it, as it would have)
    alone = render(msgspec.structs.replace(request([]), items=items([user("q"), fcall("call_1"), user("stop")])), dialect)
    assert [m["role"] for m in alone["messages"]] == ["user", "assistant", "user"]


def test_a_cached_rendering_ending_with_a_tool_outputs_images_gives_the_same_bytes() -> None:
    """The images of a tool's output go after the run of tool messages they came in; a cached
    rendering that ended with them was extended with the next outputs after the images, where a
    full rendering puts those outputs before them (a turn with no output between, such as a
    ``generate: false`` warm-up). Such a rendering is not kept."""
    image = {"type": "input_image", "image_url": "https://example.com/i.png", "detail": "auto"}
    first = items([user("look"), fcall("call_1"), fcall("call_2"),
                   {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "o"}, image]}])
    more = first + items([fout("call_2", "p")])
    cache = RenderCache(OPENAI_COMPAT)
    for conversation in (first, more):
        req = msgspec.structs.replace(request([]), items=conversation)
        assert encode_request(req, OPENAI_COMPAT, cache) == encode_request(req, OPENAI_COMPAT)
    roles = [m["role"] for m in render(msgspec.structs.replace(request([]), items=more), OPENAI_COMPAT)["messages"]]
    assert roles == ["user", "assistant", "tool", "tool", "user"]


_raw_item = st.one_of(
    st.builds(lambda r, t: {"role": r, "content": t}, st.sampled_from(["user", "system", "developer", "assistant"]), st.text(max_size=12)),
    st.builds(lambda c, a: {"type": "function_call", "call_id": f"call_{c}", "name": "f", "arguments": a}, st.integers(0, 3), st.text(max_size=8)),
    st.builds(lambda c, o: {"type": "function_call_output", "call_id": f"call_{c}", "output": o}, st.integers(0, 3), st.text(max_size=8)),
    st.builds(lambda t: {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": t}]}, st.text(max_size=8)),
    st.builds(lambda t: {"type": "custom_tool_call_output", "call_id": "c", "output": t}, st.text(max_size=8)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_raw_item, min_size=1, max_size=4), min_size=1, max_size=5), st.sampled_from(DIALECTS), st.booleans())
def test_render_cache_gives_identical_bytes(turns: list[list[dict[str, Any]]], dialect, instructions: bool) -> None:
    from hotloop.backends.chat.render import _answers_first

    cache = RenderCache(dialect)
    chained: list[Item] = []
    kept = 0  # renderings a continuation may extend: all but those ending with messages that wait for outputs
    for k, raw in enumerate(turns):
        chained = chained + items(raw)  # the same item objects carry over, as in a chained turn
        req = request([], instructions="Be brief." if instructions else None)
        req = msgspec.structs.replace(req, items=chained)
        assert encode_request(req, dialect, cache) == encode_request(req, dialect)
        kept += k < len(turns) - 1 and not _answers_first(chained, set())[1]
    assert cache.hits == kept


def test_render_cache_long_chain_in_bounded_pieces() -> None:
    """A long chained conversation: each turn's body (in pieces) is the body rendered from scratch,
    and the pieces stay few (joined every MAX_PIECES turns)."""
    from hotloop.backends.chat import encode_request_parts
    from hotloop.backends.chat.render import MAX_PIECES

    cache = RenderCache(CEREBRAS)
    chained: list[Item] = items([{"role": "user", "content": "go"}])
    for turn in range(3 * MAX_PIECES + 5):
        # text then a call (merged into one assistant message), its output, sometimes a user note
        chained = chained + items(
            [
                {"role": "assistant", "content": f"step {turn}"},
                {"type": "function_call", "call_id": f"c{turn}", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": f"c{turn}", "output": "o" * (turn % 7)},
            ]
            + ([{"role": "user", "content": "more"}] if turn % 3 == 0 else [])
        )
        req = msgspec.structs.replace(request([], instructions="Be brief." if turn % 2 else None), items=chained)
        parts = encode_request_parts(req, CEREBRAS, cache)
        assert b"".join(parts) == encode_request(req, CEREBRAS)
        assert len(parts) <= MAX_PIECES + 3
    assert cache.hits == 3 * MAX_PIECES + 4


def test_render_cache_reuses_by_identity_not_equality() -> None:
    """A retry from the same parent with an equal-looking item: an item hotloop does not model
    keeps the client's JSON (key order, 1 against 1.0 or true), so an equal item may render
    differently and the cached rendering must not be reused for it."""
    root = items([{"role": "user", "content": "hi"}])
    pairs = [
        ({"type": "custom_tool_call", "call_id": "c", "name": "x", "input": "1", "k": 1}, {"k": 1.0}),
        ({"type": "custom_tool_call", "call_id": "c", "name": "x", "input": "1", "k": 1}, {"k": True}),
        ({"type": "custom_tool_call", "call_id": "c", "name": "x", "input": "1"}, {}),
    ]
    for first, change in pairs:
        second = {**first, **change} if change else dict(reversed(list(first.items())))
        cache = RenderCache(CEREBRAS)
        a, b = root + items([first]), root + items([second])
        assert a[1] == b[1] and a[1] is not b[1]
        encode_request(msgspec.structs.replace(request([]), items=a), CEREBRAS, cache)
        req = msgspec.structs.replace(request([]), items=b + items([{"role": "user", "content": "x"}]))
        assert encode_request(req, CEREBRAS, cache) == encode_request(req, CEREBRAS)
        assert cache.hits == 0


def test_render_cache_accounts_its_bytes() -> None:
    """The cache's byte count is the sum of its entries' sizes, each the length of what the
    entry renders (pieces and last message), through forks, merges and evictions."""
    import random as _random

    rng = _random.Random(7)
    cache = RenderCache(CEREBRAS, max_entries=3, max_bytes=6_000)
    convs: list[list[Item]] = []
    for step in range(400):
        if convs and rng.random() < 0.7:
            base = rng.choice(convs)
            base = base[: rng.randrange(1, len(base) + 1)]  # a fork or the whole
        else:
            base = items([{"role": "user", "content": f"start {step}"}])
        kind = rng.randrange(3)
        new = (
            [{"role": "assistant", "content": "a" * rng.randrange(50)}] if kind == 0
            else [{"type": "function_call", "call_id": f"c{step}", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": f"c{step}", "output": "o" * rng.randrange(300)}] if kind == 1
            else [{"role": "user", "content": "u" * rng.randrange(200)}]
        )
        conv = base + items(new)
        convs.append(conv)
        parts = cache.render(conv)
        assert b"".join(parts) == b",".join(encode_request_messages(conv))
        assert cache.bytes == sum(e.size for e in cache._d.values()) <= cache.max_bytes
        for e in cache._d.values():
            assert e.size == sum(map(len, e.pieces)) + len(e.last_json) + (1 if e.pieces and e.last is not None else 0)


def encode_request_messages(conv: list[Item]) -> list[bytes]:
    """Each chat message of ``conv``, encoded, rendered from scratch."""
    from hotloop.backends.chat import render_messages

    req = msgspec.structs.replace(request([]), items=conv)
    return [msgspec.json.encode(m) for m in render_messages(req, CEREBRAS)]


def test_render_cache_forks_and_bounds() -> None:
    cache = RenderCache(CEREBRAS, max_entries=2)
    root = items([{"role": "user", "content": "a"}])
    a = root + items([{"role": "assistant", "content": "b"}])
    b = root + items([{"role": "assistant", "content": "c"}])
    for conv in (a, b, b + items([{"role": "user", "content": "d"}])):
        req = msgspec.structs.replace(request([]), items=conv)
        assert encode_request(req, CEREBRAS, cache) == encode_request(req, CEREBRAS)
    assert cache.hits == 1  # b forks from a (re-rendered); b + d extends b
    for i in range(5):
        cache.render(items([{"role": "user", "content": str(i)}]))
    assert len(cache._d) == 2


def test_render_cache_byte_budget() -> None:
    cache = RenderCache(CEREBRAS, max_entries=100, max_bytes=40_000)
    for i in range(20):
        cache.render(items([{"role": "user", "content": "x" * 3000 + str(i)}]))
    assert cache.bytes <= 40_000 and len(cache._d) < 20
    cache.render(items([{"role": "user", "content": "y" * 20_000}]))  # over a quarter: not cached
    assert cache.bytes <= 40_000 and all(e.size <= 10_000 for e in cache._d.values())


def test_render_cache_encodes_an_agents_tools_once() -> None:
    """The same tool objects (an agent's, shared by its turns) are rendered and encoded once per
    cache; the body is the one rendered from scratch, for every tool choice that selects them."""
    from hotloop.backends.chat.render import TOOLS_KEPT, TOOLS_MAX_BYTES, TOOLS_MIN_BYTES
    from hotloop.protocol.request import FunctionTool

    def tools(tag: str, n: int = 8, size: int = 300) -> list[FunctionTool]:
        return [
            FunctionTool(name=f"t{i}{tag}", description="d" * size, parameters={"type": "object", "properties": {"a": {"type": "string"}}}, strict=i % 2 == 0)
            for i in range(n)
        ]

    cache = RenderCache(CEREBRAS)
    agent = tools("a")
    choices: list[Any] = ["auto", "required", {"type": "function", "name": "t3a"}, {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "t1a"}]}]
    for turn in range(3):
        for choice in choices:
            req = request(f"turn {turn}", tools=agent, tool_choice=choice)
            assert encode_request(req, CEREBRAS, cache) == encode_request(req, CEREBRAS)
    whole = cache.tools(agent)
    assert cache.tools(agent) is whole  # kept: the same bytes object
    assert cache.tools(list(agent)) is whole  # another list of the same tool objects
    assert cache.tools(tools("a")) is not whole  # equal tools, other objects: rendered again
    small = [FunctionTool(name="s", parameters={"type": "object"})]
    assert len(cache.tools(small)) < TOOLS_MIN_BYTES and cache.tools(small) is not cache.tools(small)
    for k in range(TOOLS_KEPT + 3):
        cache.tools(tools(str(k)))
    assert len(cache._tools) == TOOLS_KEPT
    huge = tools("h", n=4, size=TOOLS_MAX_BYTES // 3)
    assert len(cache.tools(huge)) > TOOLS_MAX_BYTES and cache.tools(huge) is not cache.tools(huge)  # not kept


def test_parallel_calls_that_all_say_index_0_are_separate_calls() -> None:
    """Servers that give every parallel call index 0 (Ollama, some proxies): a new id at an
    index in use starts another call, whole in one chunk or in pieces after its id."""
    whole = [
        chunk(tc(0, id="call_h", name="file_write", args='{"path":"hello.py"}')),
        chunk(tc(0, id="call_w", name="file_write", args='{"path":"world.py"}')),
        chunk(finish="tool_calls"),
    ]
    assert calls_of(through_turn(assemble(whole))) == [
        ("call_h", "file_write", '{"path":"hello.py"}'),
        ("call_w", "file_write", '{"path":"world.py"}'),
    ]
    pieces = [
        chunk(tc(0, id="call_1", name="add_numbers", args="")),
        chunk(tc(0, args='{"a":2,')),
        chunk(tc(0, args='"b":2}')),
        chunk(tc(0, id="call_2", name="get_weather", args="")),
        chunk(tc(0, args='{"location":')),
        chunk(tc(0, args='"Tokyo"}')),
        chunk(finish="tool_calls"),
    ]
    assert calls_of(through_turn(assemble(pieces))) == [
        ("call_1", "add_numbers", '{"a":2,"b":2}'),
        ("call_2", "get_weather", '{"location":"Tokyo"}'),
    ]
    # the same id again (servers that repeat it in every delta) continues its call
    repeated = [
        chunk(tc(0, id="call_1", name="f", args='{"a":')),
        chunk(tc(0, id="call_1", name="f", args="1}")),
        chunk(finish="tool_calls"),
    ]
    assert calls_of(through_turn(assemble(repeated))) == [("call_1", "f", '{"a":1}')]


def test_split_surrogates_are_mended_per_string_and_lone_halves_replaced() -> None:
    """``SplitSurrogates``: a high half at a string's end waits for the same string of the next
    chunk (text and each call's arguments apart); a half left alone is U+FFFD, never a lone
    surrogate (which no UTF-8 encoder writes)."""
    from hotloop.backends.chat.assemble import SplitSurrogates

    m = SplitSurrogates()

    def delta(content: str | None = None, args: str | None = None) -> str:
        d: dict[str, Any] = {}
        if content is not None:
            d["content"] = content
        if args is not None:
            d["tool_calls"] = [{"index": 0, "function": {"arguments": args}}]
        return json.dumps({"choices": [{"index": 0, "delta": d}]})

    def texts(c: Any) -> tuple[Any, Any]:
        d = c.choices[0].delta
        return d.content, (d.tool_calls[0].function.arguments if d.tool_calls else None)

    assert texts(m.decode(delta("a\ud83d", '{"x":"\ud83d'))) == ("a", '{"x":"')
    assert texts(m.decode(delta("\ude00b", '\ude80"}'))) == ("\U0001F600b", '\U0001F680"}')
    assert texts(m.decode(delta("\ud83d"))) == ("", None)  # held
    assert texts(m.decode(delta("c"))) == ("\ufffdc", None)  # not followed by its low half
    assert texts(m.decode(delta("\ude00d"))) == ("\ufffdd", None)  # a low half alone
    assert not m.held
    with pytest.raises(ValueError):
        m.decode("{not json")


def test_reasoning_between_an_assistants_text_and_its_call_is_kept() -> None:
    """A model that reasoned, wrote, reasoned again and called a tool: its text and call are one
    chat message, which holds both reasonings (the second was dropped, as the message already had
    one); the OpenAI-compatible dialect sends none."""
    from hotloop.protocol.request import item_from_dict

    items = [
        item_from_dict({"type": "message", "role": "user", "content": "go"}),
        item_from_dict({"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "first thought"}]}),
        item_from_dict({"type": "message", "role": "assistant", "content": "Looking."}),
        item_from_dict({"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "second thought"}]}),
        item_from_dict({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}),
        item_from_dict({"type": "function_call_output", "call_id": "c1", "output": "done"}),
    ]
    msgs = render(request(items=items), CEREBRAS)["messages"]
    assistant = [m for m in msgs if m["role"] == "assistant"]
    assert len(assistant) == 1 and assistant[0]["content"] == "Looking." and assistant[0]["tool_calls"][0]["id"] == "c1"
    assert assistant[0]["reasoning"] == "first thought\n\nsecond thought"
    assert "reasoning" not in [m for m in render(request(items=items), OPENAI_COMPAT)["messages"] if m["role"] == "assistant"][0]


def test_a_backends_negative_token_counts_are_unknown() -> None:
    """A backend reporting ``prompt_tokens: -500`` made the response's usage, the ledger and a
    Prometheus counter go down, and refunded TPM: a negative count is unknown (hotloop's own
    count is used), the others are kept."""
    from hotloop.protocol.chunks import Usage

    out = assemble([
        chunk({"content": "hi"}),
        chunk({}, "stop"),
        msgspec.json.decode(json.dumps({"choices": [], "usage": {
            "prompt_tokens": -500, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": -1},
            "completion_tokens_details": {"reasoning_tokens": 2}}}), type=ChatChunk),
    ])
    [u] = [c for c in out if isinstance(c, Usage)]
    assert (u.input_tokens, u.output_tokens, u.cached_tokens, u.reasoning_tokens) == (None, 7, None, 2)


def test_a_backends_token_counts_written_as_floats_are_read() -> None:
    """``"prompt_tokens": 10.0``: the usage chunk was refused, and the whole response failed as a
    malformed stream; a count written as a float is read (rounded down)."""
    from hotloop.protocol.chunks import Usage

    out = assemble([
        chunk({"content": "hi"}),
        chunk({}, "stop"),
        msgspec.json.decode(
            b'{"choices": [], "usage": {"prompt_tokens": 10.0, "completion_tokens": 7.9, '
            b'"prompt_tokens_details": {"cached_tokens": 3.0}, "completion_tokens_details": {"reasoning_tokens": 2}}}',
            type=ChatChunk,
        ),
    ])
    [u] = [c for c in out if isinstance(c, Usage)]
    assert (u.input_tokens, u.output_tokens, u.cached_tokens, u.reasoning_tokens) == (10, 7, 3, 2)
