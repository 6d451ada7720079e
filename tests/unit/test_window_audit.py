"""Audit of :mod:`hotloop.pipeline.window` and :mod:`hotloop.models`: the incremental path (a
chain of ``previous_response_id`` turns, truncated as it grows) decides and counts exactly as a
computation from scratch over the whole history; call ids a conversation reuses; the 400 after
a truncation that could not make the input fit; the tokenizer of provider-prefixed ids."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from hotloop import errors
from hotloop.models import O200K_BASE, O200K_HARMONY, ModelLimits, ModelRegistry
from hotloop.pipeline import window
from hotloop.pipeline.post import from_record, to_record
from hotloop.pipeline.prepare import Plan
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, Item, Message, OtherItem
from hotloop.state.context import CachedResponse
from tests.unit.test_window import finish, plan_for

# -- the incremental path against a computation from scratch ---------------------------------


def _event(kind: str, size: int, i: int) -> list[dict[str, Any]]:
    text = f"{i} " + "word " * size
    if kind in ("user", "developer", "assistant"):
        return [{"type": "message", "role": kind, "content": text}]
    if kind == "call":
        return [
            {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": json.dumps({"q": text})},
            {"type": "function_call_output", "call_id": f"c{i}", "output": text},
        ]
    if kind == "same_id":  # a call id the conversation uses again and again
        return [
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": text},
        ]
    assert kind == "parallel"
    return [
        {"type": "function_call", "call_id": f"c{i}a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": f"c{i}b", "name": "f", "arguments": json.dumps({"q": text})},
        {"type": "function_call_output", "call_id": f"c{i}a", "output": text},
        {"type": "function_call_output", "call_id": f"c{i}b", "output": "ok"},
    ]


def _key(it: Item) -> tuple[str, str]:
    if type(it) is Message:
        c = it.content  # type: ignore[union-attr]
        return it.role, c if isinstance(c, str) else c[0].text  # type: ignore[union-attr]
    return type(it).__name__, str(it.call_id)  # type: ignore[union-attr]


_EVENTS = st.lists(
    st.tuples(st.sampled_from(["user", "user", "developer", "assistant", "call", "same_id", "parallel"]), st.integers(0, 60)),
    min_size=1,
    max_size=12,
)


def _fit(plan: Plan, lim: ModelLimits, mot: int | None) -> tuple[int | None, str | None]:
    try:
        return window.fit(plan, lim, mot, "auto"), None
    except errors.ContextLengthExceeded as exc:
        return None, exc.message


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(_EVENTS, st.data(), st.integers(40, 700), st.booleans(), st.sampled_from([None, 16]), st.booleans())
def test_chained_truncation_is_truncation_from_scratch(
    events: list[tuple[str, int]], data: st.DataObject, win: int, instructions: bool, mot: int | None, reload: bool
) -> None:
    """Any history, split into turns any way, sent as a chain with ``truncation: "auto"``: every
    turn keeps the items, counts the tokens and (summed over the chain) drops the items a
    request holding the whole history drops, and refuses exactly when that request is refused
    (with the same message). ``reload``: each parent comes back from its stored record."""
    n = len(history_of(events))
    cuts = data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1), label="cuts") if n > 1 else set()
    chain_as_scratch(history_of(events), cuts, win, instructions, mot, reload)


def history_of(events: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [it for i, (kind, size) in enumerate(events) for it in _event(kind, size, i)]


def chain_as_scratch(
    items: list[dict[str, Any]], cuts: set[int], win: int, instructions: bool, mot: int | None, reload: bool,
    say: Callable[[str], None] = note,
) -> int:
    """The property of :func:`test_chained_truncation_is_truncation_from_scratch` for one
    history split at ``cuts``; the number of turns the chain took (it stops at a refusal).
    ``say``: where each turn's outcome goes (hypothesis' ``note``)."""
    n = len(items)
    bounds = [0, *sorted(cuts), n]
    extra: dict[str, Any] = {"instructions": "Be brief."} if instructions else {}
    if mot is not None:
        extra["max_output_tokens"] = mot
    lim = ModelLimits(win)
    parent: CachedResponse | None = None
    dropped_so_far = 0
    for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        body = {"model": "m", "input": items[lo:hi], "truncation": "auto", **extra}
        if parent is not None:
            body["previous_response_id"] = parent.id
        chained = plan_for(body, parent)
        scratch = plan_for({"model": "m", "input": items[:hi], "truncation": "auto", **extra})
        whole = scratch.input_tokens
        d1, e1 = _fit(chained, lim, mot)
        d2, e2 = _fit(scratch, lim, mot)
        say(f"turn {j}: items {lo}:{hi}, whole {whole}, chained {d1} {e1}, scratch {d2} {e2}")
        if e2 is not None:
            # a chain refuses what a request of the whole history refuses; its message counts
            # what it was given (the chain so far plus the turn), not what dropping left of it
            assert e1 is not None
            if dropped_so_far == 0:
                assert e1 == e2
            return j + 1
        assert e1 is None and d1 is not None and d2 is not None
        dropped_so_far += d1
        assert [_key(x) for x in chained.items] == [_key(x) for x in scratch.items]
        assert chained.input_tokens == scratch.input_tokens <= win - (mot or 0)
        assert dropped_so_far == d2
        entry = finish(chained, f"resp_{j}", [])
        parent = from_record(to_record(entry)) if reload else entry
    return len(bounds) - 1


# -- call ids used again -------------------------------------------------------------------


def _turn(i: int, cid: str) -> list[dict[str, Any]]:
    return [
        {"type": "message", "role": "user", "content": f"question {i}"},
        {"type": "function_call", "call_id": cid, "name": "f", "arguments": json.dumps({"q": i})},
        {"type": "function_call_output", "call_id": cid, "output": f"{i}: " + "result " * 60},
        {"type": "message", "role": "assistant", "content": f"done {i}"},
    ]


@pytest.mark.parametrize("cid", ["call_1", None])
def test_a_reused_call_id_pairs_each_call_with_its_output(cid: str | None) -> None:
    """Before: every ``call_1`` in the history made one span, so the only cut past the first
    question was the last turn's: 15 of 17 items dropped where 3 would do."""
    history = [it for i in range(4) for it in _turn(i, cid or f"c{i}")]
    history.append({"type": "message", "role": "user", "content": "last"})
    whole = plan_for({"model": "m", "input": history}).input_tokens
    question = whole - plan_for({"model": "m", "input": history[1:]}).input_tokens
    plan = plan_for({"model": "m", "input": history, "truncation": "auto"})
    assert window.fit(plan, ModelLimits(whole - question - 1), None, "auto") == 3
    assert [_key(x) for x in plan.items][:2] == [("assistant", "done 0"), ("user", "question 1")]
    assert plan.input_tokens == plan_for({"model": "m", "input": history[3:]}).input_tokens


