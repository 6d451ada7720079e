"""In-process ASGI races that real sockets hit only rarely, made deterministic here."""

from __future__ import annotations

import asyncio
import json
import time

import uvloop

from hotloop.config import Config
from hotloop.server.runner import make_app


async def _client_leaving_after_completed(app, i: int) -> str | None:
    body = json.dumps({"model": "hotloop-sim", "input": f"hi {i}", "stream": True, "metadata": {"sim": "tokens:3"}}).encode()
    completed = asyncio.Event()
    sent = False
    rid = None

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await completed.wait()
        return {"type": "http.disconnect"}  # the client leaves as soon as it has the terminal event

    async def send(msg: dict) -> None:
        nonlocal rid
        for line in msg.get("body", b"").split(b"\n"):
            if line.startswith(b"data: ") and b'"response.completed"' in line:
                rid = json.loads(line[6:])["response"]["id"]
                completed.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/responses", "headers": [], "query_string": b""}
    await app(scope, receive, send)
    return rid


def test_responses_are_stored_even_if_the_client_leaves_after_the_terminal_event() -> None:
    async def main() -> tuple[list, list, int]:
        app = make_app(Config(store="memory", sim_rate=0, max_pending_writes=1))
        await app.startup()
        put = app.persistence.store.put
        app.persistence.store.put = lambda rec: (time.sleep(0.02), put(rec))[1]  # a slow disk
        try:
            ids = await asyncio.gather(*(_client_leaving_after_completed(app, i) for i in range(8)))
            await app.persistence.flush()
            stored = [app.persistence.store.get(r) for r in ids if r]
            return ids, stored, len(app.persistence.pending)
        finally:
            await app.shutdown()

    ids, stored, pending = uvloop.run(main())
    assert all(ids) and len(stored) == 8 and all(s is not None for s in stored)
    assert pending == 0
