"""``truncation: "auto"`` along a chain of ``previous_response_id`` turns when a call it dropped
gets its output later (:class:`hotloop.state.context.DroppedCalls`): the chain drops, keeps and
refuses what a request holding the whole history does, also across a stored record."""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import pytest

from hotloop import errors
from hotloop.models import ModelLimits
from hotloop.pipeline import window
from hotloop.pipeline.classifiers import MAX_STATE_BYTES, Frozen, freeze
from hotloop.pipeline.post import from_record, to_record
from hotloop.pipeline.prepare import Plan
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, Message
from hotloop.state.context import (
    DROPPED_CALLS, DROPPED_CALLS_BYTES, DROPPED_CALLS_STATE, CachedResponse, DroppedCalls,
)
from tests.unit.test_window import finish, plan_for
from tests.unit.test_window_audit import chain_as_scratch, history_of


def _quiet(_: str) -> None:
    pass


# -- the example the property test found, and variants ---------------------------------------


@pytest.mark.parametrize("reload", [False, True])
def test_the_stored_example(reload: bool) -> None:
    """[call c0a] [call c0b] [both outputs], window 40: the second turn drops the unanswered
    c0a; its output then was a 400 "No tool call found" where the whole history is refused as
    too long (no cut keeps c0a and c0b with their outputs, and every item is one of theirs)."""
    assert chain_as_scratch(history_of([("parallel", 12)]), {1, 2}, 40, True, None, reload, _quiet) == 3


@pytest.mark.parametrize("reload", [False, True])
@pytest.mark.parametrize(
    ("events", "cuts", "win"),
    [
        ([("user", 30), ("parallel", 12), ("user", 5)], {3}, 40),  # the outputs' turn drops through them
        ([("user", 30), ("parallel", 12), ("user", 5)], {3, 4}, 40),  # ... or cannot, and is refused
        ([("user", 30), ("parallel", 12), ("user", 5)], {2, 3, 4, 5}, 60),
        ([("same_id", 30), ("user", 10), ("same_id", 10), ("user", 3)], {3}, 45),
        ([("same_id", 30), ("user", 10), ("same_id", 10), ("user", 3)], {1, 3, 4}, 60),
        ([("call", 40), ("parallel", 30), ("call", 5), ("user", 3)], {1, 3, 5, 7}, 90),
    ],
)
def test_variants(events: list[tuple[str, int]], cuts: set[int], win: int, reload: bool) -> None:
    for instructions in (False, True):
        for mot in (None, 16):
            if win - (mot or 0) > 20:
                chain_as_scratch(history_of(events), cuts, win, instructions, mot, reload, _quiet)


# -- the rules, one by one ---------------------------------------------------------------------


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def _call(cid: str, size: int = 40) -> dict[str, Any]:
    return {"type": "function_call", "call_id": cid, "name": "f", "arguments": json.dumps({"q": "x " * size})}


def _out(cid: str, text: str = "ok") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": cid, "output": text}


def _body(items: list[dict[str, Any]], parent: CachedResponse | None = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "instructions": "Be brief.", "input": items, "truncation": "auto", **kw}
    if parent is not None:
        body["previous_response_id"] = parent.id
    return body


def _tokens(items: list[dict[str, Any]]) -> int:
    return plan_for(_body(items)).input_tokens


def _shape(plan: Plan) -> list[str]:
    out = []
    for it in plan.items:
        if type(it) is Message:
            out.append(str(it.content))  # type: ignore[union-attr]
        else:
            out.append(("call " if type(it) is FunctionCall else "out ") + it.call_id)  # type: ignore[union-attr]
    return out


def _turns(turns: list[list[dict[str, Any]]], win: int) -> tuple[CachedResponse, int]:
    """Send ``turns`` as a chain (each must succeed); the last response and the items dropped."""
    parent = None
    dropped = 0
    for j, items in enumerate(turns):
        plan = plan_for(_body(items, parent), parent)
        dropped += window.fit(plan, ModelLimits(win), None, "auto")
        parent = finish(plan, f"resp_{j}", [])
    assert parent is not None
    return parent, dropped


def _scratch(items: list[dict[str, Any]], win: int) -> tuple[Plan, int]:
    plan = plan_for(_body(items))
    return plan, window.fit(plan, ModelLimits(win), None, "auto")


