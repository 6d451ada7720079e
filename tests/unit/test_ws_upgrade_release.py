"""A connection that became a WebSocket lets its HTTP protocol go (``httpproto._release``).

uvloop's transport keeps the ``get_buffer``/``buffer_updated`` of the buffered protocol it
served when it is switched to a plain one, so without the release the HTTP protocol, its
parser, the handshake's headers and its flow control lived as long as the WebSocket (about
5 KB of an idle connection's 14). Checked on a real uvloop server with hotloop's protocol
classes and a real websockets client."""

from __future__ import annotations

import asyncio
import gc
import json
import socket

import uvicorn
import uvloop
from websockets.asyncio.client import connect

from hotloop.config import Config
from hotloop.server.httpproto import BoundedHttpToolsProtocol
from hotloop.server.runner import make_app, uvicorn_config


def _http_protocols() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, BoundedHttpToolsProtocol))


def test_a_websocket_connection_holds_no_http_protocol() -> None:
    async def main() -> tuple[int, int, str]:
        config = Config(store="memory", sim_rate=0, log_level="warning")
        app = make_app(config)
        server = uvicorn.Server(uvicorn_config(app, config))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        try:
            for _ in range(500):
                if server.started:
                    break
                await asyncio.sleep(0.01)
            assert server.started
            before = _http_protocols()
            async with connect(f"ws://127.0.0.1:{port}/v1/responses", open_timeout=10) as ws, connect(
                f"ws://127.0.0.1:{port}/v1/responses", open_timeout=10
            ) as ws2:
                held = _http_protocols() - before
                # both connections still work after their HTTP protocols went
                for w in (ws, ws2):
                    await w.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi", "store": False}))
                    while True:
                        event = json.loads(await asyncio.wait_for(w.recv(), 10))
                        if event["type"] in ("response.completed", "error"):
                            break
                return before, held, event["type"]
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 30)

    before, held, last = uvloop.run(main())
    assert last == "response.completed"
    assert held == 0, f"{held} HTTP protocols held by 2 open WebSocket connections"
