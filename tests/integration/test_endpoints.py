"""Stored responses, chaining over HTTP, tool round trips and the auxiliary endpoints."""

from __future__ import annotations

import json
from typing import Any
import time

import httpx
import openai
import pytest
from openai import OpenAI

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture()
def client(server) -> OpenAI:
    return OpenAI(api_key="sk-test", base_url=server.v1, max_retries=0, timeout=30)


def test_function_tool_round_trip_over_http(client: OpenAI) -> None:
    r1 = client.responses.create(model="hotloop-sim", input="What's the weather in Paris?", tools=[WEATHER_TOOL])
    calls = [o for o in r1.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    r2 = client.responses.create(
        model="hotloop-sim",
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C and sunny"}],
        tools=[WEATHER_TOOL],
    )
    assert r2.status == "completed" and r2.output_text
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    # an output for a call that never happened is rejected
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(
            model="hotloop-sim",
            previous_response_id=r1.id,
            input=[{"type": "function_call_output", "call_id": "call_unknown", "output": "x"}],
        )
    assert "No tool call found for function call output with call_id call_unknown" in ei.value.message


def test_parallel_calls_and_reasoning_stream(client: OpenAI) -> None:
    tools = [WEATHER_TOOL, {**WEATHER_TOOL, "name": "get_time", "description": "time"}]
    events = list(
        client.responses.create(
            model="hotloop-sim",
            input="weather and time please",
            tools=tools,
            metadata={"sim": "reasoning,tools:2"},
            stream=True,
        )
    )
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "function_call", "function_call"]
    assert {o.name for o in final.output[1:]} == {"get_weather", "get_time"}
    assert any(e.type == "response.reasoning_text.delta" for e in events)
    assert final.usage.output_tokens_details.reasoning_tokens > 0


def test_forced_tool_choice_must_name_a_tool(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(
            model="hotloop-sim", input="x", tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "nope"}
        )
    assert ei.value.param == "tool_choice"
    r = client.responses.create(
        model="hotloop-sim", input="x", tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"}
    )
    assert r.output[0].type == "function_call"


def test_max_output_tokens_gives_incomplete(client: OpenAI) -> None:
    events = list(client.responses.create(model="hotloop-sim", input="long please", max_output_tokens=16, stream=True))
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 16


def test_model_failure_stream(client: OpenAI) -> None:
    events = list(client.responses.create(model="hotloop-sim", input="x", metadata={"sim": "fail:server_error"}, stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "server_error"


@pytest.mark.parametrize("sim", ["fail:server_error", "text,error:server_error"])
def test_a_failed_stored_response_is_read_not_continued(server, client: OpenAI, sim: str) -> None:
    """A failed response with ``store`` is retrievable (status, error, its input), as OpenAI's
    are; continuing it is refused; the usage ledger charges it; ``store: false`` keeps nothing."""
    before = httpx.get(f"{server.base}/hotloop/usage", timeout=10).json()
    body = {"model": "hotloop-sim", "input": [{"role": "user", "content": "x"}], "metadata": {"sim": sim}, "stream": True}
    with httpx.stream("POST", server.v1 + "/responses", json=body, timeout=30) as r:
        last = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")][-1]
    failed = last["response"]
    assert last["type"] == "response.failed" and failed["status"] == "failed"
    got = client.responses.retrieve(failed["id"])
    assert got.status == "failed" and got.error is not None and got.error.code == failed["error"]["code"]
    assert httpx.get(f"{server.v1}/responses/{failed['id']}", timeout=10).json() == failed
    [item] = client.responses.input_items.list(failed["id"]).data
    assert item.type == "message" and item.content[0].text == "x"  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="hotloop-sim", input="y", previous_response_id=failed["id"])
    assert ei.value.code == "previous_response_not_found" and ei.value.param == "previous_response_id"
    assert "failed and cannot be continued" in ei.value.body["message"]  # type: ignore[index]
    # the ledger charges what it used (its input, and its output if any), as one response
    after = httpx.get(f"{server.base}/hotloop/usage", timeout=10).json()
    grew = {k: sum(r[k] for r in after["data"]) - sum(r[k] for r in before["data"]) for k in ("responses", "input_tokens")}
    assert grew["responses"] == 1 and grew["input_tokens"] > 0
    with httpx.stream("POST", server.v1 + "/responses", json={**body, "store": False}, timeout=30) as r:
        last = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")][-1]
    assert last["type"] == "response.failed"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(last["response"]["id"])


def test_backend_error_mid_stream_sends_error_event_then_failed(server) -> None:
    body = {"model": "hotloop-sim", "input": "x", "stream": True, "metadata": {"sim": "error"}}
    with httpx.stream("POST", server.v1 + "/responses", json=body, timeout=30) as r:
        raw = r.read().decode()
    payloads = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    assert [p["type"] for p in payloads[-2:]] == ["error", "response.failed"]
    assert payloads[-2]["error"]["type"] == "server_error"
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))


