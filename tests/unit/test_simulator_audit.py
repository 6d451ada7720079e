"""Audit of the built-in simulator backend: what a client of ``hotloop serve`` (its defaults) meets.

Each test pins a defect that was found (see the report of the audit): determinism through the
server, directives that were silently ignored or unbounded, the scripted scenario's turn count,
``allowed_tools``, and schemas that made the simulator build unbounded arguments on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import uvloop
from openai import OpenAI

from hotloop import errors
from hotloop.backends import simulator as simmod
from hotloop.backends.base import BackendRequest
from hotloop.backends.simulator import Script, SimulatorBackend, _example_arguments, _example_document, example_value
from hotloop.protocol.chunks import Failure, Finish, TextDelta, ToolCallDelta
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, FunctionTool, InputText, Message, TextFormat
from tests.conftest import Server, run_server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
TOOL = FunctionTool(name="get_weather", parameters=WEATHER["parameters"])
OTHER = FunctionTool(name="get_time", parameters={"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]})
USER = Message(role="user", content=[InputText(text="fix the bug")])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``hotloop serve`` on its defaults but unpaced (simulator backend, SQLite store)."""
    with run_server(tmp_path_factory.mktemp("simaudit"), "--sim-rate", "0") as s:
        yield s


def client_for(server: Server) -> OpenAI:
    return OpenAI(api_key="sk-test", base_url=server.v1, max_retries=0, timeout=5)


def req(items: list[Any] | None = None, tools: list[FunctionTool] | tuple[FunctionTool, ...] = (), choice: Any = "auto",
        parallel: bool = True, **kw: Any) -> BackendRequest:
    return BackendRequest(model="hotloop-sim", instructions=None, items=list(items if items is not None else [USER]),
                          tools=list(tools), tool_choice=choice, parallel_tool_calls=parallel, **kw)


def collect(sim: SimulatorBackend, r: BackendRequest) -> list[Any]:
    async def go() -> list[Any]:
        await sim.start()
        return [c async for c in sim.stream(r)]

    return uvloop.run(go())


def calls_of(chunks: list[Any]) -> list[str]:
    return [c.name for c in chunks if isinstance(c, ToolCallDelta) and c.name]


def post(server: Server, body: dict[str, Any], timeout: float = 5.0) -> httpx.Response:
    return httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi", **body}, timeout=timeout)


