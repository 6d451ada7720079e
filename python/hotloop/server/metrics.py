"""Prometheus metrics: ``GET /metrics`` in the text exposition format.

The engine records a few ``time.perf_counter()`` marks per response where each stage runs
(:class:`~hotloop.server.engine.Run.marks`); :meth:`Metrics.turn` turns them into histogram
observations in one call when the response is over, into plain per-label-set lists rendered at
scrape time (a few microseconds per response). Gauges that mirror state the server already
keeps (active responses, the store's write queue, cache counters, open connections) are read
by a callback collector at scrape time, so they cost nothing per response.

Label sets are bounded: ``model`` is one of the models the backend lists (or its default), any
other name is recorded as ``other``; ``transport`` is ``json``, ``sse`` or ``ws``; ``status`` and
``code`` come from the server's own error classes; ``tenant`` (the key's name) only with
``--metrics-per-key``.

Multiprocess: with ``PROMETHEUS_MULTIPROC_DIR`` set (several server processes behind one port),
``/metrics`` serves the aggregate of every process's files via prometheus-client's
``MultiProcessCollector``; the callback gauges are then left out (they are per process).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable

from bisect import bisect_left

from hotloop import errors
from hotloop.tenants import LimitExceeded
from hotloop.server.engine import backend_kind

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from hotloop.server.app import HotloopApp
    from hotloop.server.engine import Run

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Stages of one response, in order (seconds).
STAGES = ("parse", "resolve", "classify", "prepare", "first_token", "generation", "persist")
_LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)
_RATE_BUCKETS = (10, 25, 50, 100, 250, 500, 1000, 2000, 4000, 8000, 16000)
OTHER = "other"


class _Series:
    """One label set's per-response histograms and counters, as plain lists: a response's
    observation is a few ``bisect`` calls and list updates (no locks, no label look-ups)."""

    __slots__ = ("stage_buckets", "stage_sums", "rate_buckets", "rate_sum", "statuses", "tokens")

    def __init__(self) -> None:
        self.stage_buckets = [[0] * (len(_LATENCY_BUCKETS) + 1) for _ in STAGES]
        self.stage_sums = [0.0] * len(STAGES)
        self.rate_buckets = [0] * (len(_RATE_BUCKETS) + 1)
        self.rate_sum = 0.0
        self.statuses: dict[str, int] = {}
        self.tokens = [0, 0, 0]  # input, output, cached


class Metrics:
    """The server's metrics on a dedicated registry."""

    def __init__(self, app: "HotloopApp", per_key: bool = False) -> None:
        self.app = app
        self.per_key = per_key
        self.models: frozenset[str] = frozenset({app.backend.default_model})
        self.series: dict[tuple[str, ...], _Series] = {}
        self.labelnames = ("transport", "model", "tenant") if per_key else ("transport", "model")
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.errors = Counter("hotloop_errors", "Errors answered to clients, by status and code.", ("status", "code"), registry=r)
        self.rate_limited = Counter("hotloop_rate_limited", "Requests refused by a key's rate limits.", registry=r)
        self.backend_errors = Counter("hotloop_backend_errors", "Model backend failures, by kind.", ("kind",), registry=r)
        # what the ledger records per response (its input flagged or redacted), as counters: a
        # block is an error (hotloop_errors, code secret_detected), never a response
        self.flagged = Counter(
            "hotloop_classified_responses",
            "Responses whose input a classifier flagged or redacted (and requests charged without a response: their client left during prefill).",
            registry=r,
        )
        self.findings = Counter(
            "hotloop_classifier_findings", "What classifiers found in responses' input (flagged or redacted), by kind.",
            ("kind",), registry=r,
        )
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        if self.multiprocess:
            # Each process writes its values to files the scrape aggregates: the per-response
            # series go through prometheus-client's own (slower, file-backed) metric objects.
            from prometheus_client import multiprocess

            tl = self.labelnames
            self.mp_stage = Histogram(
                "hotloop_stage_seconds", _STAGE_HELP, ("stage", *tl), registry=r, buckets=_LATENCY_BUCKETS
            )
            self.mp_responses = Counter("hotloop_responses", _RESPONSES_HELP, ("status", *tl), registry=r)
            self.mp_tokens = Counter("hotloop_tokens", _TOKENS_HELP, ("kind", *tl), registry=r)
            self.mp_rate = Histogram("hotloop_output_tokens_per_second", _RATE_HELP, tl, registry=r, buckets=_RATE_BUCKETS)
            self.scrape_registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.scrape_registry)
            self.state = _StateMirror(_StateCollector(app))
        else:
            r.register(_SeriesCollector(self))
            r.register(_StateCollector(app))
            self.scrape_registry = r

    def tick(self) -> None:
        """Once a second (the server's tick): in multiprocess mode, the server's state into the
        files ``/metrics`` aggregates (:class:`_StateMirror`)."""
        if self.multiprocess:
            self.state.sync()

    def set_models(self, ids: Iterable[str]) -> None:
        self.models = frozenset(ids) | {self.app.backend.default_model}

    def model(self, name: str | None) -> str:
        if name is None:
            return self.app.backend.default_model
        return name if name in self.models else OTHER

    def turn(self, run: "Run") -> None:
        """Observe one finished response (one call per response)."""
        model = self.model(run.prepared.req.model)
        key = (run.turn.transport, model, run.tenant.name) if self.per_key else (run.turn.transport, model)
        flags = run.plan.flags
        if flags:
            self.classified(flags)
        status, usage = _outcome(run)
        s = self._count(key, status, usage)
        m = run.marks
        n = len(m)
        out = usage["output_tokens"] if usage else 0
        if s is None:  # multiprocess
            ends = m[1:7] + ([run.ended] if n == 7 and run.ended else [])
            for name, prev, t in zip(STAGES, m, ends):
                self.mp_stage.labels(name, *key).observe(t - prev)
            if n == 7 and out > 0 and m[6] > m[5]:
                self.mp_rate.labels(*key).observe(out / (m[6] - m[5]))
        else:
            buckets, sums = s.stage_buckets, s.stage_sums
            prev = m[0]
            for i in range(1, n if n < 7 else 7):
                d = m[i] - prev
                prev = m[i]
                buckets[i - 1][bisect_left(_LATENCY_BUCKETS, d)] += 1
                sums[i - 1] += d
            if n == 7 and run.ended:
                d = run.ended - m[6]
                buckets[6][bisect_left(_LATENCY_BUCKETS, d)] += 1
                sums[6] += d
            if n == 7 and out > 0:
                gen = m[6] - m[5]
                if gen > 0:
                    rate = out / gen
                    s.rate_buckets[bisect_left(_RATE_BUCKETS, rate)] += 1
                    s.rate_sum += rate
        if run.failure is not None:  # the backend failed it (not a shutdown, not a failed store write)
            self.backend_errors.labels(run.failure).inc()

    def _count(self, key: tuple[str, ...], status: str, usage: dict[str, Any] | None) -> "_Series | None":
        """One response of ``status`` and its tokens under ``key``; its series (``None`` when
        multiprocess: the counters are prometheus_client's)."""
        if usage:
            inp, out = int(usage["input_tokens"]), int(usage["output_tokens"])
            cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
        if self.multiprocess:
            self.mp_responses.labels(status, *key).inc()
            if usage:
                for kind, n in (("input", inp), ("output", out), ("cached", cached)):
                    self.mp_tokens.labels(kind, *key).inc(n)
            return None
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = _Series()
        st = s.statuses
        st[status] = st.get(status, 0) + 1
        if usage:
            tokens = s.tokens
            tokens[0] += inp
            tokens[1] += out
            tokens[2] += cached
        return s

    def charged(
        self, transport: str, model: str | None, tenant: str, usage: dict[str, Any], flags: dict[str, int] | None
    ) -> None:
        """A request charged without a response (its client left while the backend worked on
        it, before its first chunk): the ledger counts it as a response with its input, so it
        is counted here too, as ``disconnected`` with those tokens (no stage is observed)."""
        model = self.model(model)
        key = (transport, model, tenant) if self.per_key else (transport, model)
        if flags:
            self.classified(flags)
        self._count(key, DISCONNECTED, usage)

    def classified(self, flags: dict[str, int]) -> None:
        """A response whose input the classifiers flagged or redacted (or a request charged
        without one: its client left during prefill), its findings per kind."""
        self.flagged.inc()
        for kind, n in flags.items():
            self.findings.labels(_bounded_kind(kind)).inc(n)

    def error(self, exc: errors.HotloopError) -> None:
        """An error answered before a response started (an HTTP error, a WebSocket error frame)."""
        self.errors.labels(str(exc.status), _bounded_code(exc.code or "none")).inc()
        if isinstance(exc, LimitExceeded):
            self.rate_limited.inc()
        elif isinstance(exc, errors.BackendError) and not exc.counted:
            self.backend_errors.labels(backend_kind(exc)).inc()

    def render(self) -> bytes:
        return generate_latest(self.scrape_registry)


