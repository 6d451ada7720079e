"""Classifier policies end to end on real servers: flag (wire unchanged, ledger and log), redact
(stored, counted and sent redacted), block (HTTP 400, WebSocket error frame, chain intact), user
classifiers from ``--classifier`` and their states across a server restart."""

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
from tests.unit.test_secrets import POSITIVES

ROOT = str(Path(__file__).resolve().parents[2])
SECRET = {kind: secret for kind, _, secret, _ in reversed(POSITIVES)}
GH = SECRET["github_token"]
JWT = SECRET["jwt"]


def create(server: Server, **body: Any) -> httpx.Response:
    body.setdefault("model", "hotloop-sim")
    return httpx.post(server.v1 + "/responses", json=body, timeout=30)


def tool_turn(output: str, ids: bool = False) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": "list the env"},
        {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": '{"cmd": "env"}'},
        {"type": "function_call_output", "call_id": "c1", "output": output},
    ]
    if ids:  # the simulator's answer depends on the last item, its id included
        for it, iid in zip(items, ("msg_1", "fc_1", "fco_1")):
            it["id"] = iid
    return items


def usage_rows(server: Server, model: str) -> list[dict[str, Any]]:
    rows = httpx.get(server.base + "/hotloop/usage", timeout=10).json()["data"]
    return [r for r in rows if r["model"] == model]


def test_flag_changes_nothing_on_the_wire_and_counts_in_the_ledger(tmp_path: Path) -> None:
    body = {"model": "flag-test", "input": tool_turn(f"GITHUB_TOKEN={GH}\nSESSION={JWT}\n", ids=True), "metadata": {"sim": "text"}}
    with run_server(tmp_path, "--sim-rate", "0", "--secrets", "off") as off:
        plain = create(off, **body).json()
        assert usage_rows(off, "flag-test")[0]["flagged"] == 0
    with run_server(tmp_path, "--sim-rate", "0") as flag:  # the default policy
        flagged = create(flag, **body).json()
        create(flag, model="flag-test", input="nothing to see")
        [row] = usage_rows(flag, "flag-test")
        metrics = httpx.get(flag.base + "/metrics", timeout=10).text
        logs = flag.logs()
    assert flagged["output"][0]["content"][0]["text"] == plain["output"][0]["content"][0]["text"]
    assert flagged["usage"] == plain["usage"]
    assert {k: v for k, v in flagged.items() if k not in ("id", "created_at", "completed_at", "output")} == {
        k: v for k, v in plain.items() if k not in ("id", "created_at", "completed_at", "output")
    }
    assert row["responses"] == 2 and row["flagged"] == 1
    assert row["findings"] == {"github_token": 1, "jwt": 1}
    # and in the metrics (one response flagged, its findings by kind)
    assert "\nhotloop_classified_responses_total 1.0\n" in metrics
    assert 'hotloop_classifier_findings_total{kind="github_token"} 1.0' in metrics
    assert 'hotloop_classifier_findings_total{kind="jwt"} 1.0' in metrics
    assert "classifier secrets flagged" in logs and "github_token x1, jwt x1" in logs
    assert GH not in logs and JWT not in logs