def check_400(r: httpx.Response, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["code"] == "invalid_value", err
    assert "Traceback" not in err["message"] and "Error(" not in err["message"]
    return err


# -- determinism -----------------------------------------------------------------------------------


def test_the_same_request_twice_gets_the_same_answer(srv: Server) -> None:
    """README: "Output is deterministic for a seed". The server gives every input item an id of
    its own (random); the simulator seeded its answer with it, so the same request sent twice got
    a different text and different call ids."""
    client = client_for(srv)
    a = client.responses.create(model="hotloop-sim", input="Say hello.")
    b = client.responses.create(model="hotloop-sim", input="Say hello.")
    assert a.output_text == b.output_text
    tools: Any = [WEATHER]
    c = client.responses.create(model="hotloop-sim", input="Weather in Paris?", tools=tools)
    d = client.responses.create(model="hotloop-sim", input="Weather in Paris?", tools=tools)
    assert c.output[0].type == "function_call" and d.output[0].type == "function_call"
    assert c.output[0].call_id == d.output[0].call_id  # type: ignore[union-attr]


# -- directives that were silently ignored ---------------------------------------------------------


@pytest.mark.parametrize("transport", ["unit", "server"])
def test_fail_applies_to_an_empty_answer(transport: str, srv: Server) -> None:
    """``fail:CODE`` with ``tokens:0``: the plan was empty, so the failure (at its middle) never
    came and the response completed."""
    if transport == "unit":
        chunks = collect(SimulatorBackend(rate=0), req(metadata={"sim": "fail:invalid_prompt,tokens:0"}))
        assert isinstance(chunks[-1], Failure) and chunks[-1].code == "invalid_prompt"
        return
    with httpx.stream("POST", srv.v1 + "/responses", timeout=5, json={
        "model": "hotloop-sim", "input": "hi", "stream": True, "metadata": {"sim": "fail:invalid_prompt,tokens:0"},
    }) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.failed", [e["type"] for e in events]
    assert events[-1]["response"]["error"]["code"] == "invalid_prompt"


def test_error_and_stall_apply_to_an_empty_answer() -> None:
    sim = SimulatorBackend(rate=0)
    with pytest.raises(errors.BackendError):
        collect(sim, req(metadata={"sim": "error,tokens:0"}))
    t = time.monotonic()
    chunks = collect(sim, req(metadata={"sim": "stall:0.2,tokens:0"}))
    assert time.monotonic() - t >= 0.19
    assert chunks[-1] == Finish("stop")


def test_a_stall_is_silence_then_the_same_pace() -> None:
    """``stall:S`` mid-stream: S seconds of silence, then the tokens after it at the pace before
    it (they came in one burst, all of them due by then, so the stream took no longer)."""
    sim = SimulatorBackend(rate=50)  # 20 ms a token

    async def times() -> list[float]:
        out = []
        async for chunk in sim.stream(req(metadata={"sim": "text,tokens:20,stall:0.3"})):
            if isinstance(chunk, TextDelta):
                out.append(time.monotonic())
        return out

    stamps = uvloop.run(times())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert max(gaps) >= 0.29  # the silence
    after = gaps[gaps.index(max(gaps)) + 1:]
    assert len(after) >= 5
    assert sorted(after)[len(after) // 2] >= 0.01, after  # paced after it, not a burst


def test_fail_comes_before_the_output_budget_runs_out() -> None:
    """The failure was placed at the middle of the whole plan: with ``max_output_tokens`` cutting
    the plan before that, the response ended incomplete and the ``fail`` directive was lost."""
    big = FunctionTool(name="big", parameters={
        "type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(20)},
    })
    chunks = collect(SimulatorBackend(rate=0), req(tools=[big], metadata={"sim": "tools:1,fail:invalid_prompt"},
                                                   max_output_tokens=16))
    assert isinstance(chunks[-1], Failure), chunks[-3:]
    assert sum(1 for c in chunks if isinstance(c, ToolCallDelta) and c.arguments) <= 16


@pytest.mark.parametrize("sim", ["text:50", "reasoning:3", "rate_limit:2", "text+tool:2", "error:bogus", "disconnect:5"])
def test_a_flag_directive_with_a_value_is_a_400(srv: Server, sim: str) -> None:
    """``text:50`` (meant as a length) was read as ``text`` and the 50 dropped: 200 with the
    default length. A flag takes no value; ``error`` only ``server_error`` or ``disconnect``."""
    err = check_400(post(srv, {"metadata": {"sim": sim}}), "metadata.sim")
    assert sim in err["message"]


# -- unbounded resources ---------------------------------------------------------------------------


@pytest.mark.parametrize("rate", ["1e-300", "0.0001", "5e-324"])
def test_a_rate_slower_than_the_stall_bound_is_a_400(srv: Server, rate: str) -> None:
    """``rate:1e-300`` was accepted: a gap of 1e300 s between tokens (the response hung until the
    backend idle timeout). Silence is bounded by ``stall`` (MAX_STALL); a token gap is too."""
    with httpx.stream("POST", srv.v1 + "/responses", timeout=5, json={
        "model": "hotloop-sim", "input": "hi", "stream": True, "metadata": {"sim": f"rate:{rate}"},
    }) as r:
        r.read()
    check_400(r, "metadata.sim")


def test_rate_zero_and_rates_up_to_the_bound_are_accepted() -> None:
    assert simmod.parse_directives("rate:0").rate == 0
    assert simmod.parse_directives(f"rate:{1 / simmod.MAX_STALL}").rate == pytest.approx(1 / simmod.MAX_STALL)
    assert simmod.parse_directives("rate:inf").rate == float("inf")


def _nested(depth: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        s = {"type": "array", "items": s, "minItems": 16}
    return {"type": "object", "properties": {"a": s}, "required": ["a"]}


def test_a_schema_asking_for_huge_arguments_is_a_400_at_once() -> None:
    """Nested arrays with ``minItems: 16`` multiply: depth 5 built 12.7 MB of arguments (3.2
    million tokens) on the event loop, depth 8 hours and gigabytes. Bounded now: a 400."""
    t = time.monotonic()
    with pytest.raises(errors.InvalidValue) as info:
        _example_arguments(FunctionTool(name="deep", parameters=_nested(5)))
    assert time.monotonic() - t < 0.5
    assert info.value.param == "tools"


def test_a_huge_schema_over_the_server_is_a_prompt_400(srv: Server) -> None:
    tool = {"type": "function", "name": "deep", "parameters": _nested(8)}
    t = time.monotonic()
    r = post(srv, {"tools": [tool]}, timeout=5)
    assert time.monotonic() - t < 2
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_an_unpaced_answer_lets_the_event_loop_run() -> None:
    """``rate:0`` (or ``--sim-rate 0``) never awaited: a 100,000-token answer (150,000 chunks with
    reasoning) ran in one go, the server deaf to every other client meanwhile (0.23 s measured
    for a JSON answer). Now it yields to the loop every few hundred tokens."""
    sim = SimulatorBackend(rate=0)

    async def go() -> int:
        await sim.start()
        ticks = 0
        stop = False

        async def ticker() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        ticks = 0
        n = 0
        async for c in sim.stream(req(metadata={"sim": "tokens:5000"})):
            n += isinstance(c, TextDelta)  # a consumer that never awaits (as the JSON path)
        stop = True
        await t
        assert n == 5000
        return ticks

    assert uvloop.run(go()) >= 5000 // 1024


# -- the scripted scenario -------------------------------------------------------------------------


def test_a_script_is_not_changed_by_a_request_without_parallel_calls() -> None:
    """``parallel_tool_calls: false`` capped the directive's calls to one *in the script's own
    Directives*: every later request of that turn got one call, whatever it asked."""
    sim = SimulatorBackend(rate=0, script=Script(["tools:2"]))
    assert len(calls_of(collect(sim, req(tools=[TOOL, OTHER], parallel=False)))) == 1
    assert len(calls_of(collect(sim, req(tools=[TOOL, OTHER], parallel=True)))) == 2


def test_a_script_counts_parallel_calls_as_one_turn(tmp_path: Path) -> None:
    """README: the entry is picked "by the number of assistant turns already in the conversation".
    Each function call counted as a turn: after one turn of two parallel calls the script skipped
    its second entry."""
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"turns": ["tools:2", "text,tokens:3", "tools:1"]}))
    sim = SimulatorBackend(rate=0, script=Script.load(path))
    history: list[Any] = [USER]
    first = collect(sim, req(history, tools=[TOOL, OTHER]))
    assert len(calls_of(first)) == 2
    history += [
        FunctionCall(call_id="call_1", name="get_weather", arguments="{}"),
        FunctionCall(call_id="call_2", name="get_time", arguments="{}"),
        FunctionCallOutput(call_id="call_1", output="sunny"),
        FunctionCallOutput(call_id="call_2", output="noon"),
    ]
    second = collect(sim, req(history, tools=[TOOL, OTHER]))
    assert sum(isinstance(c, TextDelta) for c in second) == 3 and not calls_of(second)
    history += [Message(role="assistant", content="a b c"), USER]
    third = collect(sim, req(history, tools=[TOOL, OTHER]))
    assert len(calls_of(third)) == 1