def test_rate_limit_before_first_token_is_http_429(client: OpenAI) -> None:
    with pytest.raises(openai.RateLimitError) as ei:
        client.responses.create(model="hotloop-sim", input="x", metadata={"sim": "rate_limit"}, stream=True)
    assert ei.value.code == "rate_limit_exceeded"
    assert ei.value.response.headers["retry-after"] == "1"


def test_retrieve_delete_input_items(client: OpenAI) -> None:
    r1 = client.responses.create(model="hotloop-sim", input="first")
    r2 = client.responses.create(
        model="hotloop-sim",
        previous_response_id=r1.id,
        input=[{"role": "user", "content": "second"}],
        instructions="Be brief.",
    )
    got = client.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == r2.output_text and got.instructions == "Be brief."
    items = client.responses.input_items.list(r2.id, order="asc")
    kinds = [(i.type, getattr(i, "role", None)) for i in items.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert all(i.id for i in items.data)
    desc = client.responses.input_items.list(r2.id, limit=1)
    assert desc.data[0].id == items.data[-1].id and desc.has_more
    page2 = client.responses.input_items.list(r2.id, limit=5, after=desc.data[0].id)
    assert [i.id for i in page2.data] == [i.id for i in reversed(items.data[:-1])]
    client.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r2.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r2.id)
    # the parent is untouched
    assert client.responses.retrieve(r1.id).id == r1.id


def test_input_items_list_messages_in_their_item_form(tmp_path) -> None:
    """Messages sent in the short form are listed as OpenAI lists them (content parts and a
    status), whatever spelling the client used: from the process's cache, and from the store
    by another process."""
    from tests.conftest import run_server

    short = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "plain text"},
        {"role": "assistant", "content": "an earlier answer"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "as parts"}]},
    ]
    want = [
        ("system", "completed", [("input_text", "Be brief.")]),
        ("user", "completed", [("input_text", "plain text")]),
        ("assistant", "completed", [("output_text", "an earlier answer")]),
        ("user", "completed", [("input_text", "as parts")]),
    ]
    env = {"HOTLOOP_DATA_DIR": str(tmp_path / "data")}
    rid = None
    for _ in range(2):  # the second server has only the store
        with run_server(tmp_path, "--sim-rate", "0", env=env) as s:
            client = OpenAI(api_key="sk-test", base_url=s.v1, max_retries=0, timeout=30)
            if rid is None:
                rid = client.responses.create(model="hotloop-sim", input=short).id  # type: ignore[arg-type]
            items = client.responses.input_items.list(rid, order="asc").data
            assert [(i.role, i.status, [(c.type, c.text) for c in i.content]) for i in items] == want  # type: ignore[union-attr]
            raw = httpx.get(f"{s.v1}/responses/{rid}/input_items", params={"order": "asc"}, timeout=10).json()["data"]
            assert raw[2]["content"] == [{"type": "output_text", "text": "an earlier answer", "annotations": [], "logprobs": []}]
            assert all(i["id"].startswith("msg_") for i in raw)