def test_verbatim_items_reusing_a_call_id_pair_in_order() -> None:
    items = []
    for i in range(3):
        items += [
            {"type": "message", "role": "user", "content": f"question {i}"},
            {"type": "custom_tool_call", "call_id": "k", "name": "apply", "input": "patch " * 40},
            {"type": "custom_tool_call_output", "call_id": "k", "output": "applied " * 40},
        ]
    items.append({"type": "message", "role": "user", "content": "last"})
    whole = plan_for({"model": "m", "input": items}).input_tokens
    plan = plan_for({"model": "m", "input": items, "truncation": "auto"})
    assert window.fit(plan, ModelLimits(whole - 10), None, "auto") == 3  # the first question, call and output
    assert [it.data["type"] if isinstance(it, OtherItem) else it.role for it in plan.items][:3] == [  # type: ignore[union-attr]
        "user", "custom_tool_call", "custom_tool_call_output",
    ]


def test_unanswered_calls_with_one_id_and_outputs_stay_together() -> None:
    """Two calls with one id before any output (parallel calls a backend numbered alike), and
    two outputs of one call: no cut between them."""
    call = {"type": "function_call", "call_id": "x", "name": "f", "arguments": "{}"}
    outp = {"type": "function_call_output", "call_id": "x", "output": "ok " * 40}
    user = {"type": "message", "role": "user", "content": "q " * 40}
    items = [user, call, dict(call, arguments='{"a": 1}'), outp, dict(outp, output="fine " * 40), user]
    plan = plan_for({"model": "m", "input": items})
    assert window._forbidden_cuts(plan.items) == {2, 3, 4}
    kinds = [type(x) for x in plan.items]
    assert kinds[1:5] == [FunctionCall, FunctionCall, FunctionCallOutput, FunctionCallOutput]


# -- the 400 after a truncation that is not enough -----------------------------------------


@pytest.mark.parametrize("mot", [None, 20])
def test_failed_truncation_reports_the_input_as_sent(mot: int | None) -> None:
    items = [{"type": "message", "role": "user", "content": f"{i}: " + "word " * 80} for i in range(3)]
    items.append({"type": "message", "role": "user", "content": "word " * 500})
    body = {"model": "m", "input": items}
    whole = plan_for(body).input_tokens
    lim = ModelLimits(300)
    with pytest.raises(errors.ContextLengthExceeded) as disabled:
        window.fit(plan_for(body), lim, mot, "disabled")
    with pytest.raises(errors.ContextLengthExceeded) as auto:
        window.fit(plan_for({**body, "truncation": "auto"}), lim, mot, "auto")
    # the same figures; "auto" is not advised to a request that set it
    assert auto.value.message == disabled.value.message.replace(", or set truncation to 'auto'", "")
    assert "truncation" in disabled.value.message and "truncation" not in auto.value.message
    assert (auto.value.status, auto.value.type, auto.value.code, auto.value.param) == (
        400, "invalid_request_error", "context_length_exceeded", "input",
    )
    if mot is None:
        assert f"However, your input has {whole} tokens." in auto.value.message
    else:
        assert f"you requested {whole + mot} tokens ({whole} in the input, {mot} in the output)" in auto.value.message


# -- the registry --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "tokenizer"),
    [
        ("gpt-oss-120b", O200K_HARMONY),
        ("openai/gpt-oss-120b", O200K_HARMONY),  # vLLM's default served name, OpenRouter's id
        ("openai/gpt-oss-20b", O200K_HARMONY),
        ("gpt-oss:20b", O200K_HARMONY),  # Ollama's
        ("my-gpt-oss-finetune", O200K_BASE),
        ("gpt-oss-org/llama-3", O200K_BASE),
        ("llama3.1-8b", O200K_BASE),
    ],
)
def test_tokenizer_of_provider_prefixed_ids(model: str, tokenizer: str) -> None:
    assert ModelRegistry().get(model, {model: 4096}).tokenizer == tokenizer
    assert ModelRegistry().get(model).tokenizer == tokenizer
