"""The simulator keeps to the request's ``tool_choice`` as a model under that constraint would,
whatever a ``metadata.sim`` directive or a ``--sim-script`` turn asks for: ``"none"`` answers in
text (the text the ``text`` directive gives the same request: deterministic) and never calls;
a named function is the one called (a scripted call of it keeps its exact arguments; scripted
calls of other tools are not made, and with none of it left the named function is called once
with arguments made from its schema)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from openai import OpenAI

from hotloop import errors
from hotloop.backends.base import BackendRequest
from hotloop.backends.simulator import Script, SimulatorBackend, _example_arguments
from hotloop.protocol.chunks import Finish, ReasoningDelta, TextDelta, ToolCallDelta
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, FunctionTool, InputText, Message
from tests.conftest import Server, run_server
from tests.unit.test_simulator_audit import collect

SHELL = FunctionTool(
    name="exec_command",
    parameters={"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
)
EDIT = FunctionTool(
    name="apply_patch",
    parameters={
        "type": "object",
        "properties": {"path": {"type": "string"}, "line": {"type": "integer", "minimum": 3}},
        "required": ["path", "line"],
        "additionalProperties": False,
    },
)
USER = Message(role="user", content=[InputText(text="fix the bug")])
NAMED_EDIT = {"type": "function", "name": "apply_patch"}


def req(choice: Any = "auto", items: list[Any] | None = None, tools: tuple[FunctionTool, ...] = (SHELL, EDIT),
        parallel: bool = True, **kw: Any) -> BackendRequest:
    return BackendRequest(model="hotloop-sim", instructions=None, items=list(items if items is not None else [USER]),
                          tools=list(tools), tool_choice=choice, parallel_tool_calls=parallel, **kw)


def calls(chunks: list[Any]) -> list[tuple[str, str]]:
    """(name, arguments) of each call streamed."""
    deltas = [c for c in chunks if isinstance(c, ToolCallDelta)]
    names = {c.index: c.name for c in deltas if c.name}
    return [(names[k], "".join(c.arguments or "" for c in deltas if c.index == k)) for k in sorted(names)]


def text(chunks: list[Any]) -> str:
    return "".join(c.text for c in chunks if isinstance(c, TextDelta))


def script(tmp_path: Path, *turns: Any) -> Script:
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"turns": list(turns)}))
    return Script.load(path)


# -- tool_choice "none" ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["tools:2", "tools:1,tokens:7", "text+tool", "tool"])
def test_none_wins_over_a_tools_directive(spec: str) -> None:
    sim = SimulatorBackend(rate=0, seed=3)
    chunks = collect(sim, req("none", metadata={"sim": spec}))
    assert calls(chunks) == [] and chunks[-1] == Finish("stop")
    # the text the `text` directive gives the same request (with the directive's length)
    as_text = spec.replace("tools:2", "text").replace("tools:1", "text").replace("text+tool", "text")
    as_text = "text" if as_text == "tool" else as_text
    assert text(chunks) == text(collect(sim, req("none", metadata={"sim": as_text}))) != ""
    assert chunks == collect(SimulatorBackend(rate=0, seed=3), req("none", metadata={"sim": spec}))  # deterministic


def test_none_keeps_the_rest_of_the_directives() -> None:
    sim = SimulatorBackend(rate=0)
    chunks = collect(sim, req("none", metadata={"sim": "reasoning,tools:3,tokens:5"}))
    assert any(isinstance(c, ReasoningDelta) for c in chunks)
    assert calls(chunks) == [] and len([c for c in chunks if isinstance(c, TextDelta)]) == 5
    with pytest.raises(errors.RateLimited):
        collect(sim, req("none", metadata={"sim": "tools:1,rate_limit"}))


def test_none_wins_over_scripted_calls(tmp_path: Path) -> None:
    s = script(tmp_path, {"sim": "tokens:6", "calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]}, "tools:2")
    sim = SimulatorBackend(rate=0, script=s)
    chunks = collect(sim, req("none"))
    assert calls(chunks) == [] and chunks[-1] == Finish("stop")
    assert len([c for c in chunks if isinstance(c, TextDelta)]) == 6  # the turn's tokens:6
    # the next turn (a tools:N entry) too
    history = [USER, Message(role="assistant", content="done"), USER]
    later = collect(sim, req("none", items=history))
    assert calls(later) == [] and later[-1] == Finish("stop") and text(later)
    # "auto" still calls as scripted
    assert calls(collect(sim, req("auto"))) == [("exec_command", '{"cmd":"ls"}')]


def test_none_without_any_tool_is_text_too() -> None:
    """A request with no tools and tool_choice none: text (a tools directive is no 400 then)."""
    chunks = collect(SimulatorBackend(rate=0), req("none", tools=(), metadata={"sim": "tools:1"}))
    assert calls(chunks) == [] and text(chunks)


# -- a named function ------------------------------------------------------------------------------


def test_a_named_function_replaces_scripted_calls_of_other_tools(tmp_path: Path) -> None:
    """The script calls exec_command; the request forces apply_patch: a model under that
    constraint calls apply_patch, with arguments it makes (from the schema), once."""
    s = script(tmp_path, {"calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}},
                                    {"name": "exec_command", "arguments": {"cmd": "pwd"}}]})
    sim = SimulatorBackend(rate=0, script=s)
    chunks = collect(sim, req(NAMED_EDIT))
    assert calls(chunks) == [("apply_patch", _example_arguments(EDIT))]
    args = json.loads(calls(chunks)[0][1])
    assert isinstance(args["path"], str) and args["line"] >= 3
    assert chunks[-1] == Finish("tool_calls")
    assert chunks == collect(sim, req(NAMED_EDIT))  # deterministic


def test_a_named_function_keeps_the_scripted_calls_of_it(tmp_path: Path) -> None:
    s = script(tmp_path, {"sim": "reasoning", "calls": [
        {"name": "exec_command", "arguments": {"cmd": "ls"}},
        {"name": "apply_patch", "arguments": '{"path": "a.py", "line": 9}'},
        {"name": "apply_patch", "arguments": {"path": "b.py", "line": 4}},
    ]})
    sim = SimulatorBackend(rate=0, script=s)
    chunks = collect(sim, req(NAMED_EDIT))
    assert calls(chunks) == [("apply_patch", '{"path": "a.py", "line": 9}'), ("apply_patch", '{"path":"b.py","line":4}')]
    assert any(isinstance(c, ReasoningDelta) for c in chunks) and chunks[-1] == Finish("tool_calls")
    assert [c.index for c in chunks if isinstance(c, ToolCallDelta) and c.name] == [0, 1]
    # serial calls only: the first of them
    assert calls(collect(sim, req(NAMED_EDIT, parallel=False))) == [("apply_patch", '{"path": "a.py", "line": 9}')]
    # the named one is exec_command: its own scripted call
    assert calls(collect(sim, req({"type": "function", "name": "exec_command"}))) == [("exec_command", '{"cmd":"ls"}')]


def test_a_named_function_after_a_tool_output_still_calls(tmp_path: Path) -> None:
    """A text turn of the script: a named tool_choice still forces its call (as without a script)."""
    s = script(tmp_path, {"calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]}, "text")
    sim = SimulatorBackend(rate=0, script=s)
    history = [USER, FunctionCall(call_id="c1", name="exec_command", arguments='{"cmd":"ls"}'),
               FunctionCallOutput(call_id="c1", output="a.py")]
    assert calls(collect(sim, req("auto", items=history))) == []  # the script's text turn
    assert [n for n, _ in calls(collect(sim, req(NAMED_EDIT, items=history)))] == ["apply_patch"]


def test_a_named_function_and_a_tools_directive_call_it() -> None:
    sim = SimulatorBackend(rate=0)
    assert [n for n, _ in calls(collect(sim, req(NAMED_EDIT, metadata={"sim": "tools:2"})))] == ["apply_patch"] * 2
    assert [n for n, _ in calls(collect(sim, req(NAMED_EDIT, metadata={"sim": "text"})))] == ["apply_patch"]


def test_scripted_calls_of_a_tool_the_request_lacks_are_still_a_400(tmp_path: Path) -> None:
    """Under auto or required the script and the request disagree: a 400 that names the tool."""
    s = script(tmp_path, {"calls": [{"name": "missing_tool", "arguments": {}}]})
    sim = SimulatorBackend(rate=0, script=s)
    for choice in ("auto", "required"):
        with pytest.raises(errors.InvalidRequest) as info:
            collect(sim, req(choice))
        assert "missing_tool" in info.value.message and info.value.param == "tools"


# -- through the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(tmp_path_factory.mktemp("sim-tool-choice"), "--sim-rate", "0") as s:
        yield s


def test_none_over_http_answers_with_a_message(srv: Server) -> None:
    client = OpenAI(api_key="sk-test", base_url=srv.v1, max_retries=0, timeout=10)
    tools: Any = [{"type": "function", "name": "exec_command", "parameters": SHELL.parameters}]
    r = client.responses.create(model="hotloop-sim", input="run ls", tools=tools, tool_choice="none",
                                metadata={"sim": "tools:2"}, store=False)
    assert r.status == "completed" and [o.type for o in r.output] == ["message"] and r.output_text
    r = client.responses.create(model="hotloop-sim", input="run ls", tools=tools + [
        {"type": "function", "name": "apply_patch", "parameters": EDIT.parameters}],
        tool_choice={"type": "function", "name": "apply_patch"}, metadata={"sim": "tools:1"}, store=False)
    assert [(o.type, getattr(o, "name", None)) for o in r.output] == [("function_call", "apply_patch")]


@pytest.mark.parametrize("choice", ["required", {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "apply_patch"}]}],
                         ids=["required", "allowed-required"])
def test_a_required_choice_makes_a_turn_that_asked_for_text_call_a_tool(choice: Any) -> None:
    """``tool_choice: "required"`` (or allowed tools in ``required`` mode) wins over a directive
    that asks for text, as the README says the choice wins: one call, of a tool it may call,
    after the reasoning asked for; a turn that asked for calls keeps them."""
    sim = SimulatorBackend(rate=0, seed=3)
    allowed = "exec_command" if choice == "required" else "apply_patch"
    for spec in ("text", "tokens:5", "reasoning"):
        chunks = collect(sim, req(choice, metadata={"sim": spec}))
        assert [name for name, _ in calls(chunks)] == [allowed] and text(chunks) == "", spec
        assert any(isinstance(c, ReasoningDelta) for c in chunks) == (spec == "reasoning")
    assert len(calls(collect(sim, req(choice, metadata={"sim": "tools:2"})))) == 2


def test_the_arguments_of_a_tool_called_many_times_are_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tools:64`` made one tool's arguments 64 times, each with a budget of its own (64 x 16
    pattern matches on the event loop); they are the same every time, and now made once."""
    from hotloop.backends import simulator

    made: list[str] = []

    def counted(tool: FunctionTool) -> str:
        made.append(tool.name)
        return _example_arguments(tool)

    monkeypatch.setattr(simulator, "_example_arguments", counted)
    chunks = collect(SimulatorBackend(rate=0, seed=3), req(NAMED_EDIT, metadata={"sim": "tools:8"}))
    assert len(calls(chunks)) == 8 and len({args for _, args in calls(chunks)}) == 1
    assert made == ["apply_patch"]