def _outcome(run: "Run") -> tuple[str, dict[str, Any] | None]:
    """A response's status label and usage; one cut short (its client left) is ``disconnected``
    with what it is charged. A response that failed before any output has no ``usage`` on the
    wire, but the ledger charges it its input (``Run.spent``, Run.frames): so do the metrics."""
    turn = run.turn
    if turn.done:
        usage = turn.response.get("usage")
        if usage is None and turn.response.get("status") == "failed":
            usage = run.spent()
        return str(turn.response["status"]), usage
    return DISCONNECTED, run.spent()


_STAGE_HELP = "Time spent in each stage of a response."
DISCONNECTED = "disconnected"  # the status label of a response cut short: its client left before its end
_RESPONSES_HELP = "Responses by final status (disconnected: cut short, its client left)."
_TOKENS_HELP = "Tokens by kind (input, output, cached)."
_RATE_HELP = "Output tokens per second of generation, per response."


def _histogram(
    fam: HistogramMetricFamily, labels: list[str], bounds: tuple[float, ...], counts: list[int], total: float
) -> None:
    acc = 0
    buckets: list[tuple[str, float]] = []
    for bound, c in zip(bounds, counts):
        acc += c
        buckets.append((floatToGoString(bound), acc))
    buckets.append(("+Inf", acc + counts[-1]))
    fam.add_metric(labels, buckets, total)


