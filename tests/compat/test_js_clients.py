"""Real JavaScript clients against a real server: openai-node (HTTP, SSE, ResponsesWS) and the
Vercel AI SDK (streamText, a generateText tool loop, reasoning summaries).

The clients are pinned in ``package.json``/``package-lock.json`` and installed with ``npm ci`` on
first use (the npm registry is reachable wherever the suite runs). Without a ``node`` executable
the JavaScript runtime itself is absent, and these tests skip saying so.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.services import require

HERE = Path(__file__).parent
# the JavaScript clients need Node.js: a test failure under CI (.ci/run installs it), else skipped
NODE = require("node", "nodejs", module=True)


@pytest.fixture(scope="module")
def node_modules() -> Path:
    nm = HERE / "node_modules"
    if not (nm / "openai").is_dir() or not (nm / "ai").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=HERE, check=True, timeout=600)
    return nm


def run_js(script: str, server) -> dict:
    proc = subprocess.run([NODE, str(HERE / script), server.v1], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_openai_node(node_modules, server) -> None:
    out = run_js("openai_node.mjs", server)
    assert out["json"]["status"] == "completed" and out["json"]["text"] and out["json"]["total"] > 0
    assert out["sse"] == {"first": "response.created", "last": "response.completed", "count": out["sse"]["count"], "matches": True}
    assert out["sse"]["count"] >= 9
    assert out["ws"]["first"] == "response.created" and out["ws"]["last"] == "response.completed"
    assert out["ws"]["chained"] is True
    assert out["ws"]["cached"] >= out["ws"]["firstTotal"]


def test_vercel_ai_sdk(node_modules, server) -> None:
    out = run_js("ai_sdk.mjs", server)
    assert out["stream"]["text"] and out["stream"]["finish"] == "stop"
    assert out["stream"]["inputTokens"] > 0 and out["stream"]["outputTokens"] > 0
    assert out["tools"]["executed"] == "example city"
    assert out["tools"]["steps"] == 2 and out["tools"]["finalText"] and out["tools"]["finish"] == "stop"
    assert out["chat"] == {"first": True, "second": True, "grew": True}


def test_vercel_ai_sdk_shows_reasoning(node_modules, server) -> None:
    """The AI SDK reads reasoning only from summaries: with ``reasoningSummary: 'auto'`` it shows
    the model's reasoning (hotloop streams it verbatim as the summary; before, the SDK showed an
    empty reasoning part), the JSON answer's reasoning too, and the next turn refers to the
    stored reasoning item by id (its summary is the history a chat backend then gets:
    tests/integration/test_reasoning_summary_backends.py)."""
    r = run_js("ai_sdk.mjs", server)["reasoning"]
    assert r["requested"] == {"summary": "auto"}
    assert r["streamed"] and r["text"] == r["streamed"] and r["answer"] is True
    assert r["itemId"].startswith("rs_") and r["itemId"] in r["referenced"]
    assert r["generated"] and r["finish"] == "stop"