# -- tool_choice -----------------------------------------------------------------------------------


ALLOWED_AUTO = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_time"}]}


def test_allowed_tools_auto_answers_a_tool_output_with_text() -> None:
    """``allowed_tools`` in mode ``auto`` was read as ``required``: a function-call output got
    another call, and an agent loop never ended (README: a function-call output gets a text
    answer; only ``required`` or a named function always calls)."""
    sim = SimulatorBackend(rate=0)
    first = collect(sim, req(tools=[TOOL, OTHER], choice=ALLOWED_AUTO))
    assert calls_of(first) == ["get_time"]
    history = [USER, FunctionCall(call_id="c1", name="get_time", arguments="{}"), FunctionCallOutput(call_id="c1", output="noon")]
    second = collect(sim, req(history, tools=[TOOL, OTHER], choice=ALLOWED_AUTO))
    assert not calls_of(second) and second[-1] == Finish("stop")
    required = {**ALLOWED_AUTO, "mode": "required"}
    assert calls_of(collect(sim, req(history, tools=[TOOL, OTHER], choice=required))) == ["get_time"]


def test_allowed_tools_without_a_function_never_calls_one_it_does_not_allow() -> None:
    """Allowed tools that name no function tool (only a hosted one): the simulator fell back to
    every tool and called ``get_weather``, which the request did not allow (the chat backends
    send no tools then, and the model answers in text)."""
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "file_search"}]}
    sim = SimulatorBackend(rate=0)
    chunks = collect(sim, req(tools=[TOOL], choice=choice))
    assert not calls_of(chunks) and chunks[-1] == Finish("stop")
    with pytest.raises(errors.InvalidRequest) as info:
        collect(sim, req(tools=[TOOL], choice=choice, metadata={"sim": "tools:1"}))
    assert info.value.param == "tools"