class _SeriesCollector:
    """The per-response series (:class:`_Series`), rendered at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        names = list(self.metrics.labelnames)
        stage = HistogramMetricFamily("hotloop_stage_seconds", _STAGE_HELP, labels=["stage", *names])
        rate = HistogramMetricFamily("hotloop_output_tokens_per_second", _RATE_HELP, labels=names)
        responses = CounterMetricFamily("hotloop_responses", _RESPONSES_HELP, labels=["status", *names])
        tokens = CounterMetricFamily("hotloop_tokens", _TOKENS_HELP, labels=["kind", *names])
        for key, s in list(self.metrics.series.items()):
            labels = list(key)
            for i, name in enumerate(STAGES):
                _histogram(stage, [name, *labels], _LATENCY_BUCKETS, list(s.stage_buckets[i]), s.stage_sums[i])
            _histogram(rate, labels, _RATE_BUCKETS, list(s.rate_buckets), s.rate_sum)
            for status, n in list(s.statuses.items()):
                responses.add_metric([str(status), *labels], n)
            for kind, n in zip(("input", "output", "cached"), list(s.tokens)):
                tokens.add_metric([kind, *labels], n)
        yield stage
        yield rate
        yield responses
        yield tokens


# Distinct error codes given a series of their own besides the server's own error classes'
# (always theirs): a backend's code may be relayed (and the simulator's ``fail:CODE`` directive
# takes any), and past these a new one counts as OTHER, so that the series stay bounded.
MAX_ERROR_CODES = 128
_codes: set[str] = set()
# Distinct finding kinds given a series of their own (the secret scanner's kinds, user classifiers'
# labels); past these a new one counts as OTHER
MAX_FINDING_KINDS = 64
_kinds: set[str] = set()
_OWN_CODES = frozenset(
    c.code for c in vars(errors).values()
    if isinstance(c, type) and issubclass(c, errors.HotloopError) and isinstance(c.code, str)
)


def _bounded_code(code: str) -> str:
    """Error codes come from the server's own error classes, but a backend's code may be relayed:
    keep the label short, of a plain shape, and one of at most ``MAX_ERROR_CODES``."""
    if len(code) > 40 or not code.replace("_", "").replace("-", "").isalnum():
        return OTHER
    if code not in _codes and code not in _OWN_CODES:
        if len(_codes) >= MAX_ERROR_CODES:
            return OTHER
        _codes.add(code)
    return code


def _bounded_kind(kind: str) -> str:
    """A finding's kind: the secret scanner's own (a fixed set), or a user classifier's label,
    kept to a plain shape and one of at most ``MAX_FINDING_KINDS``."""
    if len(kind) > 40 or not kind.replace("_", "").replace("-", "").replace(".", "").isalnum():
        return OTHER
    if kind not in _kinds:
        if len(_kinds) >= MAX_FINDING_KINDS:
            return OTHER
        _kinds.add(kind)
    return kind


class _StateCollector:
    """Gauges and counters read from the server's state at scrape time."""

    def __init__(self, app: "HotloopApp") -> None:
        self.app = app

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        app = self.app
        eng = app.engine
        yield GaugeMetricFamily("hotloop_active_responses", "Responses in flight.", value=eng.active)
        conns = GaugeMetricFamily(
            "hotloop_open_connections",
            "Requests being served by transport: HTTP requests, SSE streams, WebSocket connections.",
            labels=["transport"],
        )
        for transport, n in sorted(app.open_connections.items()):
            conns.add_metric([transport], n)
        yield conns
        limits = app.limits
        if limits is not None:
            yield GaugeMetricFamily(
                "hotloop_client_connections",
                "Client connections held, what --max-connections bounds (idle keep-alive ones and those still sending their request included).",
                value=len(limits.admitted),
            )
            refused = CounterMetricFamily(
                "hotloop_connections_refused",
                "Client connections refused: overloaded (beyond --max-connections, a 503), read_timeout (a request head or body not sent within --request-read-timeout, a 408 or closed).",
                labels=["reason"],
            )
            refused.add_metric(["overloaded"], limits.rejected)
            refused.add_metric(["read_timeout"], limits.timed_out)
            yield refused
        p = app.persistence
        yield GaugeMetricFamily("hotloop_store_queue_depth", "Store writes waiting.", value=len(p._jobs))
        yield GaugeMetricFamily("hotloop_store_pending_responses", "Responses not yet written to the store.", value=len(p.pending))
        # one unit per pair (a failure ratio never mixes a response with a ledger batch):
        # responses (as /hotloop/stats' store counts), and usage ledger records
        yield CounterMetricFamily("hotloop_store_written", "Responses written to the store.", value=p.written)
        yield CounterMetricFamily(
            "hotloop_store_failed", "Responses not stored: their write failed or was given up at shutdown.", value=p.failed
        )
        yield CounterMetricFamily(
            "hotloop_store_usage_written", "Usage ledger records (one per charged response) written to the store.",
            value=p.usage_written,
        )
        yield CounterMetricFamily(
            "hotloop_store_usage_failed",
            "Usage ledger records not written: their write failed, the ledger buffer was full, or they came after the "
            "store closed at shutdown (logged).",
            value=p.usage_failed,
        )
        q = GaugeMetricFamily("hotloop_ws_queued_creates", "response.create frames queued on WebSocket connections.")
        q.add_metric([], app.ws_queued())
        yield q
        for name, helptext, hits, misses in (
            ("prefix_cache", "Full-history inputs matched to a cached prefix.", eng.prefixes.hits, eng.prefixes.misses),
            ("token_cache", "Token counts found in the cache.", eng.tokens.hits, eng.tokens.misses),
        ):
            c = CounterMetricFamily(f"hotloop_{name}_lookups", helptext, labels=["result"])
            c.add_metric(["hit"], hits)
            c.add_metric(["miss"], misses)
            yield c
        cc = CounterMetricFamily(
            "hotloop_connection_cache_lookups", "previous_response_id found in the connection's cache.", labels=["result"]
        )
        cc.add_metric(["hit"], eng.conn_hits)
        cc.add_metric(["miss"], eng.conn_misses)
        yield cc


