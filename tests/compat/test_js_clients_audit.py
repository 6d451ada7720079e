"""Real JavaScript clients against a real server, beyond test_js_clients.py: what a production
user of openai-node or the Vercel AI SDK hits.

openai-node (``audit_openai_node.mjs``): the ``responses.stream()`` helper with reasoning and
parallel calls (its accumulated snapshots and final response against the stored one), a tool
loop over ``previous_response_id``, ``max_output_tokens`` -> ``incomplete``, errors as the SDK's
typed classes (``param``, ``code``, 404s, 429s from the backend and from a key's limits),
``retrieve``/``delete``/``inputItems.list`` pagination, ``AbortController`` mid-stream (the
server ends the response; the same client goes on), ``ResponsesWS`` closed mid-response, and
structured output (``responses.parse``).

The AI SDK (``audit_ai_sdk.mjs``): ``streamText`` tool loops over several steps with parallel
calls and reasoning (store true and false; with ``store: false`` the reasoning item goes back to
the next step with its ``encrypted_content``), ``previousResponseId``, abort, finish reasons,
errors, ``Output.object``.

Each case is one ``node`` process (bounded well under 10 s) printing one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.conftest import Server, run_server
from tests.services import require

HERE = Path(__file__).parent
NODE = require("node", "nodejs", module=True)
TIMEOUT = 9  # seconds per node process


@pytest.fixture(scope="module")
def node_modules() -> Path:
    nm = HERE / "node_modules"
    if not (nm / "openai").is_dir() or not (nm / "ai").is_dir() or not (nm / "@ai-sdk" / "openai").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=HERE, check=True, timeout=600)
    return nm


def js(script: str, server: Server, case: str, *extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [NODE, str(HERE / script), server.v1, case, *extra], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A simulator that answers the first turn of a conversation with reasoning and three
    parallel calls, and every later turn with reasoning and text."""
    tmp = tmp_path_factory.mktemp("scripted")
    script = tmp / "script.json"
    script.write_text(json.dumps({"turns": ["reasoning,tools:3,tokens:4", "reasoning,text,tokens:8"]}))
    with run_server(tmp, "--sim-rate", "0", "--sim-script", str(script)) as s:
        yield s


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """A server with one key limited to 2 requests per minute and 1 response in flight."""
    tmp = tmp_path_factory.mktemp("limited")
    env = dict(os.environ, HOTLOOP_DATA_DIR=str(tmp / "data"))
    made = subprocess.run(
        [sys.executable, "-m", "hotloop", "keys", "create", "js-limited", "--rpm", "2", "--max-concurrent", "1"],
        capture_output=True, text=True, env=env, timeout=30, check=True,
    )
    key = made.stdout.strip().splitlines()[-1]
    assert key.startswith("hl-"), made.stdout
    with run_server(tmp, "--sim-rate", "0", env={"HOTLOOP_DATA_DIR": str(tmp / "data")}) as s:
        yield s, key


def bad_request(param: str, code: str | None = None, cls: str = "BadRequestError", status: int = 400) -> dict[str, Any]:
    return {"cls": cls, "status": status, "param": param, "code": code, "type": "invalid_request_error"}


