"""An SSE stream whose frames fail after its head went out: the stream ends as a failed response
does (the error event, ``response.failed``), the failure is logged once, and no second response
head is attempted (it would be the ASGI server's own error, with a traceback, on top of the
first)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncGenerator

import httpx
import pytest

from hotloop import errors
from hotloop.config import Config
from hotloop.server import engine as engine_mod
from hotloop.server.runner import make_app


@pytest.mark.parametrize("failure", [RuntimeError("boom"), errors.ServerError("lost")], ids=["bug", "hotloop-error"])
def test_frames_failing_after_the_head_end_the_stream(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failure: Exception
) -> None:
    original = engine_mod.Run.frames

    def failing(self: Any) -> AsyncGenerator[list[Any], None]:
        async def gen() -> AsyncGenerator[list[Any], None]:
            async for batch in original(self):
                yield batch  # response.created and what came with it
                raise failure

        return gen()

    monkeypatch.setattr(engine_mod.Run, "frames", failing)
    starts: list[int] = []

    async def main() -> bytes:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        try:

            async def asgi(scope: Any, receive: Any, send: Any) -> None:
                async def tracked(message: dict[str, Any]) -> None:
                    if message["type"] == "http.response.start":
                        starts.append(message["status"])
                    await send(message)

                await app(scope, receive, tracked)

            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t") as client:
                body = {"model": "hotloop-sim", "input": "hi", "stream": True, "metadata": {"sim": "tokens:3"}}
                r = await client.post("/v1/responses", json=body)
                return r.content
        finally:
            await app.shutdown()

    with caplog.at_level(logging.INFO, logger="hotloop"):
        content = asyncio.run(main())
    assert starts == [200]
    assert content.startswith(b"event: response.created")
    # the stream ends as a failed response does: the error event, then response.failed
    events = [line[7:] for line in content.decode().splitlines() if line.startswith("event: ")]
    assert events[-2:] == ["error", "response.failed"], events
    numbers = [json.loads(line[6:])["sequence_number"] for line in content.decode().splitlines() if line.startswith("data: ")]
    assert numbers == list(range(len(numbers)))
    ended = [r for r in caplog.records if "ended early" in r.getMessage()]
    assert len(ended) == 1
    assert ("boom" in caplog.text) == isinstance(failure, RuntimeError)  # a bug's traceback is logged