def test_input_items_list_fields_stored_without_their_defaults(client: OpenAI) -> None:
    """Items are stored without fields that hold their default; listed, they have them, as
    OpenAI lists them and the SDKs' types need them: openai-python typed a user message whose
    image had no ``detail`` as an assistant's output message, and gave ``None`` for a reasoning
    item's ``summary`` and an ``output_text``'s ``annotations``."""
    sent = [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "what is this"}, {"type": "input_image", "image_url": "https://example.com/a.png"}]},
        {"type": "reasoning", "id": "rs_listed1", "content": [{"type": "reasoning_text", "text": "I think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello there"}]},
        {"type": "message", "role": "user", "content": "and now?"},
        {"type": "function_call", "call_id": "c_img", "name": "look", "arguments": "{}"},
        # openai-python types this image's detail Optional (ResponseInputImageContentParam)
        {"type": "function_call_output", "call_id": "c_img", "output": [
            {"type": "input_text", "text": "seen"},
            {"type": "input_image", "image_url": "https://example.com/b.png", "detail": None}]},
    ]
    rid = client.responses.create(model="hotloop-sim", input=sent).id  # type: ignore[arg-type]
    items = client.responses.input_items.list(rid, order="asc").data
    assert [type(i).__name__ for i in items] == [
        "ResponseInputMessageItem", "ResponseReasoningItem", "ResponseOutputMessage", "ResponseInputMessageItem",
        "ResponseFunctionToolCallItem", "ResponseFunctionToolCallOutputItem"]
    image = items[0].content[1]  # type: ignore[union-attr]
    assert image.type == "input_image" and image.detail == "auto"
    assert items[1].summary == []  # type: ignore[union-attr]
    text = items[2].content[0]  # type: ignore[union-attr]
    assert text.annotations == [] and text.logprobs == []  # type: ignore[union-attr]
    out_image = items[5].output[1]  # type: ignore[union-attr,index]
    assert type(out_image).__name__ == "ResponseInputImage" and out_image.detail == "auto"  # typed, not a dict
    assert out_image.image_url == "https://example.com/b.png"
    assert items[4].status == items[5].status == "completed"  # type: ignore[union-attr]  # required by the SDKs' types
    custom = [
        {"type": "custom_tool_call", "call_id": "c_custom", "name": "grep", "input": "x"},
        {"type": "custom_tool_call_output", "call_id": "c_custom", "output": "found"},
    ]
    rid = client.responses.create(model="hotloop-sim", input=custom).id  # type: ignore[arg-type]
    listed = client.responses.input_items.list(rid, order="asc").data
    assert [(i.type, i.status) for i in listed] == [  # type: ignore[union-attr]
        ("custom_tool_call", "completed"), ("custom_tool_call_output", "completed")]


def test_duplicate_item_ids_are_refused_and_change_nothing(client: OpenAI) -> None:
    """An id sent twice (also as two references to one item), or an item of the previous
    response sent again with its id, is OpenAI's 400 "Duplicate item found": input_items pages
    by id (a duplicate made its pager loop forever)."""
    dup = {"type": "message", "id": "msg_dup1", "role": "user", "content": "a"}
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="hotloop-sim", input=[dup, {**dup, "content": "b"}])  # type: ignore[list-item]
    assert ei.value.param == "input" and ei.value.code is None
    assert ei.value.body["message"].startswith("Duplicate item found with id msg_dup1.")  # type: ignore[index]
    r1 = client.responses.create(model="hotloop-sim", input=[dup])  # type: ignore[list-item]
    out = r1.output[0]
    again = {"type": "message", "id": out.id, "role": "assistant", "content": r1.output_text}
    ref = {"type": "item_reference", "id": out.id}
    for resent in ([again, {"role": "user", "content": "next"}], [{"role": "user", "content": "next"}, dup]):
        with pytest.raises(openai.BadRequestError) as ei:
            client.responses.create(model="hotloop-sim", previous_response_id=r1.id, input=resent)  # type: ignore[arg-type]
        assert ei.value.param == "input" and "Duplicate item found" in ei.value.message
    with pytest.raises(openai.BadRequestError) as ei:  # the same item referenced twice
        client.responses.create(model="hotloop-sim", input=[ref, ref, {"role": "user", "content": "next"}])  # type: ignore[list-item]
    assert "Duplicate item found" in ei.value.message
    for twice in ([ref, again], [again, ref]):  # a stored item referenced and sent itself, in either order
        with pytest.raises(openai.BadRequestError) as ei:
            client.responses.create(model="hotloop-sim", input=[*twice, {"role": "user", "content": "next"}])  # type: ignore[list-item]
        assert ei.value.param == "input" and "Duplicate item found" in ei.value.message, ei.value.message
    # nothing changed: the chain continues, and its items are listed once each, to the pager's end
    r2 = client.responses.create(model="hotloop-sim", previous_response_id=r1.id, input=[{"role": "user", "content": "next"}])
    ids = [i.id for i in client.responses.input_items.list(r2.id, order="asc", limit=1)]
    assert ids[:2] == ["msg_dup1", out.id] and len(ids) == 3 == len(set(ids))
    r3 = client.responses.create(model="hotloop-sim", input=[ref, {"role": "user", "content": "again"}])  # type: ignore[list-item]
    assert [i.id for i in client.responses.input_items.list(r3.id, order="asc").data][0] == out.id