U0, U1, U2 = _user("hello " * 10), _user("short"), _user("last")
A, B = _call("a"), _call("b")


def _win() -> int:
    """Turn 1 ([call b, u1] after [u0, call a]) must drop u0 and call a (u0 alone is one
    token short), and turn 0 fits."""
    win = _tokens([A, B, U1]) - 1  # the whole history less u0, less one
    assert _tokens([U0, A]) <= win
    return win


@pytest.mark.parametrize("reload", [False, True])
def test_an_output_of_a_dropped_call_goes_with_it_even_when_the_input_fits(reload: bool) -> None:
    win = _win()
    parent, dropped = _turns([[U0, A], [B, U1]], win)
    assert dropped == 2 and parent.context.dropped is not None
    assert parent.context.dropped.calls == {"a": False} and not parent.context.dropped.forced
    if reload:
        parent = from_record(to_record(parent))
    new = [_out("a"), _out("b"), U2]
    plan = plan_for(_body(new, parent), parent)
    assert plan.input_tokens <= win  # it fits: the cut is for the output of a
    assert plan.context.dropped is not None and plan.context.dropped.forced
    assert window.fit(plan, ModelLimits(win), None, "auto") == 4 == plan.truncated
    assert _shape(plan) == ["last"]
    scratch, scratch_dropped = _scratch([U0, A, B, U1, *new], win)
    assert _shape(scratch) == ["last"] and scratch_dropped == 2 + 4
    assert plan.input_tokens == scratch.input_tokens
    # both calls dropped now have their outputs: nothing left to remember (nor to store), the
    # flag went with the cut
    assert plan.context.dropped is None
    assert DROPPED_CALLS_STATE not in (finish(plan, "resp_2", []).states or {})


@pytest.mark.parametrize("mode", ["disabled", None])
def test_without_auto_the_output_of_a_dropped_call_is_refused(mode: str | None) -> None:
    """From scratch the whole history holds the call, but it did not fit the window (that is why
    the call was dropped): the same code, context_length_exceeded, keeping the parent; the
    message says what happened and what to do."""
    win = _win()
    parent, _ = _turns([[U0, A], [B, U1]], win)
    new = [_out("a"), _out("b"), U2]
    with pytest.raises(window.WindowExceeded) as ei:
        plan_for(_body(new, parent, truncation=mode), parent)
    err = ei.value
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "input[0].call_id")
    assert "truncation dropped that call" in err.message and "'auto'" in err.message
    with pytest.raises(errors.ContextLengthExceeded) as scratch:
        window.fit(plan_for(_body([U0, A, B, U1, *new], truncation=mode)), ModelLimits(win), None, mode)
    assert scratch.value.code == err.code
    # the retry with "auto" goes through
    plan = plan_for(_body(new, parent), parent)
    assert window.fit(plan, ModelLimits(win), None, "auto") == 4


def test_an_output_unknown_to_the_chain_is_still_the_400() -> None:
    win = _win()
    parent, _ = _turns([[U0, A], [B, U1]], win)
    with pytest.raises(errors.InvalidRequest) as ei:
        plan_for(_body([_out("zz"), U2], parent), parent)
    assert not isinstance(ei.value, errors.ContextLengthExceeded)
    assert ei.value.message == "No tool call found for function call output with call_id zz."


@pytest.mark.parametrize("reload", [False, True])
def test_outputs_arriving_across_turns(reload: bool) -> None:
    """Parallel calls a and b; b's output comes first (the cut drops a, unanswered), a's a turn
    later: that turn drops through it (b with its output included), or, when a's output is the
    input's last item, is refused, as from scratch."""
    t0, t1 = [U0, A, B], [_out("b", "result " * 20), U1]
    win = _tokens([A, B, *t1]) - 1
    assert _tokens(t0) <= win
    for last in ([_out("a"), U2], [_out("a")]):
        assert chain_as_scratch([*t0, *t1, *last], {3, 5}, win, True, None, reload, _quiet) == 3
    parent, dropped = _turns([t0, t1], win)
    assert dropped == 2 and parent.context.dropped is not None and parent.context.dropped.calls == {"a": False}
    if reload:
        parent = from_record(to_record(parent))
    plan = plan_for(_body([_out("a"), U2], parent), parent)
    assert window.fit(plan, ModelLimits(win), None, "auto") == 4  # call b, its output, u1, a's output
    assert _shape(plan) == ["last"]
    plan = plan_for(_body([_out("a")], parent), parent)
    with pytest.raises(window.WindowExceeded) as ei:
        window.fit(plan, ModelLimits(win), None, "auto")
    assert ei.value.code == "context_length_exceeded" and "call_id a " in ei.value.message


