"""The ASGI application: lifespan, authentication, statistics, and the two transports.

HTTP (:mod:`hotloop.server.http`) and WebSocket mode (:mod:`hotloop.server.ws`) share this
object: the engine, the persistence layer and the configuration. No protocol decisions are made
here: requests are decoded by :mod:`hotloop.protocol.request`, events come from
:mod:`hotloop.protocol.turn` via the :class:`~hotloop.server.engine.Engine`, and WebSocket frames
go through the sans-I/O :class:`~hotloop.protocol.session.Session`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from hotloop import errors, tokenizer
from hotloop.backends.base import Backend
from hotloop.config import Config
from hotloop.pipeline.post import Persistence
from hotloop.server.common import Receive, Scope, Send
from hotloop.server.engine import Engine
from hotloop.server.http import HttpTransport
from hotloop.server.ws import Deadlines, serve_websocket

log = logging.getLogger("hotloop.server")


class HotloopApp:
    """ASGI 3 application. Create with a config, a backend and a persistence layer."""

    def __init__(self, config: Config, backend: Backend, persistence: Persistence) -> None:
        self.config = config
        self.backend = backend
        self.persistence = persistence
        self.engine = Engine(config, backend, persistence)
        self.started_at = time.time()
        self._api_key = config.api_key.encode() if config.api_key else None
        self.ws_deadlines = Deadlines(config.ws_connection_max_age)
        self.http = HttpTransport(self)

    # -- ASGI entry ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except (RuntimeError, ValueError, OSError) as exc:
                    # configuration problems (a missing API key, a bad URL): say what, no traceback
                    log.error("start-up failed: %s", exc)
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                except Exception:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": "start-up failed (see log)"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, tokenizer.preload)
        await self.backend.start()
        self.persistence.start()

    async def shutdown(self) -> None:
        self.engine.close()
        await self.backend.close()
        await self.persistence.close()

    def stats(self) -> dict[str, Any]:
        """Server-side counters and the per-response CPU ring (see ``Engine.turn_stats``)."""
        eng = self.engine
        return {
            "active_responses": eng.active,
            "completed_responses": eng.completed,
            "token_cache": {"entries": len(eng.tokens), "hits": eng.tokens.hits, "misses": eng.tokens.misses},
            "response_cache": {
                "entries": len(eng.responses), "items": eng.responses.items, "bytes": eng.responses.nbytes,
                "max_bytes": eng.responses.max_bytes,
            },
            "store": {"pending": len(self.persistence.pending), "written": self.persistence.written, "failed": self.persistence.failed},
            "turns": [
                {"transport": t, "cpu_us": round(c, 1), "pre_us": round(p, 1), "events": e, "context_items": n}
                for t, c, p, e, n in eng.turn_stats
            ],
        }

    # -- auth ----------------------------------------------------------------------------------

    def _check_auth(self, scope: Scope) -> None:
        if self._api_key is None:
            return
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._api_key):
                    return
                break
        raise errors.AuthenticationFailed("Incorrect API key provided.")

    # -- transports ----------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.http(scope, receive, send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_websocket(self, scope, receive, send)