def test_an_empty_item_id_is_refused_and_blank_parameters_are_none(server, client: OpenAI) -> None:
    """An item id of "" is OpenAI's 400 ``empty_string`` (a page ending on it sent the SDK's
    auto-pager back to the first page for ever: a blank ``after=`` is no cursor), whatever the
    item's type; blank query parameters are no parameters."""
    items: list[dict[str, Any]] = [
        {"type": "message", "id": "", "role": "user", "content": "a"},
        {"type": "function_call", "id": "", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "custom_tool_call", "id": "", "call_id": "c2", "name": "g", "input": "x"},
        {"type": "item_reference", "id": ""},
    ]
    for item in items:
        with pytest.raises(openai.BadRequestError) as ei:
            client.responses.create(model="hotloop-sim", input=[{"role": "user", "content": "first"}, item])  # type: ignore[list-item]
        assert (ei.value.code, ei.value.param) == ("empty_string", "input[1].id"), item
        assert "empty string" in ei.value.message
    r = client.responses.create(model="hotloop-sim", input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    url = f"{server.v1}/responses/{r.id}/input_items"
    blank = httpx.get(url, params={"after": "", "before": "", "order": "", "limit": ""}, headers={"Authorization": "Bearer sk-test"}, timeout=10)
    assert blank.status_code == 200 and len(blank.json()["data"]) == 2, blank.text  # the defaults


def test_items_of_every_type_get_ids_and_page(client: OpenAI) -> None:
    """Items kept verbatim (custom tool calls and outputs) get ids too, so input_items pages
    through all of them; a minted id is not what the model reads (same input token count)."""
    call = {"type": "custom_tool_call", "call_id": "ct9", "name": "apply_patch", "input": "*** Begin Patch"}
    out = {"type": "custom_tool_call_output", "call_id": "ct9", "output": "Done."}
    user = {"role": "user", "content": "next"}
    r = client.responses.create(model="hotloop-sim", input=[call, out, user])  # type: ignore[list-item]
    for order in ("asc", "desc"):
        paged = list(client.responses.input_items.list(r.id, order=order, limit=1))  # the SDK's auto-pager
        types = [i.type for i in paged]
        assert types == (["custom_tool_call", "custom_tool_call_output", "message"])[:: 1 if order == "asc" else -1]
    ids = [i.id for i in client.responses.input_items.list(r.id, order="asc").data]
    assert ids[0].startswith("ctc_") and ids[1].startswith("ctco_") and ids[2].startswith("msg_")
    with_ids = client.responses.create(
        model="hotloop-sim", input=[{**call, "id": "ctc_given"}, {**out, "id": "ctco_given"}, user]  # type: ignore[list-item]
    )
    assert with_ids.usage.input_tokens == r.usage.input_tokens  # type: ignore[union-attr]
    listed = client.responses.input_items.list(with_ids.id, order="asc").data
    assert [i.id for i in listed][:2] == ["ctc_given", "ctco_given"]


def test_a_resent_history_with_ids_of_its_own_is_not_served_from_another_input(client: OpenAI) -> None:
    """Prefix reuse matches items by content, ids aside (a client may resend them without), but
    an item sent with another id than the cached one is another item: listed, and resolved by
    item_reference, under the id the client gave it."""
    text = "a long enough first message " * 20
    first = [{"type": "message", "id": "msg_first_a", "role": "user", "content": text}, {"role": "user", "content": "b"}]
    r1 = client.responses.create(model="hotloop-sim", input=first)  # type: ignore[arg-type]
    bare = [{"role": "user", "content": text}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}]
    hit = client.responses.create(model="hotloop-sim", input=bare)  # type: ignore[arg-type]
    assert hit.usage.input_tokens_details.cached_tokens > 0  # type: ignore[union-attr]  # no ids: r1's items
    assert client.responses.input_items.list(hit.id, order="asc").data[0].id == "msg_first_a"
    own = [{**bare[0], "type": "message", "id": "msg_first_b"}, *bare[1:]]
    r2 = client.responses.create(model="hotloop-sim", input=own)  # type: ignore[arg-type]
    assert r2.usage.input_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert r2.usage.input_tokens == hit.usage.input_tokens  # type: ignore[union-attr]
    assert [i.id for i in client.responses.input_items.list(r2.id, order="asc").data][0] == "msg_first_b"
    r3 = client.responses.create(
        model="hotloop-sim", previous_response_id=r2.id, input=[{"type": "item_reference", "id": "msg_first_b"}]
    )
    assert r3.status == "completed" and r1.status == "completed"


