"""The model registry, the context-window check and ``truncation: "auto"``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from hotloop import errors
from hotloop.backends.chat.backend import ChatBackend
from hotloop.models import (
    BUNDLED,
    O200K_BASE,
    O200K_HARMONY,
    ModelLimits,
    ModelLimitsError,
    ModelRegistry,
    load_overrides,
    parse_overrides,
)
from hotloop.pipeline import window
from hotloop.pipeline.post import from_record, to_record
from hotloop.pipeline.prepare import Plan, finished, prepare
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import FunctionCall, Message, OtherItem, decode_body, validate
from hotloop.state.context import CachedResponse

# -- the registry ------------------------------------------------------------------------------


def test_bundled_table() -> None:
    reg = ModelRegistry()
    gpt = reg.get("gpt-oss-120b")
    assert (gpt.context_window, gpt.max_output_tokens, gpt.tokenizer) == (131_072, 32_768, O200K_HARMONY)
    assert reg.get("gpt-oss-20b").tokenizer == O200K_HARMONY
    unknown = reg.get("some-model")
    assert unknown.context_window is None and unknown.max_output_tokens is None and unknown.tokenizer == O200K_BASE


def test_overrides_win_field_by_field(tmp_path: Path) -> None:
    f = tmp_path / "limits.json"
    f.write_text(json.dumps({"gpt-oss-120b": {"context_window": 65536}, "tiny": {"context_window": 100, "max_output_tokens": 10}}))
    reg = ModelRegistry(load_overrides(str(f)))
    gpt = reg.get("gpt-oss-120b")
    assert (gpt.context_window, gpt.max_output_tokens, gpt.tokenizer) == (65536, 32_768, O200K_HARMONY)
    assert reg.get("tiny") == ModelLimits(100, 10, O200K_BASE)
    # null removes a bundled value
    assert ModelRegistry({"gpt-oss-120b": {"context_window": None}}).get("gpt-oss-120b").context_window is None


def test_wildcard_applies_to_unknown_models_only() -> None:
    reg = ModelRegistry({"*": {"context_window": 5000}})
    assert reg.get("anything").context_window == 5000
    assert reg.get("gpt-oss-120b").context_window == 131_072


def test_reported_window_between_bundled_and_overrides() -> None:
    reg = ModelRegistry({"served": {"max_output_tokens": 7}})
    assert reg.get("gpt-oss-120b", {"gpt-oss-120b": 32768}).context_window == 32768
    served = reg.get("served", {"served": 4096})
    assert (served.context_window, served.max_output_tokens) == (4096, 7)
    assert ModelRegistry({"served": {"context_window": 1000}}).get("served", {"served": 4096}).context_window == 1000


@pytest.mark.parametrize(
    "doc",
    [[], {"m": 5}, {"m": {"context_window": 0}}, {"m": {"context_window": "big"}}, {"m": {"window": 5}}, {"m": {"tokenizer": "cl100k"}}],
)
def test_bad_overrides_are_refused(doc: Any) -> None:
    with pytest.raises(ModelLimitsError):
        parse_overrides(doc)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLimitsError):
        load_overrides(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ModelLimitsError):
        load_overrides(str(tmp_path / "bad.json"))


class _Listing(ChatBackend):
    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(model="", retries=0)
        self.body = body

    async def _get_models(self) -> bytes:
        return json.dumps(self.body).encode()


def test_vllm_max_model_len_is_kept() -> None:
    backend = _Listing(
        {"data": [{"id": "served", "object": "model", "max_model_len": 2048}, {"id": "other", "object": "model"}]}
    )
    models = asyncio.run(backend.list_models())
    assert [m["id"] for m in models] == ["served", "other"]
    assert backend.context_windows == {"served": 2048}
    assert ModelRegistry().get("served", backend.context_windows).context_window == 2048
    assert ModelRegistry().get("other", backend.context_windows).context_window is None


# -- the check ---------------------------------------------------------------------------------


def plan_for(body: dict[str, Any], parent: CachedResponse | None = None, defer: bool = False) -> Plan:
    return prepare(validate(decode_body(json.dumps(body))), parent, IdGen(deterministic=True), None, defer=defer)


def finish(plan: Plan, rid: str, output: list[dict[str, Any]]) -> CachedResponse:
    response = response_object(plan.prepared, rid, 0)
    response["output"] = output
    return finished(plan, response)


BODY = {"model": "m", "instructions": "Be brief.", "input": "hello there, how are you today?"}


def test_just_under_and_just_over() -> None:
    n = plan_for(BODY).input_tokens
    assert window.fit(plan_for(BODY), ModelLimits(n), None, None) == 0
    with pytest.raises(errors.ContextLengthExceeded) as ei:
        window.fit(plan_for(BODY), ModelLimits(n - 1), None, None)
    err = ei.value
    assert (err.status, err.type, err.code, err.param) == (400, "invalid_request_error", "context_length_exceeded", "input")
    assert f"{n - 1} tokens" in err.message and f"{n} tokens" in err.message


def test_instructions_and_tools_count() -> None:
    bare = plan_for({"model": "m", "input": "hi"}).input_tokens
    tool = {"type": "function", "name": "f", "description": "word " * 50, "parameters": {"type": "object", "properties": {}}}
    full = plan_for({"model": "m", "input": "hi", "instructions": "word " * 30, "tools": [tool]}).input_tokens
    assert full > bare + 80
    with pytest.raises(errors.ContextLengthExceeded):
        window.fit(plan_for({"model": "m", "input": "hi", "instructions": "word " * 30, "tools": [tool]}), ModelLimits(full - 1), None, None)


def test_max_output_tokens_must_fit_too() -> None:
    n = plan_for(BODY).input_tokens
    assert window.fit(plan_for(BODY), ModelLimits(n + 10), 10, None) == 0
    with pytest.raises(errors.ContextLengthExceeded) as ei:
        window.fit(plan_for(BODY), ModelLimits(n + 10), 11, None)
    assert f"{n + 11} tokens" in ei.value.message
    with pytest.raises(errors.InvalidValue) as ei2:
        window.budget(ModelLimits(1000), 1000)  # no room for any input
    assert ei2.value.param == "max_output_tokens"
    with pytest.raises(errors.InvalidValue) as ei3:
        window.budget(ModelLimits(100_000, 500), 501)  # past the output limit
    assert ei3.value.param == "max_output_tokens"
    assert window.budget(ModelLimits(100_000, 500), 500) == 99_500
    assert window.budget(ModelLimits(None, 500), 100) is None


def test_no_window_no_check() -> None:
    assert window.fit(plan_for(BODY), ModelLimits(), None, None) == 0


def test_upper_bound_of_a_deferred_plan() -> None:
    text = "héllo wörld " * 2000
    plan = plan_for({"model": "m", "input": text}, defer=True)
    assert not plan.settled
    bound = window.upper_bound(plan)
    exact = plan_for({"model": "m", "input": text}).input_tokens
    assert bound >= exact


def test_upper_bound_of_many_short_items_counts_their_overhead() -> None:
    body = {"model": "m", "input": [{"role": "user", "content": "a"} for _ in range(300)]}
    plan = plan_for(body, defer=True)
    assert not plan.settled
    assert window.upper_bound(plan) >= plan_for(body).input_tokens  # 4 tokens an item, 1 byte of text


# -- truncation --------------------------------------------------------------------------------


def msg(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


def call(cid: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": cid, "name": "f", "arguments": json.dumps({"q": "x " * 40})}


def out(cid: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": cid, "output": "result " * 40}


LONG = "words " * 60


def history() -> list[dict[str, Any]]:
    return [
        msg("developer", "Always answer in English."),
        msg("user", LONG),
        call("c1"),
        out("c1"),
        msg("assistant", LONG),
        msg("user", LONG),
        call("c2"),
        out("c2"),
        msg("user", "and now?"),
    ]


def body(items: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {"model": "m", "instructions": "Be brief.", "input": items, "truncation": "auto", **kw}


def _kinds(plan: Plan) -> list[str]:
    return [
        (it.role if type(it) is Message else ("call:" + it.call_id if type(it) is FunctionCall else "out:" + it.call_id))  # type: ignore[union-attr]
        for it in plan.items
    ]


def test_truncation_drops_from_the_front_and_reports() -> None:
    full = plan_for(body(history()))
    n = full.input_tokens
    plan = plan_for(body(history()))
    dropped = window.fit(plan, ModelLimits(n - 20), None, "auto")
    assert dropped == plan.truncated == 1  # the first user message
    assert _kinds(plan) == ["developer", "call:c1", "out:c1", "assistant", "user", "call:c2", "out:c2", "user"]
    assert plan.input_tokens <= n - 20
    assert plan.context.tokens == sum(
        plan.context.chain.tokens_upto(i + 1) - plan.context.chain.tokens_upto(i) for i in range(len(plan.items))
    )


def test_calls_and_outputs_go_together() -> None:
    n = plan_for(body(history())).input_tokens
    first_user = n - plan_for(body([h for i, h in enumerate(history()) if i != 1])).input_tokens
    plan = plan_for(body(history()))
    window.fit(plan, ModelLimits(n - first_user - 5), None, "auto")  # one more token than the user message
    kinds = _kinds(plan)
    assert "call:c1" not in kinds and "out:c1" not in kinds
    assert kinds[0] == "developer" and kinds[1] == "assistant"
    for cid in ("c1", "c2"):
        assert (f"call:{cid}" in kinds) == (f"out:{cid}" in kinds)


def test_custom_tool_calls_and_outputs_go_together() -> None:
    """Calls of verbatim item types pair by ``call_id`` too: a cut never orphans an output."""
    items = [
        msg("user", LONG),
        {"type": "custom_tool_call", "call_id": "k1", "name": "apply", "input": "patch " * 40},
        {"type": "custom_tool_call_output", "call_id": "k1", "output": "applied " * 40},
        msg("user", LONG),
        {"type": "local_shell_call", "call_id": "k2", "status": "completed",
         "action": {"type": "exec", "command": ["ls"] * 30, "env": {}}},
        {"type": "local_shell_call_output", "call_id": "k2", "output": "file " * 40},
        msg("user", LONG),
        {"type": "mcp_approval_request", "id": "k3", "server_label": "gh", "name": "list", "arguments": "{} " * 40},
        {"type": "mcp_approval_response", "approval_request_id": "k3", "approve": True, "reason": "ok " * 40},
        msg("user", "and now?"),
    ]
    n = plan_for(body(items)).input_tokens
    seen = set()
    for limit in range(n - 1, n // 5, -7):  # every cut the sizes allow
        plan = plan_for(body(items))
        window.fit(plan, ModelLimits(limit), None, "auto")
        cids = [it.data.get("call_id") or it.data.get("approval_request_id") or it.data.get("id")  # type: ignore[union-attr]
                for it in plan.items if isinstance(it, OtherItem)]
        for cid in ("k1", "k2", "k3"):
            assert cids.count(cid) in (0, 2), (limit, cids)
        seen.add(len(plan.items))
    assert len(seen) >= 3  # several different cuts were made


def test_newest_item_and_instructions_kept() -> None:
    plan = plan_for(body(history()))
    newest_only = plan_for(body([history()[0], history()[-1]])).input_tokens
    assert window.fit(plan, ModelLimits(newest_only), None, "auto") == 7
    assert _kinds(plan) == ["developer", "user"]
    assert plan.prepared.req.instructions == "Be brief."
    # nothing droppable is left: the same 400 as without truncation
    plan = plan_for(body(history()))
    with pytest.raises(errors.ContextLengthExceeded):
        window.fit(plan, ModelLimits(newest_only - 1), None, "auto")


def test_disabled_is_a_400() -> None:
    n = plan_for(body(history())).input_tokens
    for mode in ("disabled", None):
        with pytest.raises(errors.ContextLengthExceeded):
            window.fit(plan_for(body(history(), truncation=mode)), ModelLimits(n - 1), None, mode)


def test_a_chain_continues_after_truncation() -> None:
    first = plan_for(body(history()[:5]))
    parent = finish(first, "resp_1", [msg("assistant", LONG)])
    n_parent = len(parent.context)
    plan = plan_for(body(history()[5:], previous_response_id="resp_1"), parent)
    full = plan.input_tokens
    assert window.fit(plan, ModelLimits(full - 10), None, "auto") == 1
    assert plan.base_kept == n_parent - 1 and plan.cached_tokens == 0
    entry = finish(plan, "resp_2", [msg("assistant", "ok")])
    assert entry.parent_id == "resp_1" and entry.base_len == n_parent - 1
    assert entry.input_len == len(plan.items) and len(entry.context) == len(plan.items) + 1
    # the continuation starts from the truncated history, O(new input) again
    nxt = plan_for({"model": "m", "instructions": "Be brief.", "input": "more", "previous_response_id": "resp_2"}, entry)
    assert len(nxt.items) == len(entry.context) + 1
    assert nxt.input_tokens < full
    assert window.fit(nxt, ModelLimits(full - 10), None, None) == 0
    # persisted (its own history, since it no longer extends its parent's) and reloaded alike
    again = from_record(to_record(entry))
    assert [type(i) for i in again.context.items] == [type(i) for i in entry.context.items]
    assert again.context.tokens == entry.context.tokens
    # the parent's own items are untouched
    assert len(parent.context) == n_parent


def test_truncation_within_new_items_only() -> None:
    # no parent: every item is new; the dropped ones are simply not sent
    items = [msg("user", LONG), msg("user", LONG), msg("user", "last")]
    plan = plan_for(body(items))
    n = plan.input_tokens
    assert window.fit(plan, ModelLimits(n - 5), None, "auto") == 1
    assert plan.base_kept == 0 and len(plan.items) == 2
    entry = finish(plan, "resp_x", [])
    assert entry.parent_id is None and entry.input_len == 2


def test_bundled_values_are_positive() -> None:
    for name, lim in BUNDLED.items():
        assert lim.context_window is None or lim.context_window > 1000, name
        assert lim.tokenizer in (O200K_BASE, O200K_HARMONY)
