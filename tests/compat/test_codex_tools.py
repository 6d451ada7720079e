"""Codex CLI (``codex exec``) running a real tool loop against ``hotloop serve``, over WebSocket
mode and over HTTP SSE.

The loop Codex users run: (WebSocket) a ``generate: false`` prewarm, a turn whose answer is a call
of Codex's shell tool, Codex running the command, then the next ``response.create`` carrying the
tool's output, and a final text answer; with reasoning items streamed before the call and before
the answer. The simulator is scripted (``--sim-script``, an entry object with ``calls``) to call
Codex 0.171.0's ``exec_command`` tool (``{"cmd": string, ...}``, ``required: ["cmd"]``) with a
harmless command that reads a file in the test's temp dir and echoes a marker.

A byte-level relay (``codex_tools_relay.py``) sits between Codex and the server and records both
directions, so the assertions are about what Codex really sent and received: the tool output
reached the server in the next request, the WebSocket continuation used ``previous_response_id``
and only the new item, ``store: false`` everywhere.

Needs the simulator's scripted calls (script entry objects ``{"sim": ..., "calls": [{"name",
"arguments"}]}``, added by the patch codex-sim-calls); without them each test fails saying so. Codex is installed as ``test_codex.py`` does (``npm ci`` on first use).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from hotloop.backends import simulator
from hotloop.backends.simulator import _WORDS
from tests.compat.codex_tools_relay import Relay, read_conn
# importing test_codex applies its Node.js requirement here too; codex is its install fixture
from tests.compat.test_codex import CONFIG, codex, exec_codex  # noqa: F401
from tests.conftest import Server, run_server

RUN_TIMEOUT = 90.0  # seconds for one `codex exec` (a few seconds against the unpaced simulator)
ANSWER_TOKENS = 20
TOOL = "exec_command"  # Codex 0.171.0's shell tool (unified exec), arguments {"cmd": "..."}
MARKER = "hotloop-ok"

pytestmark = [pytest.mark.timeout(900)]  # the first run may install Codex (npm ci)


def _script(tmp: Path, command: str, *, reasoning: bool) -> str:
    r = "reasoning," if reasoning else ""
    path = tmp / "sim-script.json"
    path.write_text(json.dumps({"turns": [
        {"sim": f"{r}tokens:8", "calls": [{"name": TOOL, "arguments": {"cmd": command}}]},
        f"{r}text,tokens:{ANSWER_TOKENS}",
    ]}))  # fmt: skip
    return str(path)


def run_codex_tool_turn(
    codex_cmd: list[str], server: Server, relay: Relay, tmp: Path, *, websockets: bool, prompt: str,
    jsonl: bool = True, extra_config: str = "",
) -> dict[str, Any]:
    """One ``codex exec --json`` (or, ``jsonl=False``, human-readable) run through ``relay``; its
    exit code, JSONL events, stdout, stderr and what crossed the wire (``conns``: read_conn of
    every recorded connection). ``extra_config``: top-level lines added to Codex's config.toml."""
    home = tmp / "codex-home"
    work = tmp / "work"
    home.mkdir()
    # the command runs in `work` (Codex's -C); workspace-write keeps Codex's sandbox on and lets
    # a command run without asking (approval_policy = "never")
    config = CONFIG.format(base_url=f"http://127.0.0.1:{relay.port}/v1", websockets="true" if websockets else "false")
    config = config.replace('sandbox_mode = "read-only"', 'sandbox_mode = "workspace-write"\n' + extra_config)
    (home / "config.toml").write_text(config)
    last = tmp / "last-message.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(
        CODEX_HOME=str(home), HOME=str(tmp), HOTLOOP_CODEX_TEST_KEY="sk-hotloop-test", NO_COLOR="1",
        RUST_LOG="error", NO_PROXY="*",
    )  # fmt: skip
    cmd = [
        *codex_cmd, "exec",
        "--skip-git-repo-check", "--ephemeral", "--strict-config",
        "--color", "never", *(["--json"] if jsonl else []), "-o", str(last), "-C", str(work),
        prompt,
    ]  # fmt: skip
    started = time.monotonic()
    returncode, stdout, stderr = exec_codex(cmd, work, env, server, RUN_TIMEOUT)
    elapsed = time.monotonic() - started
    time.sleep(0.2)  # the relay's last reads (the socket's close) after Codex exited
    conns = [read_conn(c) for c in list(relay.conns)]
    context = (
        f"exit {returncode} after {elapsed:.1f}s\nstdout:\n{stdout[-6000:]}\nstderr:\n{stderr[-4000:]}\n"
        f"server log:\n{server.logs()[-4000:]}"
    )
    assert returncode == 0, context
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {
        "events": events, "stdout": stdout, "stderr": stderr, "last": last.read_text() if last.exists() else None,
        "context": context, "conns": conns,
    }  # fmt: skip


