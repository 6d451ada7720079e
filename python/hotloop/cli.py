"""The ``hotloop`` command: ``hotloop serve`` runs the server; ``hotloop keys`` and ``hotloop usage``
manage API keys and read the usage ledger; ``hotloop --version``."""

from __future__ import annotations

import argparse
import os
import sys

from hotloop import __version__
from hotloop.config import Config
from hotloop.tenants import cli as tenants_cli


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hotloop", description="OpenAI Responses API server for agent loops.")
    p.add_argument("--version", action="version", version=f"hotloop {__version__}")
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="run the server (defaults: simulator backend, SQLite store, 127.0.0.1:8000)")
    s.add_argument("--host", help="bind address (env HOTLOOP_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (env HOTLOOP_PORT, default 8000)")
    s.add_argument("--backend", choices=["simulator", "cerebras", "openai-compat"], help="model backend (env HOTLOOP_BACKEND)")
    s.add_argument(
        "--backend-transport",
        dest="backend_transport",
        choices=["lean", "sdk"],
        help="HTTP client for chat backends: lean (keep-alive HTTP/1.1 on asyncio) or sdk (cerebras-cloud-sdk / httpx); "
        "env HOTLOOP_BACKEND_TRANSPORT, default lean",
    )
    s.add_argument(
        "--think-tags",
        dest="think_tags",
        choices=["auto", "off", "open"],
        help="auto: a <think> block at the start of a chat backend's content (Qwen3, DeepSeek-R1 on servers that do "
        "not split reasoning out) is streamed as reasoning, the rest as text; open: the model's chat template opens "
        "the block (DeepSeek-R1-0528, Qwen3 thinking-2507), so the content is reasoning up to its first </think>; "
        "off: the content is text as it comes (env HOTLOOP_THINK_TAGS, default auto)",
    )
    s.add_argument("--model", help="default model id (env HOTLOOP_MODEL)")
    s.add_argument("--base-url", dest="base_url", help="backend base URL (env HOTLOOP_BASE_URL)")
    s.add_argument(
        "--model-limits",
        dest="model_limits",
        metavar="FILE",
        help="JSON file of per-model limits, {model: {context_window, max_output_tokens, tokenizer}}, "
        "over the bundled table and what the backend reports (env HOTLOOP_MODEL_LIMITS)",
    )
    s.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"], help="env HOTLOOP_LOG_LEVEL")
    s.add_argument(
        "--log-format", dest="log_format", choices=["text", "json"],
        help="json: one object per line, a line per response, uvicorn's logs too (env HOTLOOP_LOG_FORMAT, default text)",
    )
    s.add_argument(
        "--access-log", dest="access_log", action="store_const", const=True,
        help="log a line per HTTP request and WebSocket connection (uvicorn's access log; on with --log-level debug; "
        "env HOTLOOP_ACCESS_LOG=1)",
    )
    s.add_argument(
        "--no-metrics", dest="metrics", action="store_const", const=False,
        help="record no metrics and serve no /metrics (env HOTLOOP_METRICS=0)",
    )
    s.add_argument(
        "--metrics-public", dest="metrics_public", action="store_const", const=True,
        help="serve /metrics without an API key (env HOTLOOP_METRICS_PUBLIC=1)",
    )
    s.add_argument(
        "--metrics-per-key", dest="metrics_per_key", action="store_const", const=True,
        help="label per-response metrics with the key's name (env HOTLOOP_METRICS_PER_KEY=1)",
    )
    s.add_argument(
        "--api-key", dest="api_key",
        help="the admin key: a bearer token that may read and delete every tenant's responses (env HOTLOOP_API_KEY); "
        "per-client keys: hotloop keys create",
    )
    s.add_argument(
        "--store", choices=["sqlite", "memory", "redis"],
        help="response store; redis: shared by replicas (env HOTLOOP_STORE, default sqlite)",
    )
    s.add_argument(
        "--redis-url", dest="redis_url",
        help="redis://HOST:PORT/DB for --store redis (env HOTLOOP_REDIS_URL, default redis://127.0.0.1:6379/0)",
    )
    s.add_argument(
        "--workers", type=int,
        help="server processes sharing the port, restarted if they die (env HOTLOOP_WORKERS, default 1)",
    )
    s.add_argument(
        "--worker-start-timeout",
        dest="worker_start_timeout",
        type=float,
        help="seconds a --workers worker may take to start listening; then it is stopped (SIGTERM, SIGKILL 5 s "
        "later) and replaced after the slot's back-off (env HOTLOOP_WORKER_START_TIMEOUT, default 60)",
    )
    s.add_argument(
        "--store-sync",
        dest="store_sync",
        choices=["normal", "full"],
        help="normal: stored responses are written off the critical path, durable within --store-max-lag of their "
        "terminal event (README, Crash safety); full: written and synced before the terminal event is sent, "
        "nothing completed is ever lost (env HOTLOOP_STORE_SYNC, default normal)",
    )
    s.add_argument(
        "--store-max-lag",
        dest="store_max_lag",
        type=float,
        help="seconds the oldest queued store write may wait before finished turns wait for the writer: the bound "
        "on what a crash can lose with --store-sync normal (env HOTLOOP_STORE_MAX_LAG, default 0.2)",
    )
    s.add_argument(
        "--store-commit-delay",
        dest="store_commit_delay",
        type=float,
        help="seconds the SQLite writer waits after a finished turn for others to join its transaction (group "
        "commit; at most half of --store-max-lag; 0: write at once; not with --workers) "
        "(env HOTLOOP_STORE_COMMIT_DELAY, default 0.1)",
    )
    s.add_argument(
        "--store-busy-timeout",
        dest="store_busy_timeout",
        type=float,
        help="seconds a write to the SQLite response store waits for another connection's write lock (another worker, "
        "hotloop keys, a backup) before the writer retries it, or a DELETE or usage listing answers 503; more than 0, "
        "at most 30 (env HOTLOOP_STORE_BUSY_TIMEOUT, default 5)",
    )
    s.add_argument("--data-dir", dest="data_dir", help="where the SQLite store lives (env HOTLOOP_DATA_DIR)")
    s.add_argument(
        "--max-connections",
        dest="max_connections",
        type=int,
        help="open client connections, HTTP and WebSocket; beyond it 503 (env HOTLOOP_MAX_CONNECTIONS, default 10000)",
    )
    s.add_argument(
        "--request-read-timeout",
        dest="request_read_timeout",
        type=float,
        help="seconds for a request's head and body to arrive, then 408 and close (env HOTLOOP_REQUEST_READ_TIMEOUT, default 30)",
    )
    s.add_argument(
        "--ws-ping-interval",
        dest="ws_ping_interval",
        type=float,
        help="seconds between the WebSocket pings the server sends (env HOTLOOP_WS_PING_INTERVAL, default 20)",
    )
    s.add_argument(
        "--ws-ping-timeout",
        dest="ws_ping_timeout",
        type=float,
        help="seconds a WebSocket client has to answer a ping before it is disconnected, its responses cancelled "
        "(env HOTLOOP_WS_PING_TIMEOUT, default 20)",
    )
    s.add_argument(
        "--flush-interval-ms",
        dest="flush_interval_ms",
        type=float,
        help="milliseconds a pushed delta (lean transport) may wait so that several backend reads go out to the client in one "
        "write (WebSocket and SSE; 0 to 1000); fewer writes, less server CPU per event "
        "(env HOTLOOP_FLUSH_INTERVAL_MS, default 10; 0: every read's deltas are written at once)",
    )
    s.add_argument(
        "--backend-read-pause-ms",
        dest="backend_read_pause_ms",
        type=float,
        help="milliseconds the lean transport stops reading a backend connection after a read that a streaming response "
        "took whole, while it serves --backend-read-pause-streams responses or more, so that the chunks sent meanwhile are "
        "handled in one go: less server CPU per chunk, each chunk (the response's end too) up to that much later "
        "(0 to 100; env HOTLOOP_BACKEND_READ_PAUSE_MS, default 10; 0: never)",
    )
    s.add_argument(
        "--backend-read-pause-streams",
        dest="backend_read_pause_streams",
        type=int,
        help="responses streaming from one backend at once from which read pauses apply (env "
        "HOTLOOP_BACKEND_READ_PAUSE_STREAMS, default 16; 1: always)",
    )
    s.add_argument(
        "--shutdown-grace",
        dest="shutdown_grace",
        type=int,
        help="seconds responses in flight may take to finish after SIGTERM/SIGINT, then they fail with server_error "
        "(env HOTLOOP_SHUTDOWN_GRACE, default 30)",
    )
    s.add_argument(
        "--max-turn-input-items",
        dest="max_turn_input_items",
        type=int,
        help="new input items one turn may add (after previous_response_id or a cached prefix); more: 400 "
        "input_too_large (env HOTLOOP_MAX_TURN_INPUT_ITEMS, default 10000)",
    )
    s.add_argument(
        "--max-turn-input-bytes",
        dest="max_turn_input_bytes",
        type=int,
        help="bytes (their JSON) of the new input items one turn may add; more: 400 input_too_large "
        "(env HOTLOOP_MAX_TURN_INPUT_BYTES, default 8388608: 8 MiB)",
    )
    s.add_argument(
        "--secrets",
        choices=["off", "flag", "redact", "block"],
        help="what the built-in secrets classifier does with credentials in new input: off, flag (ledger and log "
        "only), redact ([REDACTED:<kind>]) or block (400 secret_detected); env HOTLOOP_SECRETS, default flag",
    )
    s.add_argument(
        "--classifier",
        dest="classifiers",
        action="append",
        metavar="MODULE:ATTR",
        help="load a classifier (an instance or a zero-argument factory); repeatable; "
        "env HOTLOOP_CLASSIFIERS (comma-separated)",
    )
    s.add_argument("--sim-rate", dest="sim_rate", type=float, help="simulator tokens/s (default 1000; 0 = unpaced)")
    s.add_argument("--sim-ttft", dest="sim_ttft", type=float, help="simulator time to first token, seconds")
    s.add_argument("--sim-output-tokens", dest="sim_output_tokens", type=int, help="simulator answer length")
    s.add_argument("--sim-seed", dest="sim_seed", type=int, help="simulator seed")
    s.add_argument("--sim-script", dest="sim_script", help="simulator scenario file (JSON)")
    b = sub.add_parser("bench", help="agent-loop benchmarks against a server it starts (see hotloop bench -h)", add_help=False)
    b.add_argument("args", nargs=argparse.REMAINDER)
    tenants_cli.add_commands(sub)  # keys create|list|revoke|rotate, usage
    return p