def subset(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    return {k: got.get(k) for k in want}


# -- openai-node -------------------------------------------------------------------------------


def test_node_stream_helper_parallel_calls_and_reasoning(node_modules, server) -> None:
    out = js("audit_openai_node.mjs", server, "stream_parallel")
    assert out["status"] == "completed"
    assert out["types"] == ["reasoning", "function_call", "function_call", "function_call"]
    assert (out["first"], out["last"], out["seqOk"]) == ("response.created", "response.completed", True)
    assert out["callIds"] == 3 and out["outputIdx"] == [1, 2, 3]
    # the helper's per-delta snapshots end at each call's final arguments; strict tools are parsed
    assert out["snapsMatch"] is True
    assert out["parsed"] == [{"city": "example city"}] * 3 and out["statuses"] == ["completed"] * 3
    assert out["reasoningText"]
    # the accumulated final response equals what response.completed carried and what GET returns
    assert out["sameAsCompleted"] is True and out["finalMatchesStored"] is True


def test_node_stream_helper_tool_loop(node_modules, server) -> None:
    out = js("audit_openai_node.mjs", server, "stream_loop")
    assert out == {
        "r1": ["function_call", "function_call"],
        "r2": ["message"],
        "text": True,
        "prev": True,
        "items": ["message", "function_call", "function_call", "function_call_output", "function_call_output"],
    }


def test_node_max_output_tokens_incomplete(node_modules, server) -> None:
    out = js("audit_openai_node.mjs", server, "incomplete")
    assert out["json"] == {"status": "incomplete", "reason": "max_output_tokens", "out": 16, "items": ["incomplete"]}
    assert out["stream"] == {
        "status": "incomplete", "reason": "max_output_tokens", "last": "response.incomplete",
        "items": ["incomplete"], "text": True,
    }
    # the second call was cut: incomplete, and the helper parses nothing of an incomplete response
    assert out["tools"] == {"status": "incomplete", "items": ["completed", "incomplete"], "parsed": [None, None]}


def test_node_typed_errors(node_modules, server) -> None:
    out = js("audit_openai_node.mjs", server, "errors")
    want_temp = bad_request("temperature", "invalid_value")
    assert subset(out["badParam"], want_temp) == want_temp
    assert subset(out["badParamStream"], want_temp) == want_temp  # before the stream: a plain 400
    want_prev = bad_request("previous_response_id", "previous_response_not_found")
    assert subset(out["prevMissing"], want_prev) == want_prev
    assert subset(out["prevMissingStream"], want_prev) == want_prev
    for k in ("getMissing", "deleteMissing", "itemsMissing"):
        assert (out[k]["cls"], out[k]["status"]) == ("NotFoundError", 404), k
    assert all(out[k]["requestID"] for k in ("badParam", "prevMissing", "getMissing"))
    assert subset(out["backend429"], {"cls": 0, "status": 0, "code": 0}) == {
        "cls": "RateLimitError", "status": 429, "code": "rate_limit_exceeded"
    }
    assert out["backend429"]["retryAfter"] is not None
    # a backend failure mid-stream: the nested SSE error event -> APIError with its code
    assert (out["midStream"]["cls"], out["midStream"]["code"]) == ("APIError", "server_error")
    assert out["failed"] == {"status": "failed", "code": "server_error"}


def test_node_retrieve_delete_input_items_pagination(node_modules, server) -> None:
    out = js("audit_openai_node.mjs", server, "crud")
    assert out["same"] is True and out["ids"] is True
    assert out["asc"] == ["a", "b", "c", "d", "e"]
    assert out["desc"] == ["e", "d", "c", "b", "a"]  # order defaults to desc
    assert out["pages"] == [2, 2, 1] and out["more"] == [True, True, False, False]
    assert out["del"]["deleted"] is True and out["del"]["object"] == "response"
    assert (out["afterGet"]["cls"], out["afterGet"]["status"]) == ("NotFoundError", 404)
    assert out["afterPrev"]["code"] == "previous_response_not_found"
    assert (out["noStore"]["cls"], out["noStore"]["status"]) == ("NotFoundError", 404)


def test_node_abort_mid_stream(node_modules, server) -> None:
    out = js("audit_openai_node.mjs", server, "abort")
    # aborted at the third delta, after a /healthz fetch: deltas already read meanwhile may still
    # be iterated (as in test_ai_sdk_abort), not the other ~490; the server cancels the response
    assert 3 <= out["raw"]["n"] <= 50 and out["raw"]["during"] == 1 and out["raw"]["after"] == 0, out["raw"]
    assert out["helper"] == {"err": "APIUserAbortError", "after": 0}
    assert out["json"] == {"err": "APIUserAbortError", "after": 0}
    assert out["next"] == {"status": "completed", "text": True}


def test_node_responses_ws_parallel_calls_and_close(node_modules, server) -> None:
    out = js("audit_openai_node.mjs", server, "ws")
    assert out["bad"]["status"] == 400 and out["bad"]["error"]["code"] == "previous_response_not_found"
    assert out["bad"]["error"]["param"] == "previous_response_id"
    assert out["t1"] == ["reasoning", "function_call", "function_call", "function_call"]
    assert out["t2"] == ["message"] and out["t2status"] == "completed"
    # closed at the third delta: deltas that came in the same read as it are still dispatched
    # (a loaded machine's late hold timer writes two in one frame batch), none after; not the
    # other ~490 the response would have streamed
    assert 3 <= out["closedAt"] <= 10 and out["after"] == 0 and out["again"] == "completed", out


def test_node_key_limits_rate_limit_error(node_modules, limited) -> None:
    server, key = limited
    out = js("audit_openai_node.mjs", server, "limits", key)
    assert out["first"] is True
    for k in ("concurrent", "rpm", "rpmStream"):
        got = out[k]
        assert (got["cls"], got["status"], got["code"]) == ("RateLimitError", 429, "rate_limit_exceeded"), (k, got)
        assert got["type"] == "requests" and got["retryAfter"] is not None and got["requestID"], (k, got)


def test_node_structured_output_parse(node_modules, server) -> None:
    out = js("audit_openai_node.mjs", server, "parse")
    want = {"city": "example city", "temp": 1, "tags": ["example tags"]}
    assert out["parse"] == {"parsed": want, "status": "completed"}
    assert out["stream"] == {"parsed": want, "echoed": "json_schema"}
    assert isinstance(out["jsonObject"].get("obj"), dict)


# -- Vercel AI SDK ------------------------------------------------------------------------------


def test_ai_sdk_multi_step_parallel_calls_reasoning(node_modules, scripted) -> None:
    out = js("audit_ai_sdk.mjs", scripted, "steps")
    for k in ("stored", "forced", "unstored"):
        got = out[k]
        assert got["calls"] == 3 and got["steps"] == 2, (k, got)
        assert got["finish"] == "stop" and got["text"] is True and got["errors"] == [], (k, got)
        assert got["perStep"] == ["reasoning,tool-call,tool-result", "reasoning,text"], (k, got)
        assert got["responseId"].startswith("resp_"), (k, got)
    # the next turn continues the loop's last response: its whole history is the context
    assert out["next"]["finish"] == "stop" and out["next"]["errs"] == [] and out["next"]["text"] is True
    assert out["next"]["inputTokens"] > 100


def test_ai_sdk_store_false_keeps_reasoning_between_steps(node_modules, scripted) -> None:
    """With ``store: false`` the AI SDK sends a reasoning item back only with its
    ``encrypted_content`` (it drops one without). hotloop returns it when the request asks
    (``include``, which the SDK sends only for models it knows reason: ``forceReasoning``) and
    whenever ``store`` is false (``plain``: a model name the SDK does not know, no ``include``);
    the SDK reads it from ``output_item.done`` and sends the item back on the loop's next step."""
    out = js("audit_ai_sdk.mjs", scripted, "unstored_reasoning")
    for k, include in (("plain", None), ("forced", ["reasoning.encrypted_content"])):
        got = out[k]
        assert got["requests"] == 2 and got["steps"] == 2 and got["finish"] == "stop", (k, got)
        assert got["include"] == [include, include] and got["store"] == [False, False], (k, got)
        assert got["kept"] == ["hl1."], (k, got)  # read from the item's output_item.done
        # the second step's request holds the first step's reasoning item, with its token
        assert got["second"] == [{"id": got["second"][0]["id"], "summary": 0, "sealed": "hl1."}], (k, got)
        assert got["second"][0]["id"].startswith("rs_") and got["sameToken"] is True, (k, got)
        assert got["warnings"] == [], (k, got)  # no "Skipping reasoning parts"


def test_ai_sdk_previous_response_id(node_modules, server) -> None:
    out = js("audit_ai_sdk.mjs", server, "previous")
    assert out["id"] is True
    # chained: the first turn's input and output are context (plus the new message)
    assert out["t2"] >= out["t1"] + out["t1out"] and out["lone"] < out["t1"] + out["t1out"]
    bad = out["bad"]
    assert (bad["name"], bad["status"], bad["retryable"]) == ("AI_APICallError", 400, False)
    assert bad["body"]["code"] == "previous_response_not_found" and bad["body"]["param"] == "previous_response_id"


def test_ai_sdk_abort(node_modules, server) -> None:
    out = js("audit_ai_sdk.mjs", server, "abort")
    # aborted at the third delta (after a /healthz fetch, which under load can take a few of the
    # 20 ms delta intervals): deltas that came meanwhile may still be yielded, not the other ~490
    # (ten seconds at 50 a second); the server cancels the response
    n = out.pop("n")
    assert 3 <= n <= 50, n
    assert out == {"during": 1, "after": 0, "next": "stop"}


def test_ai_sdk_finish_reasons_and_errors(node_modules, server) -> None:
    out = js("audit_ai_sdk.mjs", server, "finish")
    assert out["length"] == {"finish": "length", "raw": "max_output_tokens", "out": 16}
    assert out["failed"] == {"finish": "error", "error": True}
    assert subset(out["badParam"], {"name": 0, "status": 0, "retryable": 0, "param": 0}) == {
        "name": "AI_APICallError", "status": 400, "retryable": False, "param": "temperature"
    }
    assert (out["limited"]["status"], out["limited"]["retryable"]) == (429, True)


def test_ai_sdk_structured_output(node_modules, server) -> None:
    out = js("audit_ai_sdk.mjs", server, "structured")
    want = {"city": "example city", "temp": 1}
    assert out == {"generate": want, "stream": want}