def _check_codex_side(run: dict[str, Any], nonce: str) -> str:
    """Codex ran the command (its JSONL shows the command and its output) and printed the
    simulator's final answer; returns that answer."""
    events, context = run["events"], run["context"]
    types = [e.get("type") for e in events]
    assert "turn.completed" in types and "turn.failed" not in types and "error" not in types, context
    done = [e["item"] for e in events if e.get("type") == "item.completed"]
    commands = [i for i in done if i.get("type") == "command_execution"]
    assert len(commands) == 1, context
    assert MARKER in commands[0]["command"] and commands[0].get("exit_code") == 0, context
    assert nonce in commands[0]["aggregated_output"] and MARKER in commands[0]["aggregated_output"], context
    messages = [i["text"] for i in done if i.get("type") == "agent_message"]
    assert len(messages) == 1, context
    words = messages[0].split()
    assert words and set(words) <= set(_WORDS), context  # the simulator's corpus, not anything Codex made up
    assert run["last"] is not None and run["last"].strip() == messages[0].strip(), context
    return messages[0]


def _check_call_output(call: dict[str, Any], output_item: dict[str, Any], command: str, nonce: str, ctx: str) -> None:
    """The function_call hotloop streamed is exactly the scripted one, and the next request
    carries Codex's output of it under the same call_id."""
    assert call["type"] == "function_call" and call["name"] == TOOL, ctx
    assert json.loads(call["arguments"]) == {"cmd": command}, ctx
    assert output_item["type"] == "function_call_output" and output_item["call_id"] == call["call_id"], ctx
    out = output_item["output"]
    text = out if isinstance(out, str) else json.dumps(out)
    assert nonce in text and MARKER in text, ctx  # what the command printed reached the server


def _check_server_log(server: Server, ctx: str) -> None:
    log = server.logs()
    assert "Traceback" not in log, ctx
    bad = [ln for ln in log.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b", ln)]
    assert not bad, ctx + "\nerror lines:\n" + "\n".join(bad)


def _stats(server: Server) -> dict[str, Any]:
    return dict(httpx.get(server.base + "/hotloop/stats", timeout=10).json())


def _setup(tmp: Path) -> tuple[str, str]:
    if not hasattr(simulator, "Call"):
        pytest.fail("the simulator cannot script a named tool call (script entry objects with 'calls': "
                    "the codex-sim-calls patch)")
    work = tmp / "work"
    work.mkdir()
    nonce = f"nonce-{uuid.uuid4().hex[:12]}"
    (work / "note.txt").write_text(nonce + "\n")
    return nonce, f"cat note.txt && echo {MARKER}"


def _check_not_stored(server: Server, ids: list[str], ctx: str) -> None:
    """store:false: none of the responses can be read back, and continuing one from outside its
    WebSocket connection (a new connection, or HTTP) is previous_response_not_found."""
    from websockets.sync.client import connect

    auth = {"Authorization": "Bearer sk-hotloop-test"}
    for rid in ids:
        r = httpx.get(f"{server.v1}/responses/{rid}", headers=auth, timeout=10)
        assert r.status_code == 404, ctx + f"\nGET {rid}: {r.status_code} {r.text[:500]}"
    last = ids[-1]
    body = {"model": "hotloop-sim", "previous_response_id": last, "store": False,
            "input": [{"type": "message", "role": "user", "content": "again"}]}  # fmt: skip
    r = httpx.post(server.v1 + "/responses", json=body, headers=auth, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found", ctx + r.text[:500]
    with connect(server.ws + "/responses", additional_headers=auth, open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "response.create", **body}))
        frame = json.loads(ws.recv(timeout=10))
    assert frame["type"] == "error" and frame["status"] == 400, ctx + json.dumps(frame)
    assert frame["error"]["code"] == "previous_response_not_found", ctx + json.dumps(frame)


PROMPT = "Run the command that prints the note, then reply with one short sentence."


