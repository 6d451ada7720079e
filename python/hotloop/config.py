"""Server configuration: defaults, environment variables (``HOTLOOP_*``) and CLI flags.

Precedence: CLI flag > environment variable > default. Every bound that protects the server is
here, with its default, so the README's table can be checked against one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "hotloop")


MAX_FLUSH_INTERVAL_MS = 1000.0  # the largest --flush-interval-ms
MAX_READ_PAUSE_MS = 100.0  # --backend-read-pause-ms at most (far below any idle timeout)
# --store-busy-timeout at most: a DELETE or a usage listing locked out answers its 503 within about
# that long, and the writer's retries of a locked-out batch (60 s,
# hotloop.pipeline.post.LOCKED_RETRY_SECONDS) still make two tries or more
MAX_STORE_BUSY_TIMEOUT = 30.0
# What the simulator may be asked for, by its flags or by a request's ``metadata.sim``
# (hotloop.backends.simulator): an answer's length, and the longest silence (its first token's
# delay, a stall, or a paced rate's gap between two tokens)
SIM_MAX_TOKENS = 100_000
SIM_MAX_STALL = 600.0
SIM_MIN_RATE = 1 / SIM_MAX_STALL


@dataclass
class Config:
    # serving
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    access_log: bool = False  # uvicorn's access log (a line per request; always on at log level debug)
    log_format: str = "text"  # text | json (one JSON object per line, a line per response)
    metrics: bool = True  # GET /metrics (Prometheus); HOTLOOP_METRICS=0 turns recording off
    metrics_public: bool = False  # /metrics without an API key
    metrics_per_key: bool = False  # a tenant label (the key's name) on per-response metrics
    api_key: str | None = None  # the admin key: "Authorization: Bearer <api_key>" (see hotloop.tenants)
    limit_output_reserve: int = 4096  # output tokens a response reserves under a TPM limit without max_output_tokens
    limit_max_keys: int = 10_000  # keys whose rate-limit buckets are kept in memory (least recently used dropped)
    # backend
    backend: str = "simulator"  # simulator | cerebras | openai-compat
    model: str | None = None  # default model id (backend's default when None)
    base_url: str | None = None  # openai-compat / cerebras endpoint
    backend_api_key: str | None = None
    backend_timeout: float = 300.0  # seconds to the first chunk
    backend_idle_timeout: float = 120.0  # seconds of silence allowed between chunks
    backend_retries: int = 0  # retries of a 429/5xx before the first token
    backend_transport: str = "lean"  # lean | sdk: the chat backends' streaming HTTP client
    backend_max_connections: int = 100  # open connections to the backend (lean transport)
    backend_max_idle: int = 20  # keep-alive connections kept open while idle (lean transport)
    # milliseconds the lean transport stops reading a backend connection after a read a streaming
    # response took whole, while it serves backend_read_pause_streams responses or more at once, so
    # that the chunks sent meanwhile are read and written in one go (fewer wake-ups, less CPU per
    # chunk; each chunk, the response's end too, up to this much later); 0: never
    backend_read_pause_ms: float = 10.0
    backend_read_pause_streams: int = 16
    # auto: a <think> block at the start of a chat backend's content (Qwen3, DeepSeek-R1 on a server
    # that does not split reasoning out) is the response's reasoning (hotloop.backends.chat.assemble);
    # off: the content is text as it comes; open: the model's chat template opens the block, so the
    # content is reasoning up to its first </think> (DeepSeek-R1-0528, Qwen3 thinking-2507 models)
    think_tags: str = "auto"
    model_limits: str = ""  # JSON file of per-model context windows and output limits (hotloop.models)
    # simulator
    sim_rate: float = 1000.0  # tokens per second (0 = as fast as possible)
    sim_ttft: float = 0.0  # seconds to the first token
    sim_output_tokens: int = 64
    sim_seed: int = 0
    sim_script: str | None = None
    # classifiers (hotloop.pipeline.classifiers)
    secrets: str = "flag"  # the built-in secrets classifier's policy: off | flag | redact | block
    classifiers: str = ""  # user classifiers, comma-separated module:attr (--classifier, repeatable)
    # storage
    store: str = "sqlite"  # sqlite | memory | redis
    # normal: a response is durable within the writer's queue time after its terminal event (README,
    # Crash safety); full: stored, with SQLite synchronous=FULL, before its terminal event is sent
    store_sync: str = "normal"
    redis_url: str = "redis://127.0.0.1:6379/0"  # --store redis (hotloop.state.redis_store)
    workers: int = 1  # server processes sharing the port (hotloop.server.workers)
    # seconds a --workers worker may take to start listening, then it is stopped and replaced
    # (hotloop.server.workers.STARTUP_TIMEOUT, the default: why 60)
    worker_start_timeout: float = 60.0
    data_dir: str = field(default_factory=_default_data_dir)
    store_ttl_seconds: float = 30 * 24 * 3600.0
    store_max_responses: int = 10_000
    # --store memory: estimated bytes of what it holds (hotloop.state.store.MemoryStore.max_bytes)
    store_max_bytes: int = 256 * 1024 * 1024
    # seconds a SQLite write waits for another connection's write lock (hotloop.state.store.BUSY_TIMEOUT);
    # a DELETE's or usage listing's bound (README, Crash safety); 0 < it <= MAX_STORE_BUSY_TIMEOUT
    store_busy_timeout: float = 5.0
    # bounds
    max_body_bytes: int = 32 * 1024 * 1024  # HTTP request bodies and WebSocket frames
    # what one turn may add to its conversation (hotloop.pipeline.guard): new input items after
    # previous_response_id or a cached prefix, and their JSON bytes; beyond either a 400
    # input_too_large before the input is classified or tokenized
    max_turn_input_items: int = 10_000
    max_turn_input_bytes: int = 8 * 1024 * 1024
    max_connections: int = 10_000  # open client connections, HTTP and WebSocket (beyond: 503)
    # WebSocket connections one tenant's key may hold open in a process (beyond: a 429 at the
    # handshake); not the admin key's, nor open mode's (one tenant: max_connections bounds it)
    ws_max_connections_per_key: int = 1_000
    shutdown_grace: int = 30  # seconds responses in flight may take to finish on SIGTERM/SIGINT
    request_read_timeout: float = 30.0  # seconds for a request's head and body to arrive (then 408, closed)
    # milliseconds a pushed delta (chat backends, lean transport) may wait so that several backend
    # reads go out in one write to the client (WebSocket and SSE); 0: every read's are written at
    # once. A response's first pushed deltas, the first after a pause and every other event are
    # never held.
    flush_interval_ms: float = 10.0
    ws_connection_max_age: float = 3600.0  # OpenAI's 60-minute WebSocket limit
    # WebSocket keepalive: a ping every ws_ping_interval seconds; a client that has not answered
    # within ws_ping_timeout is disconnected (aborted when it has not read what was written: its
    # responses and their backend connections are let go). Both positive.
    ws_ping_interval: float = 20.0
    ws_ping_timeout: float = 20.0
    ws_max_queued: int = 64  # response.create frames waiting on one connection
    ws_max_in_flight: int = 16  # responses running at once on one connection, across lanes (more are queued)
    ws_max_pending_steers: int = 8  # accepted response.steer submissions waiting on one response
    ws_max_queued_bytes: int = 64 * 1024 * 1024  # their bytes (past it the connection is not read)
    ws_cache_entries: int = 1  # responses cached per connection and lane (OpenAI: the most recent)
    ws_cache_bytes: int = 64 * 1024 * 1024  # all lanes of one connection; a larger response is not cached
    ws_cache_total_bytes: int = 1024 * 1024 * 1024  # all connections together (oldest first)
    response_cache_entries: int = 256  # process-wide cache of stored responses
    response_cache_items: int = 200_000
    response_cache_bytes: int = 128 * 1024 * 1024  # one entry at most a quarter (larger: from the store)
    token_cache_entries: int = 100_000  # fingerprint -> token count
    prefix_cache_entries: int = 512  # registered inputs for full-history clients (prefix reuse), all owners
    prefix_cache_bytes: int = 128 * 1024 * 1024  # their contexts and raw bytes; one entry at most a quarter
    max_pending_writes: int = 1024
    max_pending_write_bytes: int = 256 * 1024 * 1024  # estimated bytes of queued store writes
    store_max_lag: float = 0.2  # seconds the oldest queued store write may wait (then turns wait: README, Crash safety)
    store_commit_delay: float = 0.1  # seconds the SQLite writer waits for more turns to join a commit (at most store_max_lag / 2)

    @property
    def classifier_specs(self) -> list[str]:
        return [s.strip() for s in self.classifiers.split(",") if s.strip()]

    @property
    def db_path(self) -> Path:
        return Path(self.data_dir) / "hotloop.sqlite3"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> "Config":
        """Defaults, then ``HOTLOOP_<FIELD>`` variables, then ``overrides`` (non-None only)."""
        env = dict(os.environ if env is None else env)
        cfg = cls()
        for f in fields(cls):
            raw = env.get(f"HOTLOOP_{f.name.upper()}")
            if raw is not None:
                setattr(cfg, f.name, _coerce(f.name, getattr(cfg, f.name), raw))
        for k, v in overrides.items():
            if v is not None:
                setattr(cfg, k, v)
        for name in _PATHS:  # "~/..." as the shell would have it (systemd's and docker's env files, --flag=~/x, do not)
            value = getattr(cfg, name)
            if isinstance(value, str) and value.startswith("~"):
                setattr(cfg, name, os.path.expanduser(value))
        return cfg

    def check_store(self) -> None:
        """ValueError for a store setting no command can use (``serve``, ``keys``, ``usage``)."""
        if self.store not in CHOICES["store"]:
            raise ValueError(f"{_flag('store')} must be one of {', '.join(CHOICES['store'])}; got {self.store!r}")
        if self.store == "sqlite" and not self.data_dir.strip():  # (the working directory: the store and its key left there)
            raise ValueError(f"{_flag('data_dir')} must not be empty")
        if self.store == "redis":
            # redis-py's own error for a password with an unescaped "/", "?" or "#" (which ends
            # the URL's authority early) quotes part of the password: said here, redacted
            from hotloop.backends.chat.http1 import URL_ADVICE, redact_url, split_url

            parts = split_url(self.redis_url)
            if parts is None or parts.scheme not in ("redis", "rediss", "unix") or not (
                parts.hostname or parts.scheme == "unix"
            ):
                raise ValueError(
                    f"{_flag('redis_url')} is not a valid Redis URL: {redact_url(self.redis_url)!r} ({URL_ADVICE})"
                )

    def check(self) -> None:
        """ValueError for a setting no server can run with (what the CLI's flags check, for the
        environment too, and the ranges): said before anything starts."""
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{_flag(name)} must be one of {', '.join(allowed)}; got {value!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535; got {self.port}")
        for name in _AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be 1 or more; got {getattr(self, name)}")
        for name in _POSITIVE_SECONDS:
            value = getattr(self, name)
            if not 0 < value < float("inf"):  # NaN too
                raise ValueError(f"{_flag(name)} must be a positive number of seconds; got {value!r}")
        for name in _SECONDS_OR_ZERO:
            value = getattr(self, name)
            if not 0 <= value < float("inf"):  # NaN too
                raise ValueError(f"{_flag(name)} must be 0 or more seconds; got {value!r}")
        if not 0 < self.store_busy_timeout <= MAX_STORE_BUSY_TIMEOUT:  # NaN too
            raise ValueError(
                f"{_flag('store_busy_timeout')} must be a positive number of seconds, at most "
                f"{MAX_STORE_BUSY_TIMEOUT:g}; got {self.store_busy_timeout!r}"
            )
        if not (self.sim_rate == 0 or SIM_MIN_RATE <= self.sim_rate < float("inf")):  # NaN too
            raise ValueError(
                f"{_flag('sim_rate')} must be 0 (unpaced) or at least {SIM_MIN_RATE:.6g} tokens per second "
                f"(a token at least every {SIM_MAX_STALL:g} s); got {self.sim_rate!r}"
            )
        if not 1 <= self.sim_output_tokens <= SIM_MAX_TOKENS:
            raise ValueError(f"{_flag('sim_output_tokens')} must be between 1 and {SIM_MAX_TOKENS}; got {self.sim_output_tokens}")
        if not 0 <= self.sim_ttft <= SIM_MAX_STALL:  # NaN too
            raise ValueError(f"{_flag('sim_ttft')} must be between 0 and {SIM_MAX_STALL:g} seconds; got {self.sim_ttft!r}")
        for f in fields(self):  # every other count, size and duration (NaN and infinity too)
            value = getattr(self, f.name)
            if f.name in _RANGE_CHECKED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not 0 <= value < float("inf"):
                raise ValueError(f"{_flag(f.name)} must be 0 or more; got {value!r}")
        if not self.host.strip():  # asyncio binds every interface for an empty host
            raise ValueError(f"{_flag('host')} must not be empty")
        self.check_store()
        if self.api_key is not None:  # never echoed
            if not self.api_key:  # the server would be open (no admin key), not closed
                raise ValueError(f"{_flag('api_key')} must not be empty (unset it for no admin key)")
            if self.api_key != self.api_key.strip() or any(ord(c) < 32 or ord(c) == 127 for c in self.api_key):
                # a bearer token is trimmed and holds no control character: no client could send it
                raise ValueError(
                    f"{_flag('api_key')} must not begin or end with whitespace nor hold a control character"
                )


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

# The settings with a fixed set of values (the CLI's choices), and those that must lie in a range:
# Config.check() holds the environment to what the CLI's flags are held to.
CHOICES: dict[str, tuple[str, ...]] = {
    "backend": ("simulator", "cerebras", "openai-compat"),
    "backend_transport": ("lean", "sdk"),
    "log_level": ("debug", "info", "warning", "error"),
    "log_format": ("text", "json"),
    "store": ("sqlite", "memory", "redis"),
    "store_sync": ("normal", "full"),
    "secrets": ("off", "flag", "redact", "block"),
    "think_tags": ("auto", "off", "open"),
}
_AT_LEAST_ONE = (
    "workers", "max_connections", "max_body_bytes", "backend_max_connections", "ws_max_queued", "ws_max_in_flight",
    "ws_max_connections_per_key",
)
_SECONDS_OR_ZERO = ("shutdown_grace", "store_max_lag")
_POSITIVE_SECONDS = (
    "request_read_timeout", "backend_timeout", "backend_idle_timeout", "ws_connection_max_age", "ws_ping_interval",
    "ws_ping_timeout", "worker_start_timeout",
)


# The settings ``hotloop serve`` has a flag for (the others: only their HOTLOOP_* variable)
FLAGS = frozenset({
    "host", "port", "backend", "backend_transport", "model", "base_url", "model_limits", "log_level", "log_format",
    "access_log", "metrics", "metrics_public", "metrics_per_key", "api_key", "store", "redis_url", "workers",
    "worker_start_timeout",
    "store_sync", "store_max_lag", "store_commit_delay", "store_busy_timeout", "data_dir", "max_connections",
    "request_read_timeout", "ws_ping_interval", "ws_ping_timeout", "flush_interval_ms", "backend_read_pause_ms",
    "backend_read_pause_streams", "think_tags", "shutdown_grace", "max_turn_input_items", "max_turn_input_bytes", "secrets",
    "classifiers", "sim_rate", "sim_ttft", "sim_output_tokens", "sim_seed", "sim_script",
})
_PATHS = ("data_dir", "model_limits", "sim_script")
# numbers held to a range of their own: above, or when the application is made
# (hotloop.server.runner.make_app); check() holds every other one to 0 or more
_RANGE_CHECKED = frozenset({
    "port", "sim_seed", "store_busy_timeout", "sim_rate", "sim_output_tokens", "sim_ttft", *_AT_LEAST_ONE, *_SECONDS_OR_ZERO, *_POSITIVE_SECONDS,
    "flush_interval_ms", "backend_read_pause_ms", "backend_read_pause_streams", "store_commit_delay",
    "max_turn_input_items", "max_turn_input_bytes",
})


def _flag(name: str) -> str:
    """How a setting is named in messages: its flag, or its variable when it has no flag."""
    if name not in FLAGS:
        return f"HOTLOOP_{name.upper()}"
    return f"--{name.replace('_', '-')} (HOTLOOP_{name.upper()})"


def _coerce(name: str, current: Any, raw: str) -> Any:
    """A ``HOTLOOP_<NAME>`` value as its field's type (ValueError naming the variable if not)."""
    var = f"HOTLOOP_{name.upper()}"
    if isinstance(current, bool):
        value = raw.strip().lower()
        if value in _TRUE or value in _FALSE:
            return value in _TRUE
        raise ValueError(f"{var}={raw!r}: expected one of 1, true, yes, on, 0, false, no, off")
    try:
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
    except ValueError:
        kind = "an integer" if isinstance(current, int) else "a number"
        raise ValueError(f"{var}={raw!r}: expected {kind}") from None
    return raw