def _bench(argv: list[str]) -> int:
    from hotloop.bench import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser, options first included (argparse.REMAINDER leaves `bench -h` out)
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    if args.command == "bench":  # an argv that names it later (after "--")
        return _bench(args.args)
    if args.command in ("keys", "usage"):
        try:  # a HOTLOOP_* value of the wrong type (the environment serve reads), no usable store: as argparse says it
            Config.from_env(store=args.store, data_dir=args.data_dir, redis_url=args.redis_url).check_store()
        except ValueError as exc:
            print(f"hotloop {args.command}: error: {exc}", file=sys.stderr)
            return 2
        return tenants_cli.run(args)
    if args.command == "serve":
        overrides = {k: v for k, v in vars(args).items() if k != "command"}
        if overrides.get("classifiers") is not None:
            overrides["classifiers"] = ",".join(overrides["classifiers"])
        try:
            config = Config.from_env(**overrides)
        except ValueError as exc:  # a HOTLOOP_* value of the wrong type: said as argparse says a flag's
            from hotloop.server.logs import startup_error

            fmt = args.log_format or os.environ.get("HOTLOOP_LOG_FORMAT", "")
            startup_error(fmt, f"error: {exc}", "hotloop serve: ")
            return 2
        if config.workers > 1:
            from hotloop.server.workers import serve_workers  # before prometheus-client is imported

            return serve_workers(config)
        from hotloop.server.runner import serve

        return serve(config)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