@pytest.mark.parametrize("reasoning", [True, False], ids=["reasoning", "plain"])
def test_codex_tool_loop_websocket(codex: list[str], tmp_path: Path, reasoning: bool) -> None:  # noqa: F811
    nonce, command = _setup(tmp_path)
    script = _script(tmp_path, command, reasoning=reasoning)
    with run_server(tmp_path, "--sim-rate", "0", "--sim-script", script) as server, Relay(server.port) as relay:
        run = run_codex_tool_turn(codex, server, relay, tmp_path, websockets=True, prompt=PROMPT)
        st = _stats(server)
        ids = [e["response"]["id"] for c in run["conns"] if c["kind"] == "ws" for e in c["received"]
               if e["type"] == "response.completed"]  # fmt: skip
        _check_not_stored(server, ids, run["context"])
    ctx = run["context"] + f"\nstats: {json.dumps(st)[:4000]}"
    _check_codex_side(run, nonce)
    assert "Falling back from WebSockets" not in run["stderr"], ctx
    ws = [c for c in run["conns"] if c["kind"] == "ws"]
    assert len(ws) == 1 and not [c for c in run["conns"] if c["kind"] == "http"], ctx
    conn = ws[0]
    ctx += "\nframes sent: " + json.dumps([{k: v for k, v in f.items() if k not in ("tools", "instructions")}
                                            for f in conn["sent"]])[:6000]  # fmt: skip
    assert conn["path"] == "/v1/responses" and " 101 " in conn["status"], ctx
    creates = [f for f in conn["sent"] if f["type"] == "response.create"]
    others = [f for f in conn["sent"] if f["type"] != "response.create"]
    assert all(f["type"] == "response.processed" for f in others), ctx  # accepted and ignored (wire ref 1.3)
    # prewarm, the turn that calls the tool, the turn that answers
    assert len(creates) == 3, ctx
    prewarm, first, second = creates
    assert prewarm.get("generate") is False and "previous_response_id" not in prewarm, ctx
    assert all(f["store"] is False and f.get("stream") is True for f in creates), ctx
    assert any(t.get("name") == TOOL and t.get("type") == "function" for t in first["tools"]), ctx
    completed = [e["response"] for e in conn["received"] if e["type"] == "response.completed"]
    assert [e["type"] for e in conn["received"] if e["type"] in ("error", "response.failed")] == [], ctx
    assert len(completed) == 3, ctx
    assert completed[0]["output"] == [] and completed[0]["status"] == "completed", ctx
    # each turn continues the response before it by id, with only its new items
    assert first["previous_response_id"] == completed[0]["id"], ctx
    assert second["previous_response_id"] == completed[1]["id"], ctx
    assert all(r["store"] is False for r in completed), ctx
    out1 = completed[1]["output"]
    kinds = [i["type"] for i in out1]
    assert kinds == (["reasoning", "function_call"] if reasoning else ["function_call"]), ctx
    assert [i["type"] for i in second["input"]] == ["function_call_output"], ctx  # only the new item
    _check_call_output(out1[-1], second["input"][0], command, nonce, ctx)
    out2 = completed[2]["output"]
    assert [i["type"] for i in out2] == (["reasoning", "message"] if reasoning else ["message"]), ctx
    # usage: the continuation's prefix was cached on the connection (store:false: nothing else has it)
    u = completed[2]["usage"]
    assert 0 < u["input_tokens_details"]["cached_tokens"] < u["input_tokens"], ctx
    if reasoning:
        assert u["output_tokens_details"]["reasoning_tokens"] > 0, ctx
    assert [t["transport"] for t in st["turns"]] == ["ws"] * 3, ctx
    assert st["completed_responses"] == 3 and st["active_responses"] == 0, ctx
    _check_server_log(server, ctx)