class _StateMirror:
    """Multiprocess mode (``--workers``): what :class:`_StateCollector` reads from one server's
    state, copied into prometheus-client's file-backed metrics, which ``/metrics`` on any worker
    aggregates. Each gauge is summed over the live workers (``livesum``), each counter over all of
    them (a worker that ended keeps its counts: its files stay). Copied once a second (the
    server's tick, :meth:`Metrics.tick`), so a scrape sees them up to a second late."""

    def __init__(self, collector: _StateCollector) -> None:
        self.collector = collector
        self.metrics: dict[str, Any] = {}  # family name -> its file-backed Counter or Gauge
        self.copied: dict[tuple[str, tuple[str, ...]], float] = {}  # a counter's value copied so far

    def sync(self) -> None:
        for fam in self.collector.collect():
            metric = self.metrics.get(fam.name)
            for sample in fam.samples:
                labels = tuple(sample.labels.values())
                if metric is None:
                    names = tuple(sample.labels)
                    if fam.type == "counter":
                        metric = Counter(fam.name, fam.documentation, names, registry=None)
                    else:
                        metric = Gauge(fam.name, fam.documentation, names, multiprocess_mode="livesum", registry=None)
                    self.metrics[fam.name] = metric
                child: Any = metric.labels(*labels) if labels else metric
                if fam.type == "counter":
                    key = (fam.name, labels)
                    grown = sample.value - self.copied.get(key, 0.0)
                    if grown > 0:
                        child.inc(grown)
                        self.copied[key] = sample.value
                else:
                    child.set(sample.value)