def test_a_call_id_used_again_is_a_new_call() -> None:
    """A dropped call that was answered is not remembered: a new call with its id is a new call
    (pairs with the outputs after it), as from scratch, and nothing is stored."""
    first = [_call("call_1"), _out("call_1", "result " * 60)]
    again = [_call("call_1", 5), _out("call_1"), _user("next")]
    big = _user("more " * 30)
    win = _tokens(first) + 5
    parent, dropped = _turns([first, [big]], win)
    assert dropped == 2 and parent.context.dropped is None
    assert DROPPED_CALLS_STATE not in (parent.states or {})
    plan = plan_for(_body(again, parent), parent)
    assert plan.context.dropped is None
    assert window.fit(plan, ModelLimits(win), None, "auto") == 0
    assert _shape(plan) == [big["content"], "call call_1", "out call_1", "next"]
    entry = finish(plan, "resp_x", [])
    assert DROPPED_CALLS_STATE not in (entry.states or {})
    assert chain_as_scratch([*first, big, *again], {2, 3}, win, True, None, False, _quiet) == 3


@pytest.mark.parametrize("reload", [False, True])
def test_a_duplicate_output_of_an_answered_dropped_call_is_the_400(reload: bool) -> None:
    """An answered dropped call is forgotten: one more output with its id is the 400 of an
    unknown call id, as before any truncation (from scratch it would go with the call)."""
    first = [_call("call_1"), _out("call_1", "result " * 60)]
    big = _user("more " * 30)
    win = _tokens(first) + 5
    parent, dropped = _turns([first, [big]], win)
    assert dropped == 2 and parent.context.dropped is None
    if reload:
        parent = from_record(to_record(parent))
    with pytest.raises(errors.InvalidRequest) as ei:
        plan_for(_body([_out("call_1"), U2], parent), parent)
    assert not isinstance(ei.value, errors.ContextLengthExceeded)
    assert ei.value.message == "No tool call found for function call output with call_id call_1."


@pytest.mark.parametrize("reload", [False, True])
def test_two_calls_with_one_id_and_one_output_are_remembered_until_the_second(reload: bool) -> None:
    """Two calls with one id before an output are one group: dropped with one output, it still
    awaits one (remembered, answered, owed 1); the second output goes with it, as from scratch,
    and then nothing is left to remember. A new call with the id instead starts afresh."""
    twin = [_call("tw"), _call("tw", 5), _out("tw", "result " * 60)]
    big = _user("more " * 30)
    win = _tokens(twin) + 5
    parent, dropped = _turns([twin, [big]], win)
    assert dropped == 3 and parent.context.dropped is not None
    assert parent.context.dropped.calls == {"tw": True} and parent.context.dropped.owing("tw") == 1
    if reload:
        parent = from_record(to_record(parent))
    plan = plan_for(_body([_out("tw"), U2], parent), parent)
    assert plan.context.dropped is not None and plan.context.dropped.forced
    assert window.fit(plan, ModelLimits(win), None, "auto") == 2  # big, the second output
    assert _shape(plan) == ["last"] and plan.context.dropped is None
    assert DROPPED_CALLS_STATE not in (finish(plan, "resp_2", []).states or {})
    for last in ([_out("tw"), U2], [_call("tw"), _out("tw"), U2]):
        assert chain_as_scratch([*twin, big, *last], {3, 4}, win, True, None, reload, _quiet) == 3
    # three calls, one output: owed 2, stored as such
    triple = [_call("tr"), _call("tr", 5), _call("tr", 6), _out("tr", "result " * 60)]
    parent, _ = _turns([triple, [_user("more " * 40)]], _tokens(triple) + 5)
    assert parent.context.dropped is not None and parent.context.dropped.owing("tr") == 2
    assert parent.states is not None and parent.states[DROPPED_CALLS_STATE].value["calls"] == [["tr", True, 2]]
    again = from_record(to_record(parent))
    plan_for(_body([U2], again), again)
    assert again.context.dropped is not None and again.context.dropped.owing("tr") == 2


