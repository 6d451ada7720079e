"""The size guard end to end (``--max-turn-input-items``, ``--max-turn-input-bytes``): what one
turn adds is bounded (after ``previous_response_id``, after a cached prefix), over HTTP with the
openai SDK and over WebSocket, with a 400 ``input_too_large`` that leaves the chain as it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from websockets.sync.client import connect as ws_connect

from hotloop.config import Config
from hotloop.server.runner import make_app
from tests.conftest import Server, run_server
from tests.integration.test_websocket import raw_until_terminal

MAX_ITEMS = 3
MAX_BYTES = 4000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("guard")
    args = ("--sim-rate", "0", "--max-turn-input-items", str(MAX_ITEMS), "--max-turn-input-bytes", str(MAX_BYTES))
    with run_server(tmp, *args) as s:
        yield s


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def create(s: Server, **body: Any) -> httpx.Response:
    body.setdefault("model", "hotloop-sim")
    body.setdefault("metadata", {"sim": "tokens:3"})
    return httpx.post(s.v1 + "/responses", json=body, timeout=30)


def assert_too_large(r: httpx.Response, says: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "input_too_large", "input")
    assert says in err["message"]


def responses_recorded(s: Server) -> int:
    rows = httpx.get(s.base + "/hotloop/usage", timeout=10).json()["data"]
    return sum(r["responses"] for r in rows)


def test_the_limits_bound_a_whole_input_when_nothing_is_reused(server: Server) -> None:
    before = responses_recorded(server)
    assert_too_large(create(server, input=[user(f"u{i}") for i in range(MAX_ITEMS + 1)]), f"at most {MAX_ITEMS} new items")
    assert_too_large(create(server, input=[user("x" * MAX_BYTES)]), f"the {MAX_BYTES} bytes")
    assert_too_large(create(server, input="x" * MAX_BYTES), f"the {MAX_BYTES} bytes")  # a string input is one item
    # at the limits: accepted (an item's bytes are its compact JSON: the empty message's and its text)
    assert create(server, input=[user(f"u{i}") for i in range(MAX_ITEMS)]).status_code == 200
    empty = len(json.dumps(user(""), separators=(",", ":")))
    assert create(server, input=[user("y" * (MAX_BYTES - empty))]).status_code == 200
    assert_too_large(create(server, input=[user("y" * (MAX_BYTES - empty + 1))]), "bytes")
    assert responses_recorded(server) - before == 2  # refused requests are no responses


def test_the_count_endpoint_refuses_what_a_turn_may_not_add(server: Server) -> None:
    """``POST /v1/responses/input_tokens`` counts no input that ``POST /v1/responses`` refuses."""

    def count(**body: Any) -> httpx.Response:
        return httpx.post(server.v1 + "/responses/input_tokens", json={"model": "hotloop-sim", **body}, timeout=30)

    assert_too_large(count(input="x" * MAX_BYTES), f"the {MAX_BYTES} bytes")
    assert_too_large(count(input=[user(f"u{i}") for i in range(MAX_ITEMS + 1)]), f"at most {MAX_ITEMS} new items")
    ok = count(input=[user(f"u{i}") for i in range(MAX_ITEMS)])
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0, ok.text
    # a whole history: only what follows the model's last output is this turn's
    history = [user("a" * (MAX_BYTES // 2)), {"type": "message", "role": "assistant", "content": "b" * (MAX_BYTES // 2)}]
    assert count(input=[*history, user("c")]).status_code == 200


def test_the_openai_sdk_gets_a_bad_request_error(server: Server) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="hotloop-sim", input="z" * (2 * MAX_BYTES))
    assert info.value.status_code == 400
    assert info.value.code == "input_too_large" and info.value.param == "input"


def test_a_continuation_is_bounded_by_its_own_items_only(server: Server) -> None:
    first = create(server, input=[user(f"a{i}") for i in range(MAX_ITEMS)])
    assert first.status_code == 200, first.text
    parent = first.json()["id"]
    # the chain holds 3 + 1 items; this turn adds 3 more: within the limit
    r = create(server, input=[user(f"b{i}") for i in range(MAX_ITEMS)], previous_response_id=parent)
    assert r.status_code == 200, r.text
    assert_too_large(create(server, input=[user(f"c{i}") for i in range(MAX_ITEMS + 1)], previous_response_id=parent), "new items")
    # the refusal changed nothing: the same parent continues
    r = create(server, input=[user("d")], previous_response_id=parent)
    assert r.status_code == 200 and r.json()["previous_response_id"] == parent


def test_a_full_history_client_is_bounded_by_what_follows_its_cached_prefix(server: Server) -> None:
    history = [user("start " + "h" * 1000), user("more " + "h" * 1000)]
    grown = 0
    for i in range(4):  # the history grows past both limits; each turn adds 2 items, ~1 KB
        r = create(server, input=history, store=False)
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["usage"]["input_tokens_details"]["cached_tokens"] > 0) == (i > 0)  # a prefix hit
        history += body["output"] + [user(f"turn {i} " + "t" * 900)]
        grown = len(history)
    assert grown > MAX_ITEMS and len(json.dumps(history)) > MAX_BYTES
    # after the cached prefix (and the output it produced): four new items
    four = [user(f"e{i}") for i in range(MAX_ITEMS + 1)]
    r = create(server, input=history[:-1] + four, store=False)
    assert_too_large(r, "new items")
    r = create(server, input=history[:-1] + [user("f" * MAX_BYTES)], store=False)
    assert_too_large(r, "bytes")


def test_a_turn_with_no_model_output_after_its_cached_prefix_is_measured_as_from_scratch(server: Server) -> None:
    """Two user items, then four that start with them and no model output among them: from
    scratch all four are the client's turn (none is the model's), one over the limit. A prefix
    hit counted only the two after the cached prefix and accepted it: the same body got 200 or
    400 depending on what the cache held (another worker, a restart)."""
    first = [user(f"alone {i} " + "a" * 200) for i in range(2)]
    assert create(server, input=first, store=False).status_code == 200
    grown = first + [user(f"then {i}") for i in range(2)]
    assert_too_large(create(server, input=grown, store=False), "new items")
    assert create(server, input=grown[:3], store=False).status_code == 200  # at the limit


def test_the_output_sent_back_with_a_prefix_is_not_new_input(server: Server) -> None:
    first = create(server, input=[user("q " + "p" * 500), user("r " + "p" * 500)], store=False)
    assert first.status_code == 200, first.text
    output = first.json()["output"]
    assert len(output) == 1
    history = [user("q " + "p" * 500), user("r " + "p" * 500), *output]
    # the output the response produced, sent back, plus MAX_ITEMS items of the client's own:
    # only these count (counting the output too would make them one over)
    r = create(server, input=history + [user(f"n{i}") for i in range(MAX_ITEMS)], store=False)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert_too_large(create(server, input=history + [user(f"m{i}") for i in range(MAX_ITEMS + 1)], store=False), "new items")


def test_a_history_no_cache_holds_is_bounded_after_the_model_s_last_output(server: Server) -> None:
    """A client resending a history this server has not cached (it restarted, or its prefix
    cache let the conversation go): the history before the model's last output was bounded when
    it was new. Counting all of it refused every later turn once it passed the limits, for good
    (a refused turn caches nothing)."""
    history: list[dict[str, Any]] = []
    for i in range(3):  # an earlier server's conversation: user turns, model outputs, tool calls
        history += [user(f"turn {i} " + "o" * 1500), {"type": "message", "role": "assistant", "content": f"answer {i}"}]
        history += [{"type": "function_call", "call_id": f"c{i}", "name": "run", "arguments": "{}"}]
        history += [{"type": "function_call_output", "call_id": f"c{i}", "output": "done " + "r" * 500}]
    assert len(history) > MAX_ITEMS and len(json.dumps(history)) > MAX_BYTES
    r = create(server, input=history + [user("next")], store=False)  # never seen: no prefix
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] == 0  # analysed whole, as a miss is
    # what follows the last output (here the function call) is still bounded
    assert_too_large(create(server, input=history[:-1] + [user(f"x{i}") for i in range(MAX_ITEMS + 1)], store=False), "new items")
    assert_too_large(create(server, input=history + [user("z" * MAX_BYTES)], store=False), "bytes")


def test_a_conversation_past_the_prefix_cache_s_entry_budget_is_not_locked_out(tmp_path: Path) -> None:
    """A conversation resent whole stops being registered once it is past the prefix cache's
    budget for one entry (a quarter of its bytes); its last registered prefix keeps matching, and
    counting all that follows it refused every turn once that passed a limit. What follows the
    model's last output is what the turn adds."""
    env = {"HOTLOOP_PREFIX_CACHE_BYTES": str(48 * 1024)}  # one entry: at most 12 KiB
    with run_server(tmp_path, "--sim-rate", "0", "--max-turn-input-bytes", str(MAX_BYTES), env=env) as s:
        history: list[dict[str, Any]] = []
        for i in range(20):  # about 30 KB of history in the end, each turn's own under the limit
            turn = user(f"turn {i} " + "o" * 1500)
            r = create(s, input=history + [turn], store=False)
            assert r.status_code == 200, (i, r.text)
            history += [turn] + r.json()["output"]
        assert len(json.dumps(history)) > 16 * 1024
        stats = httpx.get(s.base + "/hotloop/stats", timeout=5).json()["prefix_cache"]
        assert stats["hits"] >= 19  # a prefix matched every turn: an early one, at the end
        assert_too_large(create(s, input=history + [user("z" * MAX_BYTES)], store=False), "bytes")