def test_store_false_is_not_retrievable(client: OpenAI) -> None:
    r = client.responses.create(model="hotloop-sim", input="secret", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="hotloop-sim", input="x", previous_response_id=r.id)
    assert ei.value.code == "previous_response_not_found"


def test_cancel_non_background_is_400(client: OpenAI) -> None:
    r = client.responses.create(model="hotloop-sim", input="x")
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="hotloop-sim", input="x", background=True)
    assert ei.value.param == "background"


def test_input_tokens_counts_with_tokenizer(client: OpenAI) -> None:
    short = client.responses.input_tokens.count(model="hotloop-sim", input="hello")
    long = client.responses.input_tokens.count(model="hotloop-sim", input="hello " * 200)
    assert short.object == "response.input_tokens"
    assert long.input_tokens - short.input_tokens == 200  # " hello" is one o200k token
    with_tools = client.responses.input_tokens.count(model="hotloop-sim", input="hello", tools=[WEATHER_TOOL])
    assert with_tools.input_tokens > short.input_tokens
    # ``input`` is optional here (openai-python's InputTokenCountParams): the fixed cost of
    # instructions and tools, counted alone
    tools_only = client.responses.input_tokens.count(model="hotloop-sim", tools=[WEATHER_TOOL])
    assert 0 < tools_only.input_tokens < with_tools.input_tokens
    told = client.responses.input_tokens.count(model="hotloop-sim", instructions="Answer in French. " * 10)
    assert told.input_tokens >= 40


def test_unknown_fields_are_ignored(server) -> None:
    body = {"model": "hotloop-sim", "input": "x", "some_future_field": {"a": 1}, "client_metadata": {"k": "v"}}
    r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "completed"


def test_item_reference_resolves_or_400(client: OpenAI) -> None:
    r1 = client.responses.create(model="hotloop-sim", input="first")
    msg_id = r1.output[0].id
    r2 = client.responses.create(
        model="hotloop-sim",
        previous_response_id=r1.id,
        input=[{"type": "item_reference", "id": msg_id}, {"role": "user", "content": "more"}],
    )
    assert r2.status == "completed"
    # the reference names an item r2's chain already holds: the model reads it again, as a copy
    # with an id of its own, so input_items lists every id once and pages to its end
    listed = client.responses.input_items.list(r2.id, order="asc").data
    ids = [i.id for i in listed]
    assert len(ids) == len(set(ids)) == 4  # "first", r1's answer, its copy, "more"
    assert ids[1] == msg_id and ids[2] != msg_id
    assert listed[2].content[0].text == listed[1].content[0].text == r1.output_text  # type: ignore[union-attr]
    pages, after = [], None
    while True:  # one item per page: each page starts after the last one's id
        page = client.responses.input_items.list(r2.id, order="asc", limit=1, **({"after": after} if after else {}))
        pages += [i.id for i in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
        assert len(pages) <= len(ids)
    assert pages == ids
    # the copy's id was minted here: a later request can name it as any other output's
    r3 = client.responses.create(model="hotloop-sim", input=[{"type": "item_reference", "id": ids[2]}])
    assert client.responses.input_items.list(r3.id).data[0].id == ids[2]
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="hotloop-sim", input=[{"type": "item_reference", "id": "msg_nope"}])
    assert ei.value.code == "item_not_found"


def test_usage_ledger_counts_every_response(server) -> None:
    before = {r["model"]: r for r in httpx.get(server.base + "/hotloop/usage", timeout=10).json()["data"]}
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=0)
    made = [client.responses.create(model="ledger-model", input="x", store=False) for _ in range(3)]
    rows = {r["model"]: r for r in httpx.get(server.base + "/hotloop/usage", timeout=10).json()["data"]}
    row = rows["ledger-model"]
    prev = before.get("ledger-model", {"responses": 0, "output_tokens": 0})
    assert row["responses"] - prev["responses"] == 3
    assert row["output_tokens"] - prev["output_tokens"] == sum(r.usage.output_tokens for r in made)