@pytest.mark.parametrize("reasoning", [True, False], ids=["reasoning", "plain"])
def test_codex_tool_loop_http_sse(codex: list[str], tmp_path: Path, reasoning: bool) -> None:  # noqa: F811
    nonce, command = _setup(tmp_path)
    script = _script(tmp_path, command, reasoning=reasoning)
    with run_server(tmp_path, "--sim-rate", "0", "--sim-script", script) as server, Relay(server.port) as relay:
        run = run_codex_tool_turn(codex, server, relay, tmp_path, websockets=False, prompt=PROMPT)
        st = _stats(server)
        ids = [ex["events"][-1]["response"]["id"] for c in run["conns"] if c["kind"] == "http"
               for ex in c["exchanges"] if ex.get("events")]  # fmt: skip
        _check_not_stored(server, ids, run["context"])
    ctx = run["context"] + f"\nstats: {json.dumps(st)[:4000]}"
    _check_codex_side(run, nonce)
    assert not [c for c in run["conns"] if c["kind"] == "ws"], ctx
    posts = [ex for c in run["conns"] if c["kind"] == "http" for ex in c["exchanges"]
             if ex["method"] == "POST" and ex["path"] == "/v1/responses"]  # fmt: skip
    assert len(posts) == 2, ctx
    bodies = [json.loads(ex["body"]) for ex in posts]
    ctx += "\nrequest inputs: " + json.dumps([b["input"] for b in bodies])[-6000:]
    assert all(" 200 " in ex["status"] for ex in posts), ctx
    assert all(b["store"] is False and b["stream"] is True and "previous_response_id" not in b for b in bodies), ctx
    completed = []
    for ex in posts:
        evs = ex["events"]
        assert [e["type"] for e in evs if e["type"] in ("error", "response.failed")] == [], ctx
        assert evs[-1]["type"] == "response.completed", ctx
        assert [e["sequence_number"] for e in evs] == list(range(len(evs))), ctx
        completed.append(evs[-1]["response"])
    out1 = completed[0]["output"]
    assert [i["type"] for i in out1] == (["reasoning", "function_call"] if reasoning else ["function_call"]), ctx
    # over HTTP (store:false) Codex resends the whole conversation: the first request's input,
    # the model's items, then the tool's output
    first, second = bodies
    assert second["input"][: len(first["input"])] == first["input"], ctx
    tail = second["input"][len(first["input"]) :]
    assert [i["type"] for i in tail] == [*(["reasoning"] if reasoning else []), "function_call", "function_call_output"], ctx
    assert tail[-2]["call_id"] == out1[-1]["call_id"], ctx
    _check_call_output(out1[-1], tail[-1], command, nonce, ctx)
    assert [i["type"] for i in completed[1]["output"]] == (["reasoning", "message"] if reasoning else ["message"]), ctx
    assert [t["transport"] for t in st["turns"]] == ["sse", "sse"], ctx
    assert st["completed_responses"] == 2 and st["active_responses"] == 0, ctx
    _check_server_log(server, ctx)


def _replay_as_http(server: Server, creates: list[dict[str, Any]], completed: list[dict[str, Any]], ctx: str) -> None:
    """The WebSocket conversation, resent as full-history HTTP requests (what a client without
    previous_response_id sends): hotloop counts the same input tokens both ways, so the
    incremental path (only the new items) saw exactly the conversation the full path sees."""
    history = list(creates[0]["input"])
    for i in range(1, len(creates)):
        history += creates[i]["input"]
        body = {k: v for k, v in creates[i].items() if k not in ("type", "previous_response_id", "input", "stream")}
        body["input"] = history
        r = httpx.post(server.v1 + "/responses", json=body, headers={"Authorization": "Bearer sk-hotloop-test"},
                       timeout=30)  # fmt: skip
        assert r.status_code == 200, ctx + f"\nreplay of turn {i}: {r.status_code} {r.text[:2000]}"
        got, want = r.json()["usage"]["input_tokens"], completed[i]["usage"]["input_tokens"]
        assert got == want, ctx + f"\nreplay of turn {i}: HTTP counted {got} input tokens, WebSocket {want}"
        history += completed[i]["output"]


