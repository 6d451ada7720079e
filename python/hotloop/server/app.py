"""The ASGI application: lifespan, authentication, statistics, and the two transports.

HTTP (:mod:`hotloop.server.http`) and WebSocket mode (:mod:`hotloop.server.ws`) share this
object: the engine, the persistence layer and the configuration. No protocol decisions are made
here: requests are decoded by :mod:`hotloop.protocol.request`, events come from
:mod:`hotloop.protocol.turn` via the :class:`~hotloop.server.engine.Engine`, and WebSocket frames
go through the sans-I/O :class:`~hotloop.protocol.session.Session`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import Any

from hotloop import _accel, errors, tokenizer
from hotloop.backends.base import Backend
from hotloop.config import Config
from hotloop.protocol import events as ev
from hotloop.pipeline import post
from hotloop.pipeline.post import Persistence
from hotloop.server.common import Receive, Scope, Send
from hotloop.server.engine import Engine
from hotloop.server.http import HttpTransport
from hotloop.server.logs import log_response
from hotloop.server.metrics import Metrics
from hotloop.server.ws import Deadlines, serve_websocket
from hotloop.tenants import Limiter, MemoryLimiter, Tenancy
from hotloop.tenants.keys import KeyStore, MemoryKeyStore

log = logging.getLogger("hotloop.server")

# Seconds the key store's close gets at shutdown even when the response store's shutdown used the
# whole bound (post.CLOSE_FLUSH_SECONDS); workers.KILL_MARGIN covers it
KEYS_CLOSE_FLOOR = 1.0


class HotloopApp:
    """ASGI 3 application. Create with a config, a backend and a persistence layer."""

    def __init__(
        self, config: Config, backend: Backend, persistence: Persistence, tenancy: Tenancy | None = None
    ) -> None:
        self.config = config
        self.backend = backend
        self.persistence = persistence
        # keys, limits and ownership (hotloop.tenants); without a key store: the admin key or open mode
        self.tenancy = tenancy if tenancy is not None else make_tenancy(config, MemoryKeyStore())
        self.engine = Engine(config, backend, persistence, self.tenancy)
        self.started_at = time.time()
        self._abort_timer: asyncio.TimerHandle | None = None  # the end of the shutdown grace
        self.stuck = False  # shutdown() gave up on the key store's close: its thread is not joined
        self.ws_deadlines = Deadlines(config.ws_connection_max_age)
        self.http = HttpTransport(self)
        # requests being served by transport: HTTP requests, SSE streams (an HTTP request streaming
        # counts as sse, not http), WebSocket connections
        self.open_connections: dict[str, int] = {"http": 0, "sse": 0, "websocket": 0}
        # WebSocket connections open per tenant's key id (ws._count_connection; at most one entry
        # per key with a connection open)
        self.ws_per_key: dict[str, int] = {}
        # the server's connection count and refusals (hotloop.server.httpproto.Limits), set by the
        # uvicorn configuration that serves it (runner.uvicorn_config)
        self.limits: Any = None
        self.metrics: Metrics | None = None
        self._models_task: asyncio.Task[None] | None = None
        if config.metrics:
            self.metrics = Metrics(self, per_key=config.metrics_per_key)
            self.engine.observers.append(self.metrics.turn)
            self.engine.on_charged = self.metrics.charged
        if config.log_format == "json":
            self.engine.observers.append(log_response)

    # -- ASGI entry ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http" or kind == "websocket":
            conns = self.open_connections
            conns[kind] += 1
            try:
                # each coroutine in a request's chain is resumed at its every wake-up: no
                # pass-through layers here
                if kind == "http":
                    await self.http(scope, receive, send)
                else:
                    await serve_websocket(self, scope, receive, send)
            except asyncio.CancelledError:
                if not self.engine.stopping:
                    raise
                # The end of the stop: uvicorn cancels what still runs ABORT_WINDOW after the
                # grace (a client that stopped reading, a request whose body never came). By
                # design: one line, no traceback; a request not answered yet gets the shutdown 503.
                log.info("%s connection still busy at the end of the shutdown grace: closed", kind)
                if kind == "http":
                    await self._refuse_at_stop(send)
            finally:
                conns[kind] -= 1
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    @staticmethod
    async def _refuse_at_stop(send: Send) -> None:
        """The shutdown 503 (OpenAI error object) on an HTTP request not answered yet; nothing
        when its response has started (uvicorn refuses a second start) or its client is gone."""
        exc = errors.ServerShuttingDown("The server is shutting down; send the request again on a new connection.")
        body = ev.http_error_body(exc)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), (b"connection", b"close")]
        try:
            async with asyncio.timeout(0.5):
                await send({"type": "http.response.start", "status": exc.status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
        except Exception:  # started already, or the client does not read
            pass

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
        tokenizer.claim()  # this thread counts most inputs: before the backend's start counts any
        await self.backend.start()
        if self.metrics is not None:
            # the model label's values: the models the backend lists (others are "other"),
            # learnt in the background (a slow backend does not delay the start)
            self._models_task = loop.create_task(self._learn_models(self.metrics))
        self.persistence.start()
        self.tenancy.start(self.config.host)

    async def _learn_models(self, metrics: Metrics) -> None:
        try:
            metrics.set_models(str(m["id"]) for m in await self.backend.list_models())
        except Exception:
            log.warning("could not list the backend's models for the metrics' model label")

    def stopping(self, grace: float) -> None:
        """The server has stopped accepting (SIGTERM/SIGINT): responses in flight have ``grace``
        seconds to finish, then they end with ``response.failed`` (``server_error``)."""
        self.engine.stopping = True  # a request arriving on a connection still open is refused (503)
        if self._abort_timer is None:
            self._abort_timer = asyncio.get_running_loop().call_later(grace, self._abort_in_flight)

    def _abort_in_flight(self) -> None:
        n = self.engine.abort_all(errors.ServerShuttingDown())
        if n:
            log.warning("shutdown grace over: %d response(s) in flight end with server_error", n)

    async def shutdown(self) -> None:
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        task = self._models_task
        if task is not None and not task.done():
            task.cancel()
        self.engine.close()
        await self.backend.close()
        # The store's shutdown: the write queue and the store's close, then the key store's
        # (last uses, its close, the limiter's), in that order and within one deadline,
        # CLOSE_FLUSH_SECONDS (read here, so that a test may shorten it), which is what a
        # --workers worker is given for it before it is killed (workers.kill_after).
        loop = asyncio.get_running_loop()
        timeout = post.CLOSE_FLUSH_SECONDS
        deadline = loop.time() + timeout
        await self.persistence.close(timeout)
        if self.metrics is not None:
            self.metrics.tick()  # (--workers: what the stop stored, or lost, counted in the files)
        closing = loop.create_task(self.tenancy.close())
        # at least KEYS_CLOSE_FLOOR: a flush that used the whole bound leaves the key store's
        # close (a millisecond when its store answers) its own short chance, within KILL_MARGIN
        done, _ = await asyncio.wait({closing}, timeout=max(KEYS_CLOSE_FLOOR, deadline - loop.time()))
        if done:
            closing.result()
            return
        closing.cancel()  # a key store that hangs (Redis not answering): its thread is not joined
        self.stuck = True
        log.error(
            "closing the key store at shutdown did not finish within the shutdown bound (%g s): left to the process's exit",
            timeout,
        )

    def stats(self, full: bool = True) -> dict[str, Any]:
        """Server-side counters and the per-response CPU ring (see ``Engine.turn_stats``).
        ``full`` false: a tenant's key's view (``Tenancy.operator`` says who gets which), counts
        only: no per-response figures, no cache sizes or hits."""
        eng = self.engine
        counts: dict[str, Any] = {
            "pid": os.getpid(),  # which process answered (one of --workers)
            # the operators' (the admin key, open mode); "key": a tenant's key's
            "view": "all" if full else "key",
            "active_responses": eng.active,
            "completed_responses": eng.completed,
            # responses (pending, written, failed: as hotloop_store_written/_failed) and usage ledger
            # records (as hotloop_store_usage_written/_usage_failed): one unit per pair
            "store": {
                "pending": len(self.persistence.pending), "written": self.persistence.written, "failed": self.persistence.failed,
                "usage_written": self.persistence.usage_written, "usage_failed": self.persistence.usage_failed,
            },
            # the cyclic collector: objects frozen at start-up, and per generation its collections
            "gc": {"frozen": gc.get_freeze_count(), "collections": [g["collections"] for g in gc.get_stats()]},
            # the compiled modules run (False: the pure-Python twins, e.g. the pure-Python wheel)
            "native": _accel.NATIVE,
        }
        if not full:
            return counts
        return {
            **counts,
            "token_cache": {"entries": len(eng.tokens), "hits": eng.tokens.hits, "misses": eng.tokens.misses},
            "response_cache": {
                "entries": len(eng.responses), "items": eng.responses.items, "bytes": eng.responses.nbytes,
                "max_bytes": eng.responses.max_bytes,
            },
            "prefix_cache": {
                "entries": len(eng.prefixes), "with_bytes": eng.prefixes.with_bytes(),
                "bytes": eng.prefixes.nbytes, "max_bytes": eng.prefixes.max_bytes,
                "hits": eng.prefixes.hits, "raw_hits": eng.prefixes.raw_hits,
                "body_hits": eng.prefixes.body_hits, "misses": eng.prefixes.misses,
            },
            "ws_connection_caches": {
                "entries": len(eng.conn_cache_budget), "bytes": eng.conn_cache_budget.nbytes,
                "max_bytes": eng.conn_cache_budget.max_bytes,
            },
            "tools_cache": {"entries": len(eng.tools), "bytes": eng.tools.nbytes, "hits": eng.tools.hits, "misses": eng.tools.misses},
            "turns": [
                {"transport": t, "cpu_us": round(c, 1), "pre_us": round(p, 1), "events": e, "context_items": n}
                for t, c, p, e, n in eng.turn_stats
            ],
        }

    def ws_queued(self) -> int:
        """response.create frames accepted on WebSocket connections and not yet finished."""
        return sum(c.session.queued for c in self.ws_deadlines.connections() if c.session is not None)


def make_tenancy(config: Config, keys: KeyStore) -> Tenancy:
    limiter: Limiter = MemoryLimiter(config.limit_max_keys)
    if config.store == "redis":  # limits shared by every replica
        from hotloop.tenants.redis_limits import RedisLimiter

        limiter = RedisLimiter(config.redis_url, max_keys=config.limit_max_keys)
    elif config.store == "sqlite" and config.workers > 1:  # shared by the workers through a file of their own
        from hotloop.tenants.sqlite_limits import SQLiteLimiter, limits_path

        limiter = SQLiteLimiter(limits_path(config.db_path), max_keys=config.limit_max_keys)
    return Tenancy(keys, config.api_key, limiter, output_reserve=config.limit_output_reserve)
