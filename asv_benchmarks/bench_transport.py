"""The chat backends' HTTP transports: client CPU of one streaming request, lean against the SDK.

The paced mock (:mod:`hotloop.bench.mockchat`) runs unpaced in its own process; each benchmark
sends one streaming chat-completions request and reads it to the end, on uvloop, through:

* ``lean``: :class:`hotloop.backends.chat.http1.Pool` (keep-alive HTTP/1.1, httptools);
* ``sdk``: cerebras-cloud-sdk's ``AsyncCerebras.post(..., stream=True)`` over httpx, as hotloop's
  ``--backend-transport sdk`` does.

``tokens`` = 1 gives the per-request cost, 200 the per-request cost plus 199 chunks: the per-chunk
cost is the difference over 199. Timed with ``process_time`` (this process's CPU: the mock's work
is not counted). Setup checks that each transport reads the whole stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

BODY = b'{"model": "bench-0-%d", "messages": [{"role": "user", "content": "hi"}], "stream": true}'


class Transport:
    params = (["lean", "sdk"], [1, 200])
    param_names = ["transport", "tokens"]
    timer = time.process_time
    number = 20
    repeat = (3, 10, 20.0)

    def setup(self, transport: str, tokens: int) -> None:
        import uvloop

        from hotloop.bench import mock_process

        self._mock = contextlib.ExitStack()
        url, _pid = self._mock.enter_context(mock_process())
        self.loop = uvloop.new_event_loop()
        self.body = BODY % tokens
        if transport == "lean":
            from hotloop.backends.chat.http1 import Pool

            pool = Pool(url, headers={"content-type": "application/json", "accept": "text/event-stream"})
            self.client: Any = pool

            async def once() -> bytes:
                resp = await pool.stream("POST", "/v1/chat/completions", self.body)
                out = b"".join([data async for data in resp])
                await resp.aclose()
                return out

        else:
            import httpx
            from cerebras.cloud.sdk import AsyncCerebras

            client = AsyncCerebras(api_key="bench", base_url=url, max_retries=0, warm_tcp_connection=False)
            self.client = client

            async def once() -> bytes:
                resp = await client.post(
                    "/v1/chat/completions", cast_to=httpx.Response, content=self.body,
                    options={"headers": {"Accept": "text/event-stream"}}, stream=True,
                )
                out = b"".join([data async for data in resp.aiter_bytes()])
                await resp.aclose()
                return out

        self.once = once
        body = self.loop.run_until_complete(once())
        chunks = body.count(b"data: {")
        if not body.endswith(b"data: [DONE]\n\n") or chunks != tokens + 3:
            raise AssertionError(f"{transport}: read {chunks} chunks, expected {tokens + 3}")

    def teardown(self, transport: str, tokens: int) -> None:
        close = self.client.aclose if transport == "lean" else self.client.close
        self.loop.run_until_complete(close())
        self.loop.close()
        self._mock.close()

    def time_streaming_request(self, transport: str, tokens: int) -> None:
        self.loop.run_until_complete(self.once())


os.environ.setdefault("CEREBRAS_API_KEY", "bench")