@pytest.mark.parametrize("websockets", [True, False], ids=["websocket", "http_sse"])
def test_codex_parallel_then_chained_calls(codex: list[str], tmp_path: Path, websockets: bool) -> None:  # noqa: F811
    """Three model turns, paced (2,000 tokens/s, 50 ms to the first token): two parallel calls
    (the second command fails with exit code 3), then a call whose output is about 30 KB (Codex
    truncates it; the frame carrying it is over hotloop's 16 KB fast-decode size), then the answer."""
    nonce, _ = _setup(tmp_path)
    cmds = [f"echo one-{MARKER}", "echo two; exit 3", f"cat note.txt && seq 1 30000 && echo {MARKER}"]
    path = tmp_path / "sim-script.json"
    path.write_text(json.dumps({"turns": [
        {"sim": "reasoning,tokens:6", "calls": [{"name": TOOL, "arguments": {"cmd": c}} for c in cmds[:2]]},
        {"sim": "reasoning,tokens:6", "calls": [{"name": TOOL, "arguments": {"cmd": cmds[2]}}]},
        f"reasoning,text,tokens:{ANSWER_TOKENS}",
    ]}))  # fmt: skip
    args = ("--sim-rate", "2000", "--sim-ttft", "0.05", "--sim-script", str(path))
    with run_server(tmp_path, *args) as server, Relay(server.port) as relay:
        run = run_codex_tool_turn(codex, server, relay, tmp_path, websockets=websockets, prompt=PROMPT)
        ctx = run["context"]
        if websockets:
            ws = [c for c in run["conns"] if c["kind"] == "ws"]
            assert len(ws) == 1, ctx
            creates = [f for f in ws[0]["sent"] if f["type"] == "response.create"]
            received = ws[0]["received"]
            completed = [e["response"] for e in received if e["type"] == "response.completed"]
            assert len(creates) == 4 and len(completed) == 4, ctx  # prewarm + three turns
            _replay_as_http(server, creates, completed, ctx)
            requests = creates[1:]
            completed = completed[1:]
            for prev, req in zip([None, *completed], requests):
                assert prev is None or req["previous_response_id"] == prev["id"], ctx
        else:
            posts = [ex for c in run["conns"] if c["kind"] == "http" for ex in c["exchanges"]
                     if ex["method"] == "POST" and ex["path"] == "/v1/responses"]  # fmt: skip
            requests = [json.loads(ex["body"]) for ex in posts]
            received = [e for ex in posts for e in ex["events"]]
            completed = [ex["events"][-1]["response"] for ex in posts]
            assert len(requests) == 3 and all(e["type"] == "response.completed" for e in
                                              [ex["events"][-1] for ex in posts]), ctx  # fmt: skip
            assert all("previous_response_id" not in r for r in requests), ctx
        _check_server_log(server, ctx)
    assert [e["type"] for e in received if e["type"] in ("error", "response.failed")] == [], ctx
    assert all(r["store"] is False for r in requests), ctx
    assert [[i["type"] for i in r["output"]] for r in completed] == [
        ["reasoning", "function_call", "function_call"], ["reasoning", "function_call"], ["reasoning", "message"]
    ], ctx
    calls = [i for r in completed[:2] for i in r["output"] if i["type"] == "function_call"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"cmd": c} for c in cmds], ctx
    assert len({c["call_id"] for c in calls}) == 3, ctx
    # each tool output went back in the next request under its call_id
    outputs = {i["call_id"]: i["output"] for r in requests for i in r["input"] if i["type"] == "function_call_output"}
    assert set(outputs) == {c["call_id"] for c in calls}, ctx
    texts = [outputs[c["call_id"]] for c in calls]
    assert f"one-{MARKER}" in texts[0] and "two" in texts[1] and "code 3" in texts[1], ctx
    # Codex keeps the head and the tail of a long output and says it cut the middle
    assert nonce in texts[2] and "truncated" in texts[2] and texts[2].rstrip().endswith(MARKER), ctx
    if websockets:  # only what is new: the first turn's user items, then the tool outputs
        assert [[i["type"] for i in r["input"]] for r in requests[1:]] == [["function_call_output"] * 2,
                                                                           ["function_call_output"]], ctx  # fmt: skip
    done = [e["item"] for e in run["events"] if e.get("type") == "item.completed"]
    runs = [(i["command"], i.get("exit_code")) for i in done if i.get("type") == "command_execution"]
    # Codex runs parallel calls concurrently: they may finish in either order
    assert len(runs) == 3 and sorted((next(i for i, c in enumerate(cmds) if c in cmd), code) for cmd, code in runs) == [
        (0, 0), (1, 3), (2, 0)
    ], ctx
    messages = [i["text"] for i in done if i.get("type") == "agent_message"]
    assert len(messages) == 1 and set(messages[0].split()) <= set(_WORDS), ctx


