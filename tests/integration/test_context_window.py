"""The context window on a real server: the simulator with a tiny window from ``--model-limits``,
over HTTP (JSON and SSE) and WebSocket: the 400 before any backend call, ``truncation: "auto"``
with its header and log line, chains continued after truncation, and a bad limits file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, free_port, run_server
from tests.integration.test_websocket import raw_until_terminal
from tests.mock_chat_server import MockChatServer, Reply, text_events

ROOT = str(Path(__file__).resolve().parents[2])
WINDOW = 400
MODEL = "tiny-sim"
SIM = {"sim": "text,tokens:5"}
PARAGRAPH = "the loop keeps agents hot while each turn streams tokens " * 8  # ~80 tokens


def limits_file(tmp: Path) -> Path:
    f = tmp / "limits.json"
    f.write_text(json.dumps({MODEL: {"context_window": WINDOW, "max_output_tokens": 50}, "roomy": {"context_window": 100_000}}))
    return f


def create(server: Server, **body: Any) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("metadata", SIM)
    return httpx.post(server.v1 + "/responses", json=body, timeout=30)


def text_of(item: dict[str, Any]) -> str:
    c = item["content"]
    return c if isinstance(c, str) else str(c[0]["text"])


def msgs(n: int) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": f"{i}: {PARAGRAPH}"} for i in range(n)]


def test_http_window_check_and_truncation(tmp_path: Path) -> None:
    with run_server(tmp_path, "--sim-rate", "0", "--model-limits", str(limits_file(tmp_path))) as s:
        small = create(s, input=msgs(2))
        assert small.status_code == 200, small.text
        assert "x-hotloop-truncated-items" not in small.headers
        assert "truncated_items" not in small.json()["usage"]  # only when something was dropped
        # over the window: 400 in the OpenAI shape, nothing generated
        big = create(s, input=msgs(8))
        assert big.status_code == 400
        assert big.json()["error"]["code"] == "context_length_exceeded"
        assert big.json()["error"]["type"] == "invalid_request_error"
        assert big.json()["error"]["param"] == "input"
        assert f"maximum context length is {WINDOW} tokens" in big.json()["error"]["message"]
        assert create(s, input=msgs(8), truncation="disabled").status_code == 400
        # input + max_output_tokens must fit; max_output_tokens within the output limit
        n = small.json()["usage"]["input_tokens"]
        over = create(s, input=msgs(2), max_output_tokens=WINDOW - n + 1)
        assert over.status_code == 400 and over.json()["error"]["param"] in ("input", "max_output_tokens")
        assert create(s, input=msgs(2), max_output_tokens=51).json()["error"]["param"] == "max_output_tokens"
        assert create(s, input=msgs(2), max_output_tokens=50).status_code == 200
        # auto: the oldest items go, the response succeeds and says how many
        auto = create(s, input=msgs(8), truncation="auto")
        assert auto.status_code == 200, auto.text
        dropped = int(auto.headers["x-hotloop-truncated-items"])
        assert 1 <= dropped < 8
        body = auto.json()
        assert body["truncation"] == "auto" and body["status"] == "completed"
        assert body["usage"]["truncated_items"] == dropped  # in usage too
        assert body["usage"]["input_tokens"] <= WINDOW
        # input_tokens counts what the response is given: after truncation with "auto", the
        # whole input (over the window) with "disabled"
        counted = httpx.post(f"{s.v1}/responses/input_tokens", timeout=10, json={"model": MODEL, "input": msgs(8), "truncation": "auto"})
        assert counted.json()["input_tokens"] == body["usage"]["input_tokens"]
        whole = httpx.post(f"{s.v1}/responses/input_tokens", timeout=10, json={"model": MODEL, "input": msgs(8)})
        assert whole.status_code == 200 and whole.json()["input_tokens"] > WINDOW
        listed = httpx.get(f"{s.v1}/responses/{body['id']}/input_items", params={"order": "asc"}, timeout=10).json()
        assert len(listed["data"]) == 8 - dropped
        assert text_of(listed["data"][-1]).startswith("7: ")
        # SSE carries the header too
        with httpx.stream("POST", s.v1 + "/responses", timeout=30, json={
            "model": MODEL, "metadata": SIM, "input": msgs(8), "truncation": "auto", "stream": True,
        }) as r:
            assert r.status_code == 200
            assert r.headers["x-hotloop-truncated-items"] == str(dropped)
            text = r.read().decode()
        assert "response.completed" in text and f'"truncated_items":{dropped}' in text
        # unknown models have no window
        assert create(s, model="roomy-sim", input=msgs(8)).status_code == 200
        logs = s.logs()
    assert f"dropped {dropped} items" in logs


def test_http_chain_grows_past_the_window_with_auto(tmp_path: Path) -> None:
    with run_server(tmp_path, "--sim-rate", "0", "--model-limits", str(limits_file(tmp_path))) as s:
        prev = None
        truncated = []
        for i in range(10):
            r = create(s, input=f"turn {i}: {PARAGRAPH}", previous_response_id=prev, truncation="auto", instructions="Be brief.")
            assert r.status_code == 200, (i, r.text)
            assert r.json()["usage"]["input_tokens"] <= WINDOW
            truncated.append(int(r.headers.get("x-hotloop-truncated-items", "0")))
            prev = r.json()["id"]
        assert sum(truncated[:3]) == 0 and sum(truncated) > 0
        # the chain still continues without truncation while the new turn fits what is left
        listed = httpx.get(f"{s.v1}/responses/{prev}/input_items", params={"order": "asc"}, timeout=10).json()["data"]
        assert text_of(listed[-1]).startswith("turn 9: ")
        # disabled (the default) on an over-full continuation: 400, and the parent survives it
        bad = create(s, input=PARAGRAPH * 3, previous_response_id=prev)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded"
        assert create(s, input="short", previous_response_id=prev, truncation="auto").status_code == 200


def test_truncated_chain_survives_a_restart(tmp_path: Path) -> None:
    env = {"HOTLOOP_DATA_DIR": str(tmp_path / "data")}
    args = ("--sim-rate", "0", "--model-limits", str(limits_file(tmp_path)))
    with run_server(tmp_path, *args, env=env) as s:
        first = create(s, input=msgs(3))
        auto = create(s, input=msgs(3), previous_response_id=first.json()["id"], truncation="auto")
        assert auto.status_code == 200 and int(auto.headers["x-hotloop-truncated-items"]) >= 1
        rid = auto.json()["id"]
        before = httpx.get(f"{s.v1}/responses/{rid}/input_items", params={"order": "asc"}, timeout=10).json()["data"]
    with run_server(tmp_path, *args, env=env) as s:
        after = httpx.get(f"{s.v1}/responses/{rid}/input_items", params={"order": "asc"}, timeout=10).json()["data"]
        assert [i["id"] for i in after] == [i["id"] for i in before]
        nxt = create(s, input="short", previous_response_id=rid)  # continues what the model saw: fits
        assert nxt.status_code == 200, nxt.text
        assert nxt.json()["usage"]["input_tokens"] <= WINDOW


def test_websocket_error_then_truncated_continuation(tmp_path: Path) -> None:
    with run_server(tmp_path, "--sim-rate", "0", "--model-limits", str(limits_file(tmp_path))) as s:
        with ws_connect(s.ws + "/responses", open_timeout=10) as ws:
            ws.send(json.dumps({"type": "response.create", "model": MODEL, "metadata": SIM, "input": msgs(3), "store": False}))
            first = raw_until_terminal(ws)[-1]
            assert first["type"] == "response.completed"
            parent = first["response"]["id"]
            more = {"type": "response.create", "model": MODEL, "metadata": SIM, "store": False,
                    "previous_response_id": parent, "input": msgs(3)}
            ws.send(json.dumps(more))
            [frame] = raw_until_terminal(ws)
            assert frame["type"] == "error" and frame["status"] == 400
            assert frame["error"]["code"] == "context_length_exceeded" and frame["error"]["param"] == "input"
            # the same socket continues the same (still cached) parent with truncation
            ws.send(json.dumps({**more, "truncation": "auto"}))
            done = raw_until_terminal(ws)[-1]
            assert done["type"] == "response.completed", done
            assert done["response"]["usage"]["input_tokens"] <= WINDOW
            assert done["response"]["usage"]["truncated_items"] >= 1  # the one place a socket can see it
            # and the truncated response is itself continuable
            ws.send(json.dumps({"type": "response.create", "model": MODEL, "metadata": SIM, "store": False,
                                "previous_response_id": done["response"]["id"], "input": "ok?"}))
            assert raw_until_terminal(ws)[-1]["type"] == "response.completed"
        logs = s.logs()
    assert "truncated the input of a response" in logs


def test_large_inputs_counted_off_the_loop_are_checked(tmp_path: Path) -> None:
    big = "token " * 4000  # past the inline tokenizing threshold: counted in the tokenizer thread
    with run_server(tmp_path, "--sim-rate", "0", "--model-limits", str(limits_file(tmp_path))) as s:
        r = create(s, input=big)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        roomy = create(s, model="roomy", input=big)  # its bound fits: no waiting on the count
        assert roomy.status_code == 200 and roomy.json()["usage"]["input_tokens"] > 4000
        auto = create(s, input=[{"type": "message", "role": "user", "content": big}, {"type": "message", "role": "user", "content": "hi"}],
                      truncation="auto")
        assert auto.status_code == 200 and auto.headers["x-hotloop-truncated-items"] == "1"
        assert auto.json()["usage"]["input_tokens"] < 50


def test_vllm_max_model_len_before_any_backend_call(tmp_path: Path) -> None:
    with MockChatServer(models=("served", "other")) as mock:
        mock.model_fields = {"served": {"max_model_len": WINDOW}}
        args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "served", "--store", "memory")
        with run_server(tmp_path, *args) as s:
            r = create(s, model="served", input=msgs(8), metadata={})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert f"is {WINDOW} tokens" in r.json()["error"]["message"]
            assert mock.requests == []  # refused before the backend saw it
            mock.push(Reply.stream(text_events("ok")))
            r = create(s, model="served", input=msgs(8), metadata={}, truncation="auto")
            assert r.status_code == 200, r.text
            sent = json.loads(mock.requests[-1].body)["messages"]
            assert len(sent) == 8 - int(r.headers["x-hotloop-truncated-items"])
            mock.push(Reply.stream(text_events("ok")))
            assert create(s, model="other", input=msgs(8), metadata={}).status_code == 200  # no window reported


def test_bad_limits_file_fails_start_up(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({MODEL: {"context_window": -1}}))
    env = {**os.environ, "PYTHONPATH": ROOT, "HOTLOOP_MODEL_LIMITS": str(bad), "HOTLOOP_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "hotloop", "serve", "--port", str(free_port()), "--store", "memory"],
        env=env, capture_output=True, timeout=60,
    )
    assert proc.returncode == 3
    assert b"context_window must be a positive integer" in proc.stderr