def test_usage_ledger_from_a_day_on(server) -> None:
    """``?since=YYYY-MM-DD`` lists the rows of that UTC day and later; anything else is a 400."""
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=0)
    client.responses.create(model="since-model", input="x", store=False)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    url = server.base + "/hotloop/usage"
    every = httpx.get(url, timeout=10).json()["data"]
    assert any(r["model"] == "since-model" and r["day"] == today for r in every)
    assert httpx.get(url, params={"since": today}, timeout=10).json()["data"] == [r for r in every if r["day"] >= today]
    assert httpx.get(url, params={"since": "2999-01-01"}, timeout=10).json() == {"object": "list", "data": [], "has_more": False, "next_after": None}
    for bad in ("2026-13-01", "yesterday", "2026-1-1", "", "2026-01-01T00:00"):
        r = httpx.get(url, params={"since": bad}, timeout=10)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "since" and err["type"] == "invalid_request_error", bad


def test_usage_ledger_in_pages(server) -> None:
    """``?limit=N`` lists N rows and ``has_more``; ``?after=`` the ``next_after`` of a page
    continues it. A bad limit or cursor is a 400 naming it."""
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=0)
    for i in range(3):
        client.responses.create(model=f"page-model-{i}", input="x", store=False)
    url = server.base + "/hotloop/usage"
    whole = httpx.get(url, timeout=10).json()
    assert whole["has_more"] is False and whole["next_after"] is None and len(whole["data"]) >= 3
    rows, after = [], None
    while True:
        page = httpx.get(url, params={"limit": 2, **({"after": after} if after else {})}, timeout=10).json()
        assert len(page["data"]) <= 2
        rows += page["data"]
        if not page["has_more"]:
            assert page["next_after"] is None
            break
        after = page["next_after"]
    assert rows == whole["data"]
    for params, param in (({"limit": 0}, "limit"), ({"limit": 10_001}, "limit"), ({"limit": "x"}, "limit"),
                          ({"after": "not a cursor"}, "after"), ({"after": "WzEsMiwzXQ"}, "after"), ({"after": "é"}, "after")):
        r = httpx.get(url, params=params, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, params


def test_item_reference_without_previous_response_id(client: OpenAI) -> None:
    """The Vercel AI SDK's second turn: earlier output as item_reference, no previous_response_id."""
    stored = client.responses.create(model="hotloop-sim", input="first")
    unstored = client.responses.create(model="hotloop-sim", input="first", store=False)
    r = client.responses.create(
        model="hotloop-sim",
        input=[{"role": "user", "content": "first"}, {"type": "item_reference", "id": stored.output[0].id}, {"role": "user", "content": "next"}],
    )
    assert r.status == "completed"
    items = client.responses.input_items.list(r.id, order="asc").data
    assert items[1].id == stored.output[0].id and items[1].content[0].text == stored.output_text
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="hotloop-sim", input=[{"type": "item_reference", "id": unstored.output[0].id}])
    assert ei.value.code == "item_not_found"


def test_a_response_past_the_store_ttl_is_gone_from_the_process_too(tmp_path) -> None:
    """Past HOTLOOP_STORE_TTL_SECONDS a stored response is gone everywhere: the process's cache
    does not serve it (GET, previous_response_id, item_reference) after the store forgot it."""
    import time

    from tests.conftest import run_server

    with run_server(tmp_path, "--sim-rate", "0", env={"HOTLOOP_STORE_TTL_SECONDS": "2"}) as s:
        client = OpenAI(api_key="sk-test", base_url=s.v1, max_retries=0, timeout=30)
        r = client.responses.create(model="hotloop-sim", input=[{"type": "message", "id": "msg_ttl_1", "role": "user", "content": "x"}])
        assert client.responses.retrieve(r.id).id == r.id
        time.sleep(3.1)  # created_at is in whole seconds
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as ei:
            client.responses.create(model="hotloop-sim", input="y", previous_response_id=r.id)
        assert ei.value.code == "previous_response_not_found"
        with pytest.raises(openai.BadRequestError) as ei:
            client.responses.create(model="hotloop-sim", input=[{"type": "item_reference", "id": "msg_ttl_1"}])
        assert ei.value.code == "item_not_found"