# -- arguments valid for the schema ----------------------------------------------------------------


def test_arguments_follow_refs_and_bounds() -> None:
    """Schemas as SDKs generate them (pydantic: ``$defs`` and ``$ref``) and with bounds: a ``$ref``
    became the string "example ...", an integer ignored ``maximum`` and a fractional ``minimum``,
    a string its ``maxLength``, an array its ``maxItems``."""
    schema = {
        "type": "object",
        "$defs": {"Loc": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}},
        "properties": {
            "loc": {"$ref": "#/$defs/Loc"},
            "n": {"type": "integer", "minimum": 1.5},
            "m": {"type": "integer", "maximum": 0},
            "x": {"type": "number", "exclusiveMinimum": 2, "maximum": 2.5},
            "s": {"type": "string", "maxLength": 3},
            "t": {"type": "string", "minLength": 40},
            "e": {"type": "array", "items": {"type": "string"}, "maxItems": 0},
            "u": {"type": "string", "format": "uuid"},
        },
        "required": ["loc", "n", "m", "x", "s", "t", "e", "u"],
    }
    v = json.loads(_example_arguments(FunctionTool(name="f", parameters=schema)))
    assert v["loc"] == {"lat": 1.5}
    assert isinstance(v["n"], int) and v["n"] >= 1.5
    assert isinstance(v["m"], int) and v["m"] <= 0
    assert 2 < v["x"] <= 2.5
    assert isinstance(v["s"], str) and len(v["s"]) <= 3
    assert len(v["t"]) >= 40
    assert v["e"] == []
    assert len(v["u"]) == 36 and v["u"].count("-") == 4
    assert example_value({"type": "array", "items": {"type": "number"}, "minItems": 2}) == [1.5, 1.5]  # unchanged


@pytest.mark.parametrize("content", ['{"turns": "text"}', '{"turns": ["text", "bogus"]}'])
def test_a_bad_script_is_named_as_the_script(tmp_path: Path, content: str) -> None:
    """A ``--sim-script`` whose turns are a string was read character by character, and its bad
    directive was reported as "Invalid simulator directive 't' in metadata.sim" (a request field)."""
    path = tmp_path / "script.json"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        Script.load(path)
    assert "metadata.sim" not in str(info.value) and "script" in str(info.value)


def test_structured_examples_hold_to_patterns_steps_and_recursive_schemas() -> None:
    """What ``responses.parse`` checks with pydantic: a string ``pattern`` (a zip code), a
    number's ``multipleOf``, and a recursive model (its arrays end empty, a nullable branch ends
    with null), where the simulator wrote ``"example zip"``, ``1.5`` and a ``null`` child."""
    from typing import Optional

    from pydantic import BaseModel, Field

    class Address(BaseModel):
        zip: str = Field(pattern=r"^[0-9]{5}$")
        code: str = Field(pattern=r"^[A-Z]{2}-\d{3}$")
        step: float = Field(multiple_of=0.4)
        bounded: float = Field(multiple_of=0.25, ge=1.1, le=1.4)

    class Node(BaseModel):
        name: str
        children: list["Node"]

    class Chain(BaseModel):
        next: Optional["Chain"]

    for model in (Address, Node, Chain):
        value = example_value(model.model_json_schema())
        model.model_validate(value)  # raises on a value the schema refuses
    assert example_value({"type": "string", "pattern": r"(a)\1"}) == "example value"  # unwritable: as before


