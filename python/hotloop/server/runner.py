"""Serving: build the app from a config and run it under uvicorn (uvloop, httptools, websockets).

WebSocket serving uses uvicorn's ``websockets-sansio`` implementation with per-message compression
off (deflate costs ~15x on 20 KB frames) and ``ws_max_size`` equal to ``max_body_bytes``. HTTP
uses uvicorn's httptools protocol under the server's connection limit and request read timeout
(:mod:`hotloop.server.httpproto`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import logging.config
import os
import sys
from collections.abc import Iterator
from typing import Any

from hotloop import backends
from hotloop.config import MAX_FLUSH_INTERVAL_MS, MAX_READ_PAUSE_MS, Config
from hotloop.errors import StoreUnavailable
from hotloop.models import ModelLimitsError
from hotloop.pipeline.classifiers import ClassifierLoadError
from hotloop.pipeline.post import Persistence
from hotloop.pipeline.shared import SharedPersistence
from hotloop.server.app import HotloopApp, make_tenancy
from hotloop.server.logs import log_config, startup_error
from hotloop.server.httpproto import BoundedHttpToolsProtocol, HttpReader, Limits
from hotloop.server.wsproto import CorkedWebSocketProtocol
from hotloop.state.fpkey import KeyFileError
from hotloop.state.store import MemoryStore, ResponseStore, SQLiteStore, claim_store
from hotloop.tenants.keys import open_key_store


def make_store(config: Config, serving: bool = True) -> ResponseStore:
    """The store ``config`` names; ``serving``: for a server (an SQLite file it can only read is
    refused), else for a command that only reads it (``hotloop usage``)."""
    if config.store_sync not in ("normal", "full"):
        raise ValueError(f"unknown store sync {config.store_sync!r}; choose 'normal' or 'full'")
    if config.store == "memory":
        return MemoryStore(config.store_max_responses, config.store_ttl_seconds, max_bytes=config.store_max_bytes)
    if config.store == "sqlite":
        return SQLiteStore(
            config.db_path, config.store_max_responses, config.store_ttl_seconds, config.store_sync, config.store_busy_timeout,
            writable=serving,
        )
    if config.store == "redis":
        from hotloop.state.redis_store import RedisStore

        return RedisStore(config.redis_url, config.store_ttl_seconds)
    raise ValueError(f"unknown store {config.store!r}; choose 'sqlite', 'memory' or 'redis'")


def make_app(config: Config) -> HotloopApp:
    if not 0 <= config.flush_interval_ms <= MAX_FLUSH_INTERVAL_MS:  # NaN too
        raise ValueError(f"--flush-interval-ms must be between 0 and {MAX_FLUSH_INTERVAL_MS:g}, got {config.flush_interval_ms:g}")
    if not 0 <= config.backend_read_pause_ms <= MAX_READ_PAUSE_MS:  # NaN too
        raise ValueError(
            f"--backend-read-pause-ms must be between 0 and {MAX_READ_PAUSE_MS:g}, got {config.backend_read_pause_ms:g}"
        )
    if config.backend_read_pause_streams < 1:
        raise ValueError(f"--backend-read-pause-streams must be 1 or more, got {config.backend_read_pause_streams}")
    if not 0 <= config.store_commit_delay < float("inf"):  # NaN too
        raise ValueError(f"--store-commit-delay must be 0 or more seconds, got {config.store_commit_delay:g}")
    if config.max_turn_input_items < 1:
        raise ValueError(f"--max-turn-input-items must be 1 or more, got {config.max_turn_input_items}")
    if config.max_turn_input_bytes < 1:
        raise ValueError(f"--max-turn-input-bytes must be 1 or more, got {config.max_turn_input_bytes}")
    backend = backends.create(config)
    store = make_store(config)
    shared = getattr(store, "shared", False) or config.workers > 1  # other processes write it too
    # the group commit's delay makes a write later visible to the other processes: not when shared
    persistence = (SharedPersistence if shared else Persistence)(
        store, config.max_pending_writes, config.max_pending_write_bytes, config.store_max_lag,
        0.0 if shared else config.store_commit_delay,
    )
    tenancy = make_tenancy(config, open_key_store(config.store, config.db_path, config.redis_url))
    app = HotloopApp(config, backend, persistence, tenancy)
    persistence.evict = app.engine.responses.evict  # responses pruned, or deleted by other processes
    if isinstance(persistence, SharedPersistence):
        persistence.forget = app.engine.responses.clear  # ... while their news could be missed
        persistence.deleted = app.engine.deleted  # deleted by other processes: connections' caches too
    return app


def uvicorn_config(app: Any, config: Config, **extra: Any) -> Any:
    import uvicorn

    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        loop = "asyncio"
    # One Limits per server: its HTTP and WebSocket protocols share the connection count.
    limits = Limits(config.max_connections, config.request_read_timeout)
    if hasattr(app, "limits"):
        app.limits = limits  # (its metrics read the connection count and the refusals)
    protocol = type("HttpProtocol", (BoundedHttpToolsProtocol,), {"limits": limits})
    http = type("HttpReader", (HttpReader,), {"protocol": protocol})
    access_log = config.access_log or config.log_level == "debug"
    ws = type("WebSocketProtocol", (CorkedWebSocketProtocol,), {"limits": limits})
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop=loop,
        http=http,
        ws=ws,
        ws_per_message_deflate=False,
        ws_ping_interval=config.ws_ping_interval,
        ws_ping_timeout=config.ws_ping_timeout,
        ws_max_size=config.max_body_bytes,
        lifespan="on",
        log_level=config.log_level,
        access_log=access_log,
        # X-Forwarded-For/-Proto from a trusted proxy (FORWARDED_ALLOW_IPS) are read for the
        # access log's client address alone (hotloop itself never looks at it): without the log,
        # no middleware layer on every request
        proxy_headers=access_log,
        # SIGTERM/SIGINT: stop accepting, let responses in flight finish within the grace (a WebSocket
        # closes with 1001 once idle: CorkedWebSocketProtocol.shutdown); at its end they fail with
        # server_error (HotloopApp.stopping), and what still runs ABORT_WINDOW later is cancelled;
        # the lifespan shutdown then flushes the store's queue (Persistence.close, bounded).
        timeout_graceful_shutdown=config.shutdown_grace + ABORT_WINDOW,
        log_config=log_config(config.log_level, config.log_format),
        **extra,
    )


STARTUP_FAILURE = 3  # uvicorn's exit code when the application failed to start
# The exit code of a server that stopped, but with responses or ledger records not stored (given
# up at the shutdown bound, or come after the store closed: named in the log); a --workers
# supervisor exits with it when a worker did
WRITES_LOST = 4
ABORT_WINDOW = 2  # seconds after the grace for failed responses' last events to reach their clients


TICK_SECONDS = 1.0  # how often the server's main loop wakes (uvicorn's: 0.1 s)
TICK_COUNTS = 10  # uvicorn's ticks in one of ours (on_tick's counter counts 0.1 s ticks)


def _end_tick(tick: "asyncio.Future[None]") -> None:
    if not tick.done():
        tick.set_result(None)


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, with hotloop's ending: the shutdown grace is announced to the
        application, and a stop asked for by SIGTERM/SIGINT that completed exits 0 (uvicorn would
        re-raise the signal, so the process would end by it)."""

        app: HotloopApp
        grace: float
        ready: int | None = None  # a pipe's write end: one byte once the server serves (--workers)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            # What start-up loaded (modules, the vocabulary, the backend's client) lives as long
            # as the process. Frozen, the cyclic collector no longer walks it in every full
            # collection: about 60,000 objects on the Cerebras backend, a full collection 23 ms
            # of stalled event loop before, 1 ms after (README, Performance). Garbage goes first,
            # so nothing unreachable is frozen. The server process's policy, not the ASGI app's:
            # an application embedded in another process leaves that process's collector alone.
            gc.collect()
            gc.freeze()
            ready, self.ready = self.ready, None
            if ready is not None and self.started:  # started: it listens; tell the supervisor
                with contextlib.suppress(OSError):  # the supervisor is gone: its SIGTERM follows
                    os.write(ready, b"+")
                os.close(ready)

        async def shutdown(self, sockets: Any = None) -> None:
            self.app.stopping(self.grace)
            await super().shutdown(sockets)

        # uvicorn's main loop wakes every 0.1 s to refresh the date header (once a second) and
        # to look at ``should_exit``: ten wake-ups a second of an idle server, each paid cold.
        # This one wakes once a second, and at once when a signal asks the server to stop
        # (``handle_exit`` runs promptly: uvloop runs Python signal handlers as they come).
        _tick: "asyncio.Future[None] | None" = None

        async def main_loop(self) -> None:
            loop = asyncio.get_running_loop()
            self._tick_loop = loop
            counter = 0  # on_tick refreshes the date header when counter % 10 == 0: every tick here
            should_exit = await self.on_tick(counter)
            while not should_exit:
                counter = (counter + TICK_COUNTS) % 864000
                self._tick = tick = loop.create_future()
                timer = loop.call_later(TICK_SECONDS, _end_tick, tick)
                try:
                    await tick
                finally:
                    timer.cancel()
                    self._tick = None
                app = getattr(self, "app", None)  # (None: a server made without serve(), in tests)
                if app is not None and app.metrics is not None:
                    app.metrics.tick()
                should_exit = await self.on_tick(counter)

        def handle_exit(self, sig: int, frame: Any) -> None:
            # A repeated SIGINT (Ctrl-C twice) does not force the exit as uvicorn's would: that
            # skipped the lifespan shutdown, so the store's queue and the usage ledger's buffer
            # were lost while the process still exited 0. The stop is bounded anyway (the grace,
            # ABORT_WINDOW, the store flush's CLOSE_FLUSH_SECONDS); SIGKILL is the forced exit.
            self._captured_signals.append(sig)
            if self.should_exit:
                log = logging.getLogger("hotloop.server")
                log.warning("already stopping (within the shutdown grace and the store flush)")
            self.should_exit = True
            tick = self._tick
            if tick is not None:
                self._tick_loop.call_soon_threadsafe(_end_tick, tick)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    return Server