def test_compaction_is_refused_plainly(client: OpenAI, server) -> None:
    r = httpx.post(f"{server.v1}/responses/compact", json={"model": "hotloop-sim", "input": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert "Compaction" in r.json()["error"]["message"] and "not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_a_response_the_store_pruned_is_gone_from_the_process_too(tmp_path, store) -> None:
    """Past the store's count bound the oldest responses are pruned; the process's cache drops
    them too, so GET, DELETE, previous_response_id and item_reference agree they are gone (the
    SQLite store prunes every PRUNE_EVERY writes)."""
    import time

    from hotloop.state.store import SQLiteStore
    from tests.conftest import run_server

    n = 6 if store == "memory" else SQLiteStore.PRUNE_EVERY + 1
    with run_server(tmp_path, "--store", store, "--sim-rate", "0", env={"HOTLOOP_STORE_MAX_RESPONSES": "3"}) as s:
        client = OpenAI(api_key="sk-test", base_url=s.v1, max_retries=0, timeout=30)
        made = [client.responses.create(model="hotloop-sim", input=f"n{i}") for i in range(n)]
        first = made[0]
        deadline = time.monotonic() + 10
        while httpx.get(f"{s.v1}/responses/{first.id}", timeout=10).status_code != 404:  # the writer's turn
            assert time.monotonic() < deadline, "a pruned response is still served"
            time.sleep(0.05)
        assert httpx.delete(f"{s.v1}/responses/{first.id}", timeout=10).status_code == 404
        with pytest.raises(openai.BadRequestError) as ei:
            client.responses.create(model="hotloop-sim", input="y", previous_response_id=first.id)
        assert ei.value.code == "previous_response_not_found"
        with pytest.raises(openai.BadRequestError) as ei:
            client.responses.create(model="hotloop-sim", input=[{"type": "item_reference", "id": first.output[0].id}])
        assert ei.value.code == "item_not_found"
        last = made[-1]  # within the bound: kept everywhere
        assert client.responses.retrieve(last.id).id == last.id


@pytest.mark.parametrize(
    "method,path,allow",
    [
        ("PUT", "/v1/responses", "GET, POST"),
        ("PATCH", "/v1/responses/resp_x", "GET, HEAD, DELETE"),
        ("POST", "/v1/models", "GET, HEAD"),
        ("GET", "/v1/responses/input_tokens", "POST"),
    ],
)
def test_a_method_not_allowed_says_which_are(server, method: str, path: str, allow: str) -> None:
    """RFC 9110 (15.5.6): a 405 carries the methods the resource takes in ``Allow``."""
    r = httpx.request(method, server.base + path, headers={"Authorization": "Bearer sk-test"}, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == allow
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_changed_instructions_or_tools_leave_nothing_cached(client: OpenAI) -> None:
    """A prompt is cached by its prefix, and instructions and tools come before the conversation:
    a turn that changes them reports no cached tokens, whichever way the history is sent."""
    text = "a long enough first message for the cache " * 20
    first: list[Any] = [{"role": "user", "content": text}]
    r1 = client.responses.create(model="hotloop-sim", input=first, instructions="Be brief.", tools=[WEATHER_TOOL])
    same = client.responses.create(
        model="hotloop-sim", previous_response_id=r1.id, input="and then?", instructions="Be brief.", tools=[WEATHER_TOOL]
    )
    assert same.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens  # type: ignore[union-attr]
    for changed in ({"instructions": "Be verbose."}, {"instructions": None}, {"tools": []}):
        settings: dict[str, Any] = {"instructions": "Be brief.", "tools": [WEATHER_TOOL], **changed}
        if not settings["tools"]:
            del settings["tools"]
        chained = client.responses.create(model="hotloop-sim", previous_response_id=r1.id, input="and then?", **settings)
        assert chained.usage.input_tokens_details.cached_tokens == 0, changed  # type: ignore[union-attr]
        assert chained.usage.input_tokens > 0  # type: ignore[union-attr]
    # the whole history sent again (its last item new: not one of the chained turns' inputs),
    # matched by prefix
    history: list[Any] = [*first, *[o.model_dump(exclude_none=True) for o in r1.output]]
    history.append({"role": "user", "content": "what next?"})
    hit = client.responses.create(model="hotloop-sim", input=history, instructions="Be brief.", tools=[WEATHER_TOOL])
    assert hit.usage.input_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    miss = client.responses.create(model="hotloop-sim", input=history, instructions="Be verbose.", tools=[WEATHER_TOOL])
    assert miss.usage.input_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
