"""Golden transcripts: a request in, the exact bytes on the wire out (SSE and WebSocket).

Each case runs the real engine in-process (simulator backend, memory store) with sequential ids
and a fixed clock, so the output is byte-for-byte reproducible. ``regenerate.py`` writes the
files; ``test_golden.py`` checks them. Regenerate only on purpose, and review the diff.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from hotloop import errors
from hotloop.config import Config
from hotloop.pipeline.post import Persistence
from hotloop.protocol import events as ev
from hotloop.protocol.objects import IdGen
from hotloop.protocol.request import decode_body
from hotloop.server.runner import make_app
from hotloop.state.context import ConnectionCache

HERE = Path(__file__).parent
CLOCK = 1_700_000_000.0

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}


def _body(sim: str | None = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "hotloop-sim", "input": "Hello there", **kw}
    if sim is not None:
        body["metadata"] = {"sim": sim}
    return body


# name -> request body; every case is rendered for both transports
CASES: dict[str, dict[str, Any]] = {
    "text": _body("text,tokens:6"),
    "function_call": _body(tools=[WEATHER]),
    "parallel_calls": _body("tools:2", tools=[WEATHER, TIME]),
    "text_then_call": _body("text+tool,tokens:4", tools=[WEATHER]),
    "reasoning_then_text": _body("reasoning,tokens:6"),
    # reasoning.summary set: the reasoning streamed as the item's summary (verbatim: protocol.turn)
    "reasoning_summary_then_text": _body("reasoning,tokens:6", reasoning={"summary": "auto"}),
    "incomplete": _body("tokens:10", max_output_tokens=4),
    "model_failure": _body("fail:server_error,tokens:6"),
    "backend_error": _body("error,tokens:6"),
    "warmup": _body(generate=False),
    "rejected_previous_response": _body(previous_response_id="resp_missing"),
    "rejected_rate_limit": _body("rate_limit"),
}


async def _render(name: str, body: dict[str, Any], transport: str) -> bytes:
    cfg = Config(store="memory", sim_rate=0)
    app = make_app(cfg)
    await app.startup()
    try:
        eng = app.engine
        eng.ids = IdGen(deterministic=True)
        eng.clock = lambda: CLOCK
        req = decode_body(json.dumps(body))
        out: list[bytes] = []
        try:
            run = await eng.start(req, transport=transport, conn=ConnectionCache() if transport == "ws" else None,
                                  websocket=transport == "ws")
        except errors.HotloopError as exc:
            if transport == "ws":
                return ev.ws_error(exc)[1] + b"\n"
            return f"HTTP {exc.status}\n".encode() + ev.http_error_body(exc) + b"\n"
        async for batch in run.frames():
            for frame in batch:
                out.append(ev.sse(frame) if transport == "sse" else frame[1] + b"\n")
        return b"".join(out)
    finally:
        await app.shutdown()


def render(name: str, transport: str) -> bytes:
    return asyncio.run(_render(name, CASES[name], transport))


def path(name: str, transport: str) -> Path:
    return HERE / "data" / f"{name}.{transport}.txt"