def serve(config: Config, sock: Any = None, ready: int | None = None) -> int:
    """Run until stopped; the process exit code (0 after a graceful stop, 3 when start-up failed).
    ``sock``: a socket to serve instead of binding ``host:port``, and ``ready``: a file descriptor
    to write one byte to (then closed) once the server has started and listens on it (a worker of
    ``--workers``: :mod:`hotloop.server.workers`)."""
    try:
        config.check()
    except ValueError as exc:
        startup_error(config.log_format, f"start-up failed: {exc}", "hotloop: ")
        return STARTUP_FAILURE
    logging.config.dictConfig(log_config(config.log_level, config.log_format))
    log = logging.getLogger("hotloop.server")
    held: int | None = None  # the store's server lock (claim_store), held until the server ends
    try:
        try:
            if config.store == "sqlite" and config.workers <= 1:  # (a --workers worker: its parent holds it)
                held = claim_store(config.db_path, workers=False)
            app = make_app(config)
        except (ClassifierLoadError, ModelLimitsError, KeyFileError, ValueError, StoreUnavailable) as exc:  # a bad setting, key file or store: say what
            log.error("start-up failed: %s", exc)
            return STARTUP_FAILURE
        except Exception as exc:  # anything else start-up met (a data dir, a script, a store file): one line, exit 3
            log.error("start-up failed: %s: %s", type(exc).__name__, exc)
            log.debug("start-up failure", exc_info=True)
            return STARTUP_FAILURE
        server = _server_class()(uvicorn_config(app, config))
        server.app, server.grace, server.ready = app, config.shutdown_grace, ready
        try:
            server.run(sockets=None if sock is None else [sock])
        except SystemExit as exc:
            # uvicorn exits 3 itself when the application's start-up (lifespan) or the bind failed,
            # which it has logged: returned as such, so that a --workers worker exits 3 too (its
            # supervisor tells a failed start from a crash by that code), not 1 with a traceback
            if exc.code != STARTUP_FAILURE:
                raise
        code = 0 if server.started else STARTUP_FAILURE
        if code == 0 and app.persistence.lost_at_shutdown():
            code = WRITES_LOST
        if app.persistence.stuck or app.stuck:  # a store call that never returned (logged): do not join its thread
            logging.shutdown()
            os._exit(code)
        return code
    finally:
        if held is not None:
            os.close(held)