def test_an_agent_session_remembers_nothing() -> None:
    """Each call answered in the next turn, truncating again and again: every call dropped has
    its output, so the memory stays empty and no turn stores it."""
    win, parent, pending, truncated = 400, None, None, 0
    for t in range(40):
        items = [_user("go on " * 5)] if pending is None else [_out(pending, "result " * 30)]
        plan = plan_for(_body(items, parent), parent)
        truncated += bool(window.fit(plan, ModelLimits(win), None, "auto"))
        pending = f"call_{t:024x}"
        parent = finish(plan, f"resp_{t}", [_call(pending, 10)])
        assert parent.context.dropped is None and DROPPED_CALLS_STATE not in (parent.states or {})
    assert truncated > 20


@pytest.mark.parametrize("reload", [False, True])
def test_a_call_joining_a_dropped_unanswered_one(reload: bool) -> None:
    """Two calls with one id before any output are one group: the second call, sent with
    truncation disabled, is kept (the chain goes on from its truncated history), and marks
    the context; the next "auto" turn cuts past it, as from scratch, also after a reload."""
    win = _win()
    parent, _ = _turns([[U0, A], [B, U1]], win)
    plan = plan_for(_body([_call("a", 2), U2], parent, truncation="disabled"), parent)
    assert window.fit(plan, ModelLimits(win), None, "disabled") == 0
    assert plan.context.dropped is not None and plan.context.dropped.forced
    entry = finish(plan, "resp_2", [])
    if reload:
        entry = from_record(to_record(entry))
    tail = _user("tail")
    nxt = plan_for(_body([tail], entry), entry)
    assert window.fit(nxt, ModelLimits(win), None, "auto") == 3  # call b, u1, the second call a
    assert _shape(nxt) == ["last", "tail"]
    scratch, _ = _scratch([U0, A, B, U1, _call("a", 2), U2, tail], win)
    assert _shape(scratch) == _shape(nxt)