def as_parts(item: dict[str, Any]) -> dict[str, Any]:
    """The same message spelled with content parts (other bytes, the same fingerprint)."""
    kind = "output_text" if item["role"] == "assistant" else "input_text"
    text = item["content"] if isinstance(item["content"], str) else item["content"][0]["text"]
    return {"type": "message", "role": item["role"], "content": [{"type": kind, "text": text}]}


def test_a_history_spelled_anew_is_matched_by_fingerprint_and_bounded_after_it(server: Server) -> None:
    base = [user("s " + "k" * 600), user("t " + "k" * 600)]
    first = create(server, input=base, store=False)
    assert first.status_code == 200, first.text
    # the same items in other bytes: no raw-bytes hit, a fingerprint match of the whole prefix
    respelled = [as_parts(it) for it in base] + [as_parts(it) for it in first.json()["output"]]
    before = httpx.get(server.base + "/hotloop/stats", timeout=5).json()["prefix_cache"]
    r = create(server, input=respelled + [user(f"v{i}") for i in range(MAX_ITEMS)], store=False)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    after = httpx.get(server.base + "/hotloop/stats", timeout=5).json()["prefix_cache"]
    assert after["hits"] - before["hits"] == 1 and after["raw_hits"] == before["raw_hits"]
    assert_too_large(create(server, input=respelled + [user(f"w{i}") for i in range(MAX_ITEMS + 1)], store=False), "new items")


