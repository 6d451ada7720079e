"""The simulator backend: directives, scripts, schema-valid arguments, determinism, pacing."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import uvloop

from hotloop import errors, tokenizer
from hotloop.backends.base import BackendRequest
from hotloop.backends.simulator import Script, SimulatorBackend, example_value, parse_directives
from hotloop.protocol.chunks import Failure, Finish, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, FunctionTool, InputText, Message

TOOL = FunctionTool(
    name="edit_file",
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "line": {"type": "integer", "minimum": 3},
            "mode": {"type": "string", "enum": ["replace", "insert"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "opts": {"type": "object", "properties": {"dry": {"type": "boolean"}}, "required": ["dry"]},
            "note": {"type": ["string", "null"]},
        },
        "required": ["path", "line", "mode", "tags", "opts", "note"],
        "additionalProperties": False,
    },
)


def req(items=None, tools=(), choice="auto", **kw) -> BackendRequest:
    items = items if items is not None else [Message(role="user", content=[InputText(text="fix the bug")])]
    return BackendRequest(model="hotloop-sim", instructions=None, items=items, tools=list(tools),
                          tool_choice=choice, parallel_tool_calls=True, **kw)


def collect(sim: SimulatorBackend, r: BackendRequest) -> list:
    async def go():
        await sim.start()
        return [c async for c in sim.stream(r)]
    return uvloop.run(go())


def test_text_is_real_tokens_one_delta_each() -> None:
    sim = SimulatorBackend(rate=0, output_tokens=40)
    chunks = collect(sim, req())
    texts = [c.text for c in chunks if isinstance(c, TextDelta)]
    assert len(texts) == 40
    enc = tokenizer.encoding()
    assert [enc.decode([t]) for t in enc.encode_ordinary("".join(texts))] == texts
    assert chunks[-2] == Usage(output_tokens=40, reasoning_tokens=0) and chunks[-1] == Finish("stop")


def test_agent_default_calls_then_answers() -> None:
    sim = SimulatorBackend(rate=0)
    first = collect(sim, req(tools=[TOOL]))
    calls = [c for c in first if isinstance(c, ToolCallDelta)]
    assert calls[0].name == "edit_file" and calls[0].call_id
    args = json.loads("".join(c.arguments for c in calls))
    assert args == {"path": "example path", "line": 3, "mode": "replace", "tags": ["example tags"], "opts": {"dry": True}, "note": "example note"}
    assert first[-1] == Finish("tool_calls")
    history = [
        Message(role="user", content=[InputText(text="fix the bug")]),
        FunctionCall(call_id=calls[0].call_id, name="edit_file", arguments=json.dumps(args)),
        FunctionCallOutput(call_id=calls[0].call_id, output="done"),
    ]
    second = collect(sim, req(items=history, tools=[TOOL]))
    assert any(isinstance(c, TextDelta) for c in second) and second[-1] == Finish("stop")


def test_directives() -> None:
    sim = SimulatorBackend(rate=0)
    chunks = collect(sim, req(tools=[TOOL, FunctionTool(name="other")], metadata={"sim": "reasoning,tools:2,tokens:6"}))
    kinds = [type(c).__name__ for c in chunks]
    assert kinds.index("ReasoningDelta") < kinds.index("ToolCallDelta")
    assert {c.index for c in chunks if isinstance(c, ToolCallDelta)} == {0, 1}
    assert [c.name for c in chunks if isinstance(c, ToolCallDelta) and c.name] == ["edit_file", "other"]
    fail = collect(sim, req(metadata={"sim": "fail:invalid_prompt,tokens:10"}))
    assert isinstance(fail[-1], Failure) and fail[-1].code == "invalid_prompt"
    with pytest.raises(errors.RateLimited):
        collect(sim, req(metadata={"sim": "rate_limit"}))
    with pytest.raises(errors.BackendError):
        collect(sim, req(metadata={"sim": "disconnect"}))
    with pytest.raises(errors.InvalidValue):
        parse_directives("text,bogus")
    capped = collect(sim, req(metadata={"sim": "tokens:50"}, max_output_tokens=7))
    assert sum(isinstance(c, TextDelta) for c in capped) == 7 and capped[-1] == Finish("length")


def test_script_by_turn(tmp_path: Path) -> None:
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"turns": ["tools:1", "rate_limit", "text,tokens:3"]}))
    sim = SimulatorBackend(rate=0, script=Script.load(path))
    user = Message(role="user", content=[InputText(text="go")])
    assert any(isinstance(c, ToolCallDelta) for c in collect(sim, req(items=[user], tools=[TOOL])))
    one_turn = [user, Message(role="assistant", content="ok"), user]
    with pytest.raises(errors.RateLimited):
        collect(sim, req(items=one_turn, tools=[TOOL]))
    two_turns = one_turn + [Message(role="assistant", content="ok"), user]
    assert sum(isinstance(c, TextDelta) for c in collect(sim, req(items=two_turns))) == 3
    assert sum(isinstance(c, TextDelta) for c in collect(sim, req(items=two_turns * 3))) == 3  # last entry repeats


def test_script_calls_named_tools_with_exact_arguments(tmp_path: Path) -> None:
    """A script entry object names the tool and gives its arguments (a JSON object, or a string
    kept as it is); the next turn answers as scripted."""
    path = tmp_path / "script.json"
    calls = [{"name": "other", "arguments": {"cmd": "echo hotloop-ok", "n": [1, 2]}},
             {"name": "edit_file", "arguments": '{"path": "a.txt"}'}]
    path.write_text(json.dumps({"turns": [{"sim": "reasoning,tokens:4", "calls": calls}, "text,tokens:3"]}))
    sim = SimulatorBackend(rate=0, script=Script.load(path))
    user = Message(role="user", content=[InputText(text="go")])
    chunks = collect(sim, req(items=[user], tools=[TOOL, FunctionTool(name="other")]))
    kinds = [type(c).__name__ for c in chunks]
    assert kinds.index("ReasoningDelta") < kinds.index("ToolCallDelta") and "TextDelta" not in kinds
    deltas = [c for c in chunks if isinstance(c, ToolCallDelta)]
    assert [c.name for c in deltas if c.name] == ["other", "edit_file"]
    args = ["".join(c.arguments for c in deltas if c.index == k) for k in (0, 1)]
    assert args == ['{"cmd":"echo hotloop-ok","n":[1,2]}', '{"path": "a.txt"}']
    assert chunks[-1] == Finish("tool_calls")
    # serial calls only: the first one
    serial_req = req(items=[user], tools=[TOOL, FunctionTool(name="other")])
    serial_req.parallel_tool_calls = False
    serial = collect(sim, serial_req)
    assert {c.index for c in serial if isinstance(c, ToolCallDelta)} == {0}
    # a scripted call of a tool the request does not have is a 400
    with pytest.raises(errors.InvalidRequest):
        collect(sim, req(items=[user], tools=[TOOL]))
    # a named tool_choice wins, as over a model: only its scripted call (exact arguments) is made
    # (tests/unit/test_sim_tool_choice.py)
    forced = collect(sim, req(items=[user], tools=[TOOL, FunctionTool(name="other")],
                              choice={"type": "function", "name": "edit_file"}))
    assert [c.name for c in forced if isinstance(c, ToolCallDelta) and c.name] == ["edit_file"]
    assert "".join(c.arguments for c in forced if isinstance(c, ToolCallDelta)) == '{"path": "a.txt"}'
    history = [user, FunctionCall(call_id="c1", name="other", arguments="{}"),
               FunctionCallOutput(call_id="c1", output="hotloop-ok")]
    assert sum(isinstance(c, TextDelta) for c in collect(sim, req(items=history, tools=[TOOL]))) == 3


@pytest.mark.parametrize("entry", [
    {"calls": []},
    {"calls": [{"name": ""}]},
    {"calls": [{"name": "x", "arguments": 3}]},
    {"calls": [{"name": "x", "extra": 1}]},
    {"calls": [{"name": "x"}], "sim": "tools:2"},
    {"calls": [{"name": "x"}], "bogus": 1},
    {"sim": 5},
    {"sim": "bogus"},
])
def test_script_entry_objects_are_checked(tmp_path: Path, entry: dict) -> None:
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"turns": ["text", entry]}))
    with pytest.raises(ValueError, match="turn 1"):
        Script.load(path)


@pytest.mark.parametrize("repeat", ["false", 1, None])
def test_a_scripts_repeat_is_true_or_false(tmp_path: Path, repeat: object) -> None:
    """``"repeat": "false"`` (a string) was read as true, and cycled the turns."""
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"turns": ["text"], "repeat": repeat}))
    with pytest.raises(ValueError, match="repeat"):
        Script.load(path)
    path.write_text(json.dumps({"turns": ["text", "tools:1"], "repeat": False}))
    assert Script.load(path).repeat is False


def test_deterministic_under_seed() -> None:
    a = collect(SimulatorBackend(rate=0, seed=7), req(metadata={"sim": "reasoning,tokens:20"}))
    b = collect(SimulatorBackend(rate=0, seed=7), req(metadata={"sim": "reasoning,tokens:20"}))
    c = collect(SimulatorBackend(rate=0, seed=8), req(metadata={"sim": "reasoning,tokens:20"}))
    assert a == b and a != c
    assert any(isinstance(x, ReasoningDelta) for x in a)


def test_pacing_never_runs_ahead_of_the_rate() -> None:
    # Lower bounds only: a loaded machine may be slower than the rate, never faster.
    sim = SimulatorBackend(rate=4000, ttft=0.05, output_tokens=400)

    async def go():
        await sim.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = None
        n = 0
        async for c in sim.stream(req()):
            if isinstance(c, TextDelta):
                n += 1
                if first is None:
                    first = loop.time() - t0
        return first, loop.time() - t0, n

    first, total, n = uvloop.run(go())
    assert n == 400
    assert first >= 0.049
    assert total >= 0.05 + 399 / 4000 - 0.002


@pytest.mark.parametrize("rate", [4000.0, 1000.0])
def test_pacing_sleeps_whole_ticks_and_emits_what_is_due_within_one(rate: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a fake clock: the generator sleeps only when the next token is more than TICK ahead
    # (uvloop rounds delays to whole milliseconds; a shorter sleep was a call_soon that found
    # the token still not due), emits every token due within a tick at once, and no token is
    # emitted more than a tick early or after its time.
    from hotloop.backends import simulator as simmod

    clock = [100.0]
    sleeps: list[float] = []

    class Loop:
        def time(self) -> float:
            return clock[0]

        async def run_in_executor(self, _executor: object, fn: object, *args: object) -> object:
            return fn(*args)  # type: ignore[operator]

    class Shim:
        @staticmethod
        def get_running_loop() -> Loop:
            return Loop()

        @staticmethod
        async def sleep(seconds: float) -> None:
            sleeps.append(seconds)
            clock[0] += seconds

    monkeypatch.setattr(simmod, "asyncio", Shim)
    n = 200
    sim = SimulatorBackend(rate=rate, ttft=0.0, output_tokens=n)

    async def go() -> list[float]:
        await sim.start()
        return [clock[0] async for c in sim.stream(req()) if isinstance(c, TextDelta)]  # when each came

    times = asyncio.run(go())
    assert len(times) == n
    assert sleeps and min(sleeps) > simmod.TICK
    for i, t in enumerate(times):
        due = 100.0 + i / rate
        assert due - simmod.TICK - 1e-9 <= t <= due + 1e-9, (i, t, due)
    if rate > 1 / simmod.TICK:  # a wake-up for every two tokens or more, not one a token
        assert len(sleeps) <= n // 2
    else:  # a token a millisecond or slower: each at its time, as before
        assert len(sleeps) == n - 1 and times == [100.0 + i / rate for i in range(n)]


def test_example_values_cover_schema_forms() -> None:
    assert example_value({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 1
    assert example_value({"const": "x"}) == "x"
    assert example_value({"type": "array", "items": {"type": "number"}, "minItems": 2}) == [1.5, 1.5]
    assert example_value({"type": "string", "format": "date"}) == "2026-01-01"


def test_an_answer_that_runs_past_the_corpus_end_keeps_its_words_apart() -> None:
    """An answer is a window of the corpus's tokens that wraps from its end to its start: the
    start's first word must not be glued to the end's last word (it was: "hot" + "coding")."""
    from hotloop.backends.simulator import _WORDS, _Corpus, _sentence

    corpus = _Corpus(0)
    n = len(corpus.pieces)
    for back in range(1, 8):
        words = "".join(_sentence(corpus.take(n - back, 12))).split()
        assert len(words) == 12 and set(words) <= set(_WORDS), words


def test_schema_examples_are_bounded_by_what_they_look_at_and_write() -> None:
    """Bounds of the schema example (simulator arguments and text.format documents), each of
    which a small request could get past: a property looked at costs a character of the budget
    even when not written (N optional properties and N other names required were N x N work,
    never charged); an integer costs its digits (a ``minimum`` of 1e308 writes 309: 12 MB of
    arguments came out of a 100,000-character budget); a pattern longer than MAX_PATTERN_CHARS is
    neither parsed nor compiled (a 100 KB one took 0.9 s on the event loop)."""
    from hotloop.backends import simulator

    many = {"type": "object", "properties": {f"p{i}": {"type": "null"} for i in range(simulator.MAX_ARGUMENT_CHARS + 1)},
            "required": ["q"]}
    with pytest.raises(simulator._TooLarge):
        example_value(many)
    huge = {"type": "array", "minItems": 400, "items": {"type": "integer", "minimum": 1e308}}
    with pytest.raises(simulator._TooLarge):
        example_value(huge)
    assert len(str(example_value({"type": "integer", "minimum": 1e308}))) == 309
    long = "a" * (simulator.MAX_PATTERN_CHARS + 1)
    assert simulator._parse(long) is None and simulator._parse("a+") is not None
    assert example_value({"type": "string", "pattern": long}, "x") == "example x"
    # the same required set, whatever its size, and allOf's parts joined
    merged = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"properties": {"b": {"type": "string"}}, "required": ["b"]}]}
    assert example_value(merged) == {"a": 1, "b": "example b"}


def test_nested_models_are_written_whole_at_any_ordinary_depth() -> None:
    """Five nested Pydantic models ($ref, property, $ref...) reached the depth limit of 8, and
    the innermost required fields came out null: invalid, and ``responses.parse`` failed. Only
    a schema that recurses through required properties still ends in null."""
    defs = {
        "Point": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}, "required": ["lat", "lon"]},
        "Geo": {"type": "object", "properties": {"point": {"$ref": "#/$defs/Point"}}, "required": ["point"]},
        "Address": {"type": "object", "properties": {"geo": {"$ref": "#/$defs/Geo"}}, "required": ["geo"]},
        "Customer": {"type": "object", "properties": {"address": {"$ref": "#/$defs/Address"}}, "required": ["address"]},
    }
    order = {"$defs": defs, "type": "object", "properties": {"customer": {"$ref": "#/$defs/Customer"}}, "required": ["customer"]}
    point = example_value(order)["customer"]["address"]["geo"]["point"]
    assert isinstance(point["lat"], float) and isinstance(point["lon"], float), point