def test_a_model_call_with_a_dropped_id_marks_the_context() -> None:
    win = _win()
    parent, _ = _turns([[U0, A], [B, U1]], win)
    plan = plan_for(_body([U2], parent), parent)
    assert window.fit(plan, ModelLimits(win), None, "auto") == 0
    entry = finish(plan, "resp_2", [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"}])
    assert entry.context.dropped is not None and entry.context.dropped.forced
    assert entry.states is not None and entry.states[DROPPED_CALLS_STATE].value["forced"] is True


# -- what it costs and where it lives ----------------------------------------------------------


def test_nothing_truncated_nothing_added() -> None:
    """The common path: no memory, the states passed on as they were (the same object)."""
    parent = finish(plan_for(_body([U0, A])), "resp_0", [])
    parent.states = {"secrets": {"n": 1}}
    plan = plan_for(_body([_out("a"), U1], parent), parent)
    assert plan.context.dropped is None
    assert window.fit(plan, ModelLimits(10_000), None, "auto") == 0
    assert finish(plan, "resp_1", []).states is parent.states


def test_a_deferred_plan_with_such_an_output_is_counted_and_fitted() -> None:
    """Before its counts, such an input has no upper bound below any window (the engine then
    counts it and calls fit, which must cut)."""
    win = _win()
    parent, _ = _turns([[U0, A], [B, U1]], win)
    plan = plan_for(_body([_out("a", "w " * 5000), U2], parent), parent, defer=True)
    assert not plan.settled and window.pending_cut(plan)
    assert window.upper_bound(plan) == sys.maxsize
    other = plan_for(_body([_user("w " * 5000)], parent), parent, defer=True)
    assert not other.settled and not window.pending_cut(other) and window.upper_bound(other) < sys.maxsize


def test_the_stored_record_keeps_them() -> None:
    win = _win()
    parent, _ = _turns([[U0, A], [B, U1]], win)
    assert parent.states is not None
    state = parent.states[DROPPED_CALLS_STATE]
    assert type(state) is Frozen and state.value == {"calls": [["a", False]], "forced": False}
    assert freeze(parent.states) == {DROPPED_CALLS_STATE: state.value}
    # a turn that keeps its parent's memory stores it again as the same object (nothing made anew)
    plan = plan_for(_body([U2], parent), parent)
    assert window.fit(plan, ModelLimits(win), None, "auto") == 0
    assert finish(plan, "resp_2", []).states is parent.states
    again = from_record(to_record(parent))
    assert again.context.dropped is None  # restored when continued
    plan = plan_for(_body([U2], again), again)
    assert again.context.dropped is not None and again.context.dropped.calls == {"a": False}
    assert window.fit(plan, ModelLimits(win), None, "auto") == 0
    states = finish(plan, "resp_3", []).states
    assert states is again.states and states is not None  # the reloaded value, passed on
    assert freeze(states)[DROPPED_CALLS_STATE] is again.states[DROPPED_CALLS_STATE].value  # type: ignore[index]


def test_a_stand_in_parent_restores_nothing() -> None:
    """A full-history request that reused a cached prefix gets a stand-in parent (store false)
    with the entry's states: from the history its client sent nothing was dropped."""
    win = _win()
    parent, _ = _turns([[U0, A], [B, U1]], win)
    stand_in = CachedResponse(parent.response, from_record(to_record(parent)).context, 2, False, states=parent.states)
    with pytest.raises(errors.InvalidRequest) as ei:
        plan_for(_body([_out("a"), U2]), stand_in)
    assert not isinstance(ei.value, errors.ContextLengthExceeded)
    plan = plan_for(_body([U2]), stand_in)
    assert plan.context.dropped is None
    assert DROPPED_CALLS_STATE not in (finish(plan, "resp_s", []).states or {})


def test_bounded_newest_kept() -> None:
    many = [(f"call_{i}", i % 2 == 0, 1 + i % 3) for i in range(3 * DROPPED_CALLS)]
    d = DroppedCalls.bounded(many)
    assert d is not None and [(c, a, d.owing(c)) for c, a in d.calls.items()] == many[-DROPPED_CALLS:]
    long = [(f"{i:04d}" + "x" * 996, True, 1) for i in range(100)]
    d = DroppedCalls.bounded(long)
    assert d is not None and len(d.calls) == DROPPED_CALLS_BYTES // 1002 and "0099" + "x" * 996 in d.calls
    assert DroppedCalls.bounded([]) is None
    value = d.to_json()
    again = DroppedCalls.from_json(value)
    assert again is not None and again.calls == d.calls and again.to_json() is value
    # ids counted as JSON strings: the stored form stays under a chain state's bound
    quoted = [(f"{i:04d}" + '"' * 996, False, 100_000) for i in range(100)]
    d = DroppedCalls.bounded(quoted)
    assert d is not None and len(msgspec.json.encode(d.to_json())) < MAX_STATE_BYTES
    big = DroppedCalls.bounded([(f"call_{i:024x}", False, 100_000) for i in range(5000)])
    assert big is not None and len(msgspec.json.encode(big.to_json())) < MAX_STATE_BYTES
    bad: list[Any] = [None, [], {"calls": []}, {"calls": [["a"]], "forced": False}, {"calls": [["a", 1]], "forced": False},
                      {"calls": [["a", True, 0]], "forced": False}, {"calls": [["a", True, "2"]], "forced": False}]
    for value in bad:
        assert DroppedCalls.from_json(value) is None


def test_call_kinds() -> None:
    """What pairs (as the window's cuts pair them)."""
    plan = plan_for(_body([A, _out("a"), U1]))
    kinds = [type(x) for x in plan.items]
    assert kinds == [FunctionCall, FunctionCallOutput, Message]


def test_reasoning_is_counted_only_where_the_backend_is_sent_it() -> None:
    """``TokenCache.counts_reasoning`` off (the OpenAI-compatible dialect): a reasoning item, new
    input or a finished response's output, is 0 tokens, and an owner's view of the cache says the
    same; the other items' counts do not change."""
    from hotloop.pipeline import items as itemlib
    from hotloop.protocol.request import item_from_dict

    msg = item_from_dict({"type": "message", "role": "user", "content": "a question of some words"})
    thought = item_from_dict(
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "long thought " * 50}]}
    )
    counting = itemlib.TokenCache()
    not_counting = itemlib.TokenCache()
    not_counting.counts_reasoning = False
    _, with_r, _ = itemlib.analyze([msg, thought], counting)
    _, without_r, _ = itemlib.analyze([msg, thought], not_counting.view("tenant-a"))
    assert with_r[0] == without_r[0] > 0
    assert with_r[1] > 50 and without_r[1] == 0
    assert not_counting.view("tenant-a").counts_reasoning is False