def test_over_websocket_an_error_frame_and_the_chain_unchanged(server: Server) -> None:
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi", "store": False}))
        first = raw_until_terminal(ws)[-1]
        assert first["type"] == "response.completed"
        parent = first["response"]["id"]
        for big in ([user("w" * MAX_BYTES)], [user(f"w{i}") for i in range(MAX_ITEMS + 1)]):
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "store": False,
                                "previous_response_id": parent, "input": big}))
            [frame] = raw_until_terminal(ws)
            assert frame["type"] == "error" and frame["status"] == 400
            assert (frame["error"]["code"], frame["error"]["param"]) == ("input_too_large", "input")
        # the same socket continues the same (unstored, connection-cached) parent: not evicted
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "store": False,
                            "previous_response_id": parent, "input": [user("small")]}))
        done = raw_until_terminal(ws)[-1]
        assert done["type"] == "response.completed" and done["response"]["previous_response_id"] == parent


@pytest.mark.parametrize("field", ["max_turn_input_items", "max_turn_input_bytes"])
def test_a_limit_below_one_is_refused_at_start_up(tmp_path: Path, field: str) -> None:
    cfg = Config(store="memory", data_dir=str(tmp_path), **{field: 0})
    with pytest.raises(ValueError, match="--" + field.replace("_", "-") + " must be 1 or more"):
        make_app(cfg)