def test_structured_examples_hold_to_lengths_with_patterns_unique_items_tuples_and_min_properties() -> None:
    """More of what pydantic (``responses.parse``) and zod check: a pattern with a ``minLength``
    (a hash), ``uniqueItems`` (a set, a list of distinct numbers or enum values), ``prefixItems``
    (a tuple) and ``minProperties``. The simulator wrote ``"0"`` for the hash, the same item
    twice, one item for a pair and no property."""
    from enum import Enum
    from typing import Annotated

    from pydantic import BaseModel, Field

    class Color(str, Enum):
        red = "red"
        blue = "blue"

    class Commit(BaseModel):
        sha: str = Field(pattern=r"^[0-9a-f]+$", min_length=40, max_length=40)
        ticket: str = Field(pattern=r"^[A-Z]{2}-\d+$", min_length=8)
        tags: set[str] = Field(min_length=2)
        colors: set[Color] = Field(min_length=2)
        steps: Annotated[list[int], Field(min_length=3, json_schema_extra={"uniqueItems": True})]
        bounded: Annotated[list[int], Field(min_length=3, json_schema_extra={"uniqueItems": True, "items": {"type": "integer", "maximum": 5}})]
        pair: tuple[int, str]

    value = example_value(Commit.model_json_schema())
    got = Commit.model_validate(value)  # raises on a value the schema refuses
    assert len(got.sha) == 40 and len(got.tags) == 2 and len(got.colors) == 2
    assert len(set(value["steps"])) == 3 and len(set(value["bounded"])) == 3 and max(value["bounded"]) <= 5
    assert value["pair"][0] == 1 and isinstance(value["pair"][1], str)
    some = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": [], "minProperties": 1}
    assert example_value(some) == {"a": "example a"}
    assert example_value({**some, "required": ["b"]}) == {"b": 1}  # the required one counts
    assert example_value({**some, "minProperties": 2}) == {"a": "example a", "b": 1}
    assert example_value({**some, "required": ["a"], "minProperties": 2}) == {"a": "example a", "b": 1}
    assert example_value({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}) == {"key1": 1, "key2": 1}
    # a pattern lengthened to its minLength exactly where what follows the repeat is fixed
    for pattern, length, want in ((r"^\d+px$", 4, "00px"), (r"^[a-z]+\.com$", 8, "aaaa.com"), (r"^v\d+\.\d+$", 6, "v000.0")):
        assert example_value({"type": "string", "pattern": pattern, "minLength": length, "maxLength": length}) == want
    # draft 7's tuple: items as a list
    assert example_value({"type": "array", "items": [{"type": "integer"}, {"type": "boolean"}], "minItems": 2}) == [1, True]
    # numbers kept within a double and integers integers
    huge = example_value({"type": "array", "minItems": 3, "uniqueItems": True, "items": {"type": "number", "multipleOf": 1e308}})
    assert all(math.isfinite(v) for v in huge)
    halves = example_value({"type": "array", "minItems": 3, "uniqueItems": True, "items": {"type": "integer", "minimum": 0, "multipleOf": 0.5}})
    assert halves == [0, 1, 2]


def test_unique_enum_values_count_against_the_arguments_bound() -> None:
    """Each distinct enum value a ``uniqueItems`` array takes is charged to the arguments' bound:
    an enum of large strings in nested arrays made 25 MB of arguments from a small schema."""
    from hotloop.backends.simulator import _TooLarge

    big = {"type": "string", "enum": ["a", *("x" * 5000 + str(i) for i in range(63))]}
    inner = {"type": "array", "items": big, "minItems": 64, "uniqueItems": True}
    with pytest.raises(_TooLarge):
        example_value({"type": "array", "items": inner, "minItems": 20})
    small = example_value({"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 3, "uniqueItems": True})
    assert small == ["a", "b", "c"]


def test_a_clients_pattern_is_matched_with_a_time_bound_and_never_fails_the_response() -> None:
    """A string ``pattern`` was run with ``re`` against ``"example <property name>"``, on the event
    loop and without bound: ``(a|aa)+c`` with a long property name held every connection for
    seconds (each character doubling it); and an ECMA-262 pattern ``re`` cannot read
    (``\\p{Lu}``), a malformed one, or one whose shortest match is huge failed the response (502)."""
    name = "a" * 60
    schema = {"type": "object", "properties": {name: {"type": "string", "pattern": "(a|aa)+c"}}, "required": [name]}
    t0 = time.perf_counter()
    value = example_value(schema)
    assert time.perf_counter() - t0 < 5  # (with re: about 10^12 steps)
    assert value[name] == "ac"  # written from the pattern
    # many such patterns in one document: a bounded number of matches
    many = {"type": "object", "properties": {f"{name}{i}": {"type": "string", "pattern": "(a|aa)+c"} for i in range(200)}}
    t0 = time.perf_counter()
    assert set(example_value(many).values()) == {"ac"}
    assert time.perf_counter() - t0 < 5
    for pattern in (r"^\p{Lu}\p{Ll}+$", "(a|b", "a{1000000000}", "(a{1000}){1000}"):
        assert isinstance(example_value({"type": "string", "pattern": pattern}), str)  # no exception
    for fmt in ({"type": "number", "minimum": 1e308, "multipleOf": 1e-10}, {"type": "string", "pattern": "(a|b"}):
        doc = TextFormat(type="json_schema", name="f", schema={"type": "object", "properties": {"x": fmt}, "required": ["x"]})
        try:
            _example_document(doc)
        except errors.InvalidValue:
            pass  # a 400 at worst, never another exception (a 502)