def test_redact_stores_counts_and_lists_redacted_text(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {"HOTLOOP_DATA_DIR": str(data)}
    with run_server(tmp_path, "--sim-rate", "0", "--secrets", "redact", env=env) as s:
        r = create(s, input=tool_turn(f"GITHUB_TOKEN={GH}\nok"), metadata={"sim": "text"})
        assert r.status_code == 200, r.text
        first = r.json()
        listed = httpx.get(f"{s.v1}/responses/{first['id']}/input_items", params={"order": "asc"}, timeout=10).json()
        items = listed["data"]
        assert items[2]["output"] == "GITHUB_TOKEN=[REDACTED:github_token]\nok"
        assert [i["id"] for i in items] == [i["id"] for i in items if i["id"]]  # ids kept (minted)
        # the token count is that of the redacted input
        same = create(s, input=tool_turn("GITHUB_TOKEN=[REDACTED:github_token]\nok"), metadata={"sim": "text"}).json()
        assert first["usage"]["input_tokens"] == same["usage"]["input_tokens"]
        # a continuation redacts its own new items too
        r2 = create(s, input=f"and {JWT}", previous_response_id=first["id"])
        assert r2.status_code == 200
        listed = httpx.get(f"{s.v1}/responses/{r2.json()['id']}/input_items", timeout=10).json()["data"]
        assert listed[0]["content"][0]["text"] == "and [REDACTED:jwt]"
        [row] = usage_rows(s, "hotloop-sim")
        assert row["flagged"] == 2 and row["findings"] == {"github_token": 1, "jwt": 1}
        logs = s.logs()
    stored = b"".join(p.read_bytes() for p in data.rglob("*") if p.is_file())
    assert b"[REDACTED:github_token]" in stored
    assert GH.encode() not in stored and JWT.encode() not in stored
    assert GH not in logs and JWT not in logs


def test_redact_sends_redacted_text_to_a_chat_backend(tmp_path: Path) -> None:
    with MockChatServer() as mock:
        args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model", "--store", "memory")
        with run_server(tmp_path, *args, "--secrets", "redact") as s:
            mock.push(Reply.stream(text_events("ok")))
            r = create(s, model="mock-model", input=tool_turn(f"{GH} and {JWT}"))
            assert r.status_code == 200, r.text
            mock.push(Reply.stream(text_events("ok")))
            r = create(s, model="mock-model", input=f"again {GH}", previous_response_id=r.json()["id"])
            assert r.status_code == 200, r.text
        bodies = [req.body for req in mock.requests]
    assert len(bodies) == 2
    for body in bodies:
        assert GH.encode() not in body and JWT.encode() not in body
    tool_msg = [m for m in mock.requests[1].json["messages"] if m["role"] == "tool"][0]
    assert tool_msg["content"] == "[REDACTED:github_token] and [REDACTED:jwt]"
    assert mock.requests[1].json["messages"][-1]["content"] == "again [REDACTED:github_token]"


def settings_body(model: str) -> dict[str, Any]:
    """A request whose secrets sit outside its input: in the instructions, a function tool's
    description and parameter schema, the output format's schema, and nested in a shell call."""
    return {
        "model": model,
        "instructions": f"You deploy with {GH} when asked.",
        "tools": [
            {"type": "function", "name": "read", "description": f"Reads a file (auth {JWT}).",
             "parameters": {"type": "object", "properties": {
                 "path": {"type": "string", "description": f"relative; token {GH}"}}}},
        ],
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "description": f"use {GH}"}}}}},
        "input": [
            {"type": "message", "role": "user", "content": "go"},
            {"type": "local_shell_call", "id": "lsh_1", "call_id": "c7", "status": "completed",
             "action": {"type": "exec", "command": ["bash", "-lc", f"export T={GH}"], "env": {}}},
            {"type": "local_shell_call_output", "call_id": "c7", "output": "done"},
        ],
    }


def test_instructions_tools_format_and_nested_items_are_scanned(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with MockChatServer() as mock:
        args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model")
        with run_server(tmp_path, *args, "--secrets", "redact", env={"HOTLOOP_DATA_DIR": str(data)}) as s:
            mock.push(Reply.stream(text_events('{"a": "ok"}')))
            r = create(s, **settings_body("mock-model"))
            assert r.status_code == 200, r.text
            echoed = r.json()
            stored = httpx.get(f"{s.v1}/responses/{echoed['id']}", timeout=10).json()
            items = httpx.get(f"{s.v1}/responses/{echoed['id']}/input_items", params={"order": "asc"}, timeout=10).json()["data"]
            [row] = usage_rows(s, "mock-model")
            logs = s.logs()
        with run_server(tmp_path, *args, "--secrets", "block", "--store", "memory") as s:
            blocked = create(s, **settings_body("mock-model"))
            body = settings_body("mock-model")
            del body["instructions"]
            blocked_tool = create(s, **body)
            body["tools"] = []
            blocked_format = create(s, **body)
            del body["text"]
            blocked_item = create(s, **body)
        assert len(mock.requests) == 1  # nothing blocked reached the backend
        sent = mock.requests[0].body
    assert GH.encode() not in sent and JWT.encode() not in sent
    assert b"You deploy with [REDACTED:github_token] when asked." in sent
    for obj in (echoed, stored):
        assert obj["instructions"] == "You deploy with [REDACTED:github_token] when asked."
        assert obj["tools"][0]["description"] == "Reads a file (auth [REDACTED:jwt])."
        assert obj["tools"][0]["parameters"]["properties"]["path"]["description"] == "relative; token [REDACTED:github_token]"
        assert obj["text"]["format"]["schema"]["properties"]["a"]["description"] == "use [REDACTED:github_token]"
        assert GH not in json.dumps(obj) and JWT not in json.dumps(obj)
    assert items[1]["action"]["command"] == ["bash", "-lc", "export T=[REDACTED:github_token]"]
    assert items[1]["call_id"] == "c7"
    assert row["findings"] == {"github_token": 4, "jwt": 1}
    on_disk = b"".join(p.read_bytes() for p in data.rglob("*") if p.is_file())
    assert GH.encode() not in on_disk and JWT.encode() not in on_disk
    assert GH not in logs and JWT not in logs
    params = [b.json()["error"]["param"] for b in (blocked, blocked_tool, blocked_format, blocked_item)]
    assert [b.status_code for b in (blocked, blocked_tool, blocked_format, blocked_item)] == [400] * 4
    assert params == ["instructions", "tools[0].description", "text.format.schema.properties.a.description",
                      "input[1].action.command[2]"]
    assert all(b.json()["error"]["code"] == "secret_detected" for b in (blocked, blocked_item))


def test_flag_counts_secrets_outside_the_input_after_the_backend_request(tmp_path: Path) -> None:
    """Under the default policy the request's own texts are scanned off the critical path, and
    still counted in the turn's findings."""
    body = settings_body("hotloop-sim")
    body["input"] = "go"  # the flag-only path: a small input is classified after the request is out
    with run_server(tmp_path, "--sim-rate", "0", "--store", "memory") as s:
        r = create(s, **body)
        assert r.status_code == 200, r.text
        assert r.json()["instructions"] == body["instructions"]  # flag changes nothing on the wire
        [row] = usage_rows(s, "hotloop-sim")
        logs = s.logs()
    assert row["flagged"] == 1 and row["findings"] == {"github_token": 3, "jwt": 1}
    assert "classifier secrets flagged the instructions, tools or format" in logs and GH not in logs


def test_block_answers_400_and_leaves_the_chain_as_it_was(tmp_path: Path) -> None:
    with run_server(tmp_path, "--sim-rate", "0", "--secrets", "block") as s:
        r = create(s, input=tool_turn(f"ok\nGITHUB_TOKEN={GH}"))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "secret_detected"
        assert err["param"] == "input[2].output"
        assert "github_token" in err["message"] and GH not in err["message"]
        r = create(s, input=f"my key {JWT}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        with ws_connect(s.ws + "/responses", open_timeout=10) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi", "store": False}))
            first = raw_until_terminal(ws)[-1]
            assert first["type"] == "response.completed"
            parent = first["response"]["id"]
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "store": False,
                                "previous_response_id": parent, "input": tool_turn(GH)}))
            [frame] = raw_until_terminal(ws)
            assert frame["type"] == "error" and frame["status"] == 400
            assert frame["error"]["code"] == "secret_detected" and frame["error"]["param"] == "input[2].output"
            # the same socket continues the same (unstored) parent: the block did not evict it
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "store": False,
                                "previous_response_id": parent, "input": tool_turn("clean")}))
            done = raw_until_terminal(ws)[-1]
            assert done["type"] == "response.completed" and done["response"]["previous_response_id"] == parent
        logs = s.logs()
        assert usage_rows(s, "hotloop-sim")[0]["responses"] == 2  # the two WebSocket turns; blocked requests are none
    assert "classifier secrets blocked" in logs and GH not in logs and JWT not in logs


