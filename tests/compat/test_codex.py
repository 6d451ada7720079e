"""Codex CLI (``codex exec``) against a real server, over WebSocket mode and over HTTP SSE.

Codex is pinned in ``codex/package.json``/``codex/package-lock.json`` (the platform binary is an
npm optional dependency) and installed with ``npm ci`` on first use. It talks to the server
through a custom model provider (``wire_api = "responses"``) in a throwaway ``CODEX_HOME``; the
simulator is scripted to answer with text only, so Codex never runs a tool. Without ``node`` or
``npm`` these tests skip saying so.

What Codex 0.171.0 sends, for reference: over WebSocket it opens ``GET /v1/responses`` with
``OpenAI-Beta: responses_websockets=2026-02-06``, prewarms with a ``response.create`` carrying
``generate: false`` (the developer message and tools), then sends the turn as a second
``response.create`` with ``previous_response_id`` of the prewarm and only the new input items;
both carry ``store: false``, ``stream: true`` and ``client_metadata``. Over HTTP it sends a single
``POST /v1/responses`` with the full input and ``store: false``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from hotloop.backends.simulator import _WORDS
from tests.conftest import Server, run_server
from tests.services import require

HERE = Path(__file__).parent
CODEX_DIR = HERE / "codex"
CODEX_VERSION = "0.171.0"
# Codex runs on Node.js: a test failure under CI (.ci/run installs it), else skipped
NODE = require("node", "nodejs", module=True)
NPM = require("npm", "npm", module=True)
ANSWER_TOKENS = 20
RUN_TIMEOUT = 60.0  # seconds for one `codex exec` (it takes well under a second against the simulator)

pytestmark = [
    pytest.mark.timeout(900),  # the first run installs Codex (npm ci) before the test body
]


def _installed_version() -> str | None:
    pkg = CODEX_DIR / "node_modules" / "@openai" / "codex" / "package.json"
    try:
        return str(json.loads(pkg.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="module")
def codex() -> list[str]:
    """The command that runs the pinned Codex CLI (installing it first if needed)."""
    if _installed_version() != CODEX_VERSION:
        subprocess.run(
            [NPM, "ci", "--no-audit", "--no-fund"], cwd=CODEX_DIR, check=True, timeout=600, stdin=subprocess.DEVNULL
        )
    cmd = [NODE, str(CODEX_DIR / "node_modules" / "@openai" / "codex" / "bin" / "codex.js")]
    out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and CODEX_VERSION in out.stdout, out.stdout + out.stderr
    return cmd


CONFIG = """\
model = "hotloop-sim"
model_provider = "hotloop"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.hotloop]
name = "hotloop"
base_url = "{base_url}"
env_key = "HOTLOOP_CODEX_TEST_KEY"
wire_api = "responses"
supports_websockets = {websockets}
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 30000
websocket_connect_timeout_ms = 10000
"""


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def exec_codex(cmd: list[str], work: Path, env: dict[str, str], server: Server, timeout: float = RUN_TIMEOUT) -> tuple[int, str, str]:
    """Run one ``codex exec`` in its own process group, killed (and the test failed, with the
    server's log) past ``timeout``; its exit code, stdout and stderr."""
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate(timeout=10)
        pytest.fail(f"codex exec hung for {timeout}s\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}\n"
                    f"server log:\n{server.logs()[-4000:]}")  # fmt: skip
    finally:
        _kill_group(proc)  # anything Codex left behind in its process group
    return proc.returncode, stdout, stderr


def run_codex(codex: list[str], server: Server, tmp: Path, *, websockets: bool) -> dict[str, Any]:
    """One ``codex exec --json`` turn against ``server``; its exit code, JSONL events and stderr."""
    home = tmp / "codex-home"
    work = tmp / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        CONFIG.format(base_url=server.v1, websockets="true" if websockets else "false")
    )
    last = tmp / "last-message.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(
        CODEX_HOME=str(home),
        HOME=str(tmp),
        HOTLOOP_CODEX_TEST_KEY="sk-hotloop-test",
        NO_COLOR="1",
        RUST_LOG="error",
        NO_PROXY="*",
    )
    cmd = [
        *codex, "exec",
        "--skip-git-repo-check", "--ephemeral", "--strict-config",
        "--color", "never", "--json", "-o", str(last), "-C", str(work),
        "Reply with one short sentence.",
    ]  # fmt: skip
    returncode, stdout, stderr = exec_codex(cmd, work, env, server)
    context = (
        f"exit {returncode}\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}\n"
        f"server log:\n{server.logs()[-4000:]}"
    )
    assert returncode == 0, context
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {"events": events, "stderr": stderr, "last": last.read_text() if last.exists() else None, "context": context}


def check_answer(run: dict[str, Any]) -> dict[str, Any]:
    """The turn completed with the simulator's text answer; returns its usage."""
    events, context = run["events"], run["context"]
    types = [e.get("type") for e in events]
    assert "turn.completed" in types and "turn.failed" not in types and "error" not in types, context
    done = [e["item"] for e in events if e.get("type") == "item.completed"]
    messages = [item["text"] for item in done if item.get("type") == "agent_message"]
    assert len(messages) == 1, context
    words = messages[0].split()
    assert words and set(words) <= set(_WORDS), context  # the simulator's corpus, not anything Codex made up
    assert run["last"] is not None and run["last"].strip() == messages[0].strip(), context
    usage = next(e["usage"] for e in events if e.get("type") == "turn.completed")
    assert usage["output_tokens"] == ANSWER_TOKENS and usage["input_tokens"] > 0, context
    return dict(usage)


def stats(server: Server) -> dict[str, Any]:
    return dict(httpx.get(server.base + "/hotloop/stats", timeout=10).json())


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "sim-script.json"
    path.write_text(json.dumps({"turns": [f"text,tokens:{ANSWER_TOKENS}"]}))  # text only: no tool calls
    return str(path)


def test_codex_exec_websocket(codex: list[str], tmp_path: Path, script: str) -> None:
    with run_server(tmp_path, "--sim-rate", "0", "--sim-script", script) as server:
        run = run_codex(codex, server, tmp_path, websockets=True)
        usage = check_answer(run)
        st = stats(server)
    context = run["context"] + f"\nstats: {json.dumps(st)}"
    assert "Falling back from WebSockets" not in run["stderr"], context
    turns = st["turns"]
    # Two responses on the socket: the generate:false prewarm (response.created, response.in_progress,
    # response.completed and nothing else), then the turn itself.
    assert [t["transport"] for t in turns] == ["ws", "ws"], context
    assert turns[0]["events"] == 3 and turns[1]["events"] > 3, context
    assert st["completed_responses"] == 2 and st["active_responses"] == 0, context
    # The turn continued from the prewarm by previous_response_id (store:false, so only the
    # connection-local cache can resolve it) and reports the prewarmed prefix as cached.
    assert 0 < usage["cached_input_tokens"] < usage["input_tokens"], context


def test_codex_exec_http_sse(codex: list[str], tmp_path: Path, script: str) -> None:
    with run_server(tmp_path, "--sim-rate", "0", "--sim-script", script) as server:
        run = run_codex(codex, server, tmp_path, websockets=False)
        check_answer(run)
        st = stats(server)
    context = run["context"] + f"\nstats: {json.dumps(st)}"
    # One streamed POST /v1/responses with the whole input; no prewarm over HTTP.
    assert [t["transport"] for t in st["turns"]] == ["sse"], context
    assert st["completed_responses"] == 1 and st["active_responses"] == 0, context