@pytest.mark.parametrize("raw", [False, True], ids=["default", "show_raw_agent_reasoning"])
def test_codex_shows_hotloop_reasoning(codex: list[str], tmp_path: Path, raw: bool) -> None:  # noqa: F811
    """Codex asks for reasoning summaries (``reasoning.summary: "auto"`` on every turn) and shows
    those; hotloop has no summarizer and streams the model's reasoning verbatim as the summary
    (``response.reasoning_summary_text.*``, no raw ``reasoning_text``), so Codex prints both
    turns' reasoning, in order, around the command and before the answer, without
    ``show_raw_agent_reasoning`` (and the same with it). This run reads Codex's human-readable
    output."""
    nonce, command = _setup(tmp_path)
    script = _script(tmp_path, command, reasoning=True)
    with run_server(tmp_path, "--sim-rate", "0", "--sim-script", script) as server, Relay(server.port) as relay:
        run = run_codex_tool_turn(codex, server, relay, tmp_path, websockets=True, prompt=PROMPT, jsonl=False,
                                  extra_config="show_raw_agent_reasoning = true" if raw else "")  # fmt: skip
        _check_server_log(server, run["context"])
    ctx = run["context"]
    (conn,) = [c for c in run["conns"] if c["kind"] == "ws"]
    turns = [f for f in conn["sent"] if f["type"] == "response.create" and f.get("generate") is not False]
    assert len(turns) == 2 and all((f.get("reasoning") or {}).get("summary") == "auto" for f in turns), ctx
    received = conn["received"]
    assert not [e for e in received if e["type"].startswith("response.reasoning_text.")], ctx
    thoughts = [e["text"] for e in received if e["type"] == "response.reasoning_summary_text.done"]
    answer = [e["text"] for e in received if e["type"] == "response.output_text.done"]
    assert len(thoughts) == 2 and all(thoughts) and len(answer) == 1, ctx
    err = run["stderr"]
    first, ran, second = err.find(thoughts[0]), err.find(f"echo {MARKER}"), err.find(thoughts[1])
    assert -1 < first < ran < second, ctx  # reasoning, the command, reasoning (then the answer)
    assert nonce in err and answer[0] in run["stdout"], ctx
    assert run["last"] is not None and run["last"].strip() == answer[0].strip(), ctx


def test_codex_lists_reasoning_and_sends_it_back(codex: list[str], tmp_path: Path) -> None:  # noqa: F811
    """Over HTTP SSE with ``--json``: Codex lists each turn's reasoning as a ``reasoning`` item
    (what it shows), and sends the first turn's reasoning back in the next request (store:
    false, the whole conversation) as the item with its summary, the model's reasoning verbatim:
    what hotloop renders as reasoning history for a backend that takes it."""
    nonce, command = _setup(tmp_path)
    script = _script(tmp_path, command, reasoning=True)
    with run_server(tmp_path, "--sim-rate", "0", "--sim-script", script) as server, Relay(server.port) as relay:
        run = run_codex_tool_turn(codex, server, relay, tmp_path, websockets=False, prompt=PROMPT)
        _check_server_log(server, run["context"])
    ctx = run["context"]
    _check_codex_side(run, nonce)
    posts = [ex for c in run["conns"] if c["kind"] == "http" for ex in c["exchanges"]
             if ex["method"] == "POST" and ex["path"] == "/v1/responses"]  # fmt: skip
    assert len(posts) == 2, ctx
    bodies = [json.loads(ex["body"]) for ex in posts]
    assert all(b["reasoning"]["summary"] == "auto" for b in bodies), ctx
    thoughts = [e["text"] for ex in posts for e in ex["events"] if e["type"] == "response.reasoning_summary_text.done"]
    assert len(thoughts) == 2 and all(thoughts), ctx
    shown = [e["item"]["text"] for e in run["events"] if e.get("type") == "item.completed"
             and e["item"].get("type") == "reasoning"]  # fmt: skip
    assert [t.strip() for t in shown] == [t.strip() for t in thoughts], ctx
    ctx += "\nrequest inputs: " + json.dumps([b["input"] for b in bodies])[-6000:]
    back = [i for i in bodies[1]["input"] if i["type"] == "reasoning"]
    assert len(back) == 1 and [p["text"] for p in back[0]["summary"]] == [thoughts[0]], ctx
    assert not back[0].get("content"), ctx  # hotloop's item had no raw content: the summary is it
    # Codex asks for the encrypted content (include) and sends it back as it got it (protocol.sealed)
    assert all("reasoning.encrypted_content" in b["include"] for b in bodies), ctx
    done = [e["item"] for e in posts[0]["events"] if e["type"] == "response.output_item.done" and e["item"]["type"] == "reasoning"]
    assert back[0]["encrypted_content"].startswith("hl1.") and back[0]["encrypted_content"] == done[0]["encrypted_content"], ctx