def _log_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_user_classifier_sees_each_item_once_across_a_restart(tmp_path: Path) -> None:
    log = tmp_path / "seen.jsonl"
    data = tmp_path / "data"
    env = {"HOTLOOP_TEST_CLASSIFIER_LOG": str(log), "HOTLOOP_DATA_DIR": str(data), "PYTHONPATH": ROOT}
    prev = None
    with run_server(tmp_path, "--sim-rate", "0", "--classifier", "tests.classifier_examples:counting", env=env) as s:
        for i in range(3):
            r = create(s, input=f"turn {i}" + (" flag-me" if i == 1 else ""), previous_response_id=prev)
            assert r.status_code == 200, r.text
            prev = r.json()["id"]
        [row] = usage_rows(s, "hotloop-sim")
        assert row["flagged"] == 1 and row["findings"] == {"flag_me": 1}
        r = create(s, input="block-me", previous_response_id=prev)
        assert r.status_code == 400 and r.json()["error"]["code"] == "input_blocked"
        assert r.json()["error"]["message"] == "The input asks to be blocked."
    # a fresh process on the same data dir, the classifier named in the environment this time
    with run_server(tmp_path, "--sim-rate", "0", env={**env, "HOTLOOP_CLASSIFIERS": "tests.classifier_examples:counting"}) as s:
        for i in range(3, 5):
            r = create(s, input=f"turn {i}", previous_response_id=prev)
            assert r.status_code == 200, r.text
            prev = r.json()["id"]
    seen = _log_lines(log)
    texts = [t for line in seen for t in line["texts"]]
    assert texts == ["turn 0", "turn 1 flag-me", "turn 2", "block-me", "turn 3", "turn 4"]
    assert [(line["turns"], line["items"]) for line in seen] == [(0, 0), (1, 1), (2, 2), (3, 3), (3, 3), (4, 4)]


def test_a_bad_classifier_spec_fails_start_up(tmp_path: Path) -> None:
    for args, says in [
        (["--classifier", "tests.classifier_examples:nope"], "has no attribute 'nope'"),
        (["--classifier", "no_such_module_here:x"], "cannot import 'no_such_module_here'"),
    ]:
        cmd = [sys.executable, "-m", "hotloop", "serve", "--port", str(free_port()), "--store", "memory", *args]
        env = {**os.environ, "PYTHONPATH": ROOT, "HOTLOOP_DATA_DIR": str(tmp_path)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 3, out
        assert "start-up failed" in out and says in out and "Traceback" not in out
    cmd = [sys.executable, "-m", "hotloop", "serve", "--port", str(free_port()), "--store", "memory"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**env, "HOTLOOP_SECRETS": "loud"}, cwd=ROOT)
    assert proc.returncode == 3 and "--secrets (HOTLOOP_SECRETS) must be one of off, flag, redact, block" in proc.stdout + proc.stderr
