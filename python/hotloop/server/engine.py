"""Running one response: resolve, prepare, call the backend, drive the turn, then bookkeeping.

Transport-neutral: HTTP (JSON and SSE) and WebSocket handlers call :meth:`Engine.start`, which does
everything that can fail *before* the first event (validation, ``previous_response_id``, the
backend's first chunk), raising :class:`hotloop.errors.HotloopError` so the caller can answer with
an HTTP error or a WebSocket error frame. The returned :class:`Run` then yields batches of frames;
failures after that point become ``response.failed`` inside the stream.

After the terminal event the finished response is cached (the connection's cache and, if stored,
the process-wide cache) and handed to :class:`hotloop.pipeline.post.Persistence`, which writes it
off the critical path.

Every response runs for a tenant (:mod:`hotloop.tenants`): the parent it names and the items it
references are looked up in that tenant's scope only (another tenant's id behaves exactly like an
id that does not exist), what it stores is owned by the tenant, its usage is recorded under the
key's name, and its tokens and concurrency slot are admitted by the tenant's limits once the
input is prepared (the reservation is corrected when the response ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncGenerator, AsyncIterator, Callable, TypeVar

import msgspec

from hotloop import errors
from hotloop.backends.base import Backend, BackendRequest, PushSlot
from hotloop.config import Config
from hotloop.models import ModelLimits, ModelRegistry
from hotloop.pipeline import classifiers, guard
from hotloop.pipeline import items as itemlib
from hotloop.pipeline import reuse
from hotloop.pipeline import window
from hotloop.pipeline.classify import ALLOW, Block, Flag, Redact, SecretsClassifier, Verdict
from hotloop.pipeline.post import Persistence, stored_base, usage_record
from hotloop.pipeline.prepare import INLINE_TOKENIZE_CHARS, Plan, finished, prepare, unresolved_references
from hotloop.pipeline.settings import ToolsCache
from hotloop.protocol import sealed
from hotloop.protocol.chunks import Chunk, Failure, Finish
from hotloop.protocol.events import Frame
from hotloop.protocol.objects import IdGen, response_object, wants_encrypted_reasoning, wants_summary
from hotloop.protocol.request import CreateRequest, Item, ItemReference, Prepared, validate
from hotloop.protocol.turn import STEERED, Turn
from hotloop.state import fpkey
from hotloop.state.context import CacheBudget, CachedResponse, ConnectionCache, Deletions, ResponseCache, entry_nbytes
from hotloop.state.prefix import Prefix, PrefixCache, Sent
from hotloop.state.store import visible
from hotloop.tenants import ANONYMOUS, Grant, LimitExceeded, Tenancy, Tenant

log = logging.getLogger("hotloop.engine")


# Refusals that leave a continuation's chain as it was: the tenant's own limits, a classifier's
# block, an input over the context window (found here, or the backend's own refusal of it, which
# comes before any output) or over the size guard. A retry (smaller, without the secret, later,
# with truncation "auto") must find the parent, so it is not evicted from the connection's cache.
_KEEPS_PARENT = (
    LimitExceeded, classifiers.InputBlocked, classifiers.ClassifierFailed, errors.ContextLengthExceeded, guard.InputTooLarge,
)


async def _warmup() -> AsyncIterator[Chunk]:
    """``generate: false``: no model call, an empty completed response."""
    yield Finish("stop")


class Engine:
    def __init__(
        self, config: Config, backend: Backend, persistence: Persistence, tenancy: Tenancy | None = None
    ) -> None:
        self.config = config
        self.backend = backend
        self.persistence = persistence
        self.tenancy = tenancy  # None: no limits
        self.ids = IdGen()
        # Fingerprints under the key the store keeps its fingerprints under (hotloop.state.fpkey).
        itemlib.use_key(persistence.store.fingerprint_key)
        # Reasoning's encrypted_content sealed and opened under a key derived from it (its own
        # label), so that it lives as that key does (hotloop.protocol.sealed).
        sealed.use_key(fpkey.derive(persistence.store.fingerprint_key, sealed.KEY_LABEL))
        self.clock: Callable[[], float] = time.time  # injectable for deterministic transcripts
        self.tokens = itemlib.TokenCache(config.token_cache_entries)
        dialect = getattr(backend, "dialect", None)  # (a chat backend's; the simulator reads all)
        self.tokens.counts_reasoning = getattr(dialect, "reasoning_history", True)
        self.responses = ResponseCache(
            config.response_cache_entries, config.response_cache_items, config.response_cache_bytes,
            config.store_ttl_seconds, lambda: self.clock(),
        )
        # Responses deleted, for the WebSocket connections' caches (hotloop.state.context.Deletions).
        self.deletions = Deletions()
        # What the WebSocket connections' caches hold together (hotloop.state.context.CacheBudget).
        self.conn_cache_budget = CacheBudget(config.ws_cache_total_bytes)
        # Inputs of finished responses, for clients that resend the whole history (pipeline.reuse).
        self.prefixes = PrefixCache(config.prefix_cache_entries, config.prefix_cache_bytes)
        # An agent's tool definitions, decoded and checked once per key (pipeline.settings).
        self.tools = ToolsCache()
        self.runs: set[Run] = set()  # the responses streaming now (abort_all fails them)
        self.stopping = False  # the server is shutting down: no new response starts
        self.aborting: errors.HotloopError | None = None  # ... and its grace is over (abort_all)
        self.completed = 0
        # --store-sync full: a stored response's write is finished before its terminal event is sent
        self.sync = config.store_sync == "full"
        # Two threads count the tokens of large new inputs while the backend generates, and scan
        # large texts for secrets (the counter and the scanner release the GIL): one takes the jobs
        # of fewer than LARGE_JOB_CHARS characters, the other the larger ones, so that one
        # request's huge input never holds up other requests' ordinary ones (counting 30 MB that
        # is one unbroken run of letters takes about 10 s). Their queues hold at most three jobs
        # per request in flight (a settings scan, a scan of the input, its count), and the
        # deferred scans at most MAX_DEFERRED_SCANS: admission (--max-connections, the lanes of a
        # WebSocket connection) bounds them.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotloop-tokenize")
        self._tokenize_large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotloop-tokenize-large")
        self._deferred_scans = 0  # settings scans submitted by _classify_later and not done
        # The secrets classifier under its policy, then the user's (hotloop.pipeline.classifiers);
        # a bad --classifier raises ClassifierLoadError here, before the server starts.
        # Call ids redacted under the store's key, so that a call and its output redacted by another
        # process of the store (a restart, a worker, a replica) get one marker.
        self.classifiers = classifiers.build(
            config.secrets, config.classifier_specs, call_id_key=getattr(persistence.store, "call_id_key", None)
        )
        # Classifiers that can only flag (the secrets scanner under its default policy, alone)
        # change nothing the backend sees: a small input is then classified after the backend
        # request is out (Engine._classify_later), like its token count.
        self._flag_only = bool(self.classifiers) and all(
            type(c) is SecretsClassifier and c.policy == "flag" for c in self.classifiers
        )
        # It also scans each request's own texts besides its items (instructions, tools, output
        # format, metadata, identifiers: SecretsClassifier.classify_settings).
        self._secrets = next((c for c in self.classifiers if isinstance(c, SecretsClassifier)), None)
        # Context windows and output limits per model; a bad --model-limits file raises
        # ModelLimitsError here, before the server starts.
        self.models = ModelRegistry.from_config(config.model_limits or None)
        # what one turn may add (pipeline.guard)
        self._max_new_items = config.max_turn_input_items
        self._max_new_bytes = config.max_turn_input_bytes
        # Server CPU per response on the event-loop thread (bounded ring, newest last), for
        # `hotloop bench` and /hotloop/stats: (transport, cpu_us, pre_us, events, context_items).
        self.turn_stats: deque[tuple[str, float, float, int, int]] = deque(maxlen=4096)
        self.conn_hits = 0  # previous_response_id found in the connection's own cache
        self.conn_misses = 0
        # Called once per finished response (hotloop.server.metrics and the response log line).
        self.observers: list[Callable[["Run"], None]] = []
        # told about a request charged without a response (its client left while the backend
        # worked on it): transport, model, key name, the usage it is charged and what the
        # classifiers flagged; the metrics count it as the ledger does, as a response cut short
        self.on_charged: Callable[[str, str | None, str, dict[str, Any], dict[str, int] | None], None] | None = None
        # A shared store's admission check for store: true (hotloop.pipeline.shared); None: always
        self._writable: Callable[[], bool] | None = getattr(persistence, "writable", None)

    @property
    def active(self) -> int:
        return len(self.runs)

    def abort_all(self, exc: errors.HotloopError) -> int:
        """End every response in flight with ``response.failed`` (``exc``) as soon as it can
        (the end of the shutdown grace); how many there were."""
        self.aborting = exc
        for run in list(self.runs):
            run.abort(exc)
        return len(self.runs)

    def record(self, run: "Run", mark: float) -> None:
        now = time.thread_time()
        self.turn_stats.append(
            (run.turn.transport, (now - mark) * 1e6, (run.started_cpu - mark) * 1e6, run.turn.events, len(run.plan.items))
        )
        self.observe(run)

    def observe(self, run: "Run") -> None:
        """Tell the observers (metrics) about a response that ended, or was cut short."""
        for observe in self.observers:
            observe(run)

    # -- resolving the parent ------------------------------------------------------------------

    def deleted(self, response_id: str) -> None:
        """A response deleted (here, or by another process sharing the store): out of the
        process-wide cache, and no longer served by any WebSocket connection's cache."""
        self.responses.evict(response_id)
        self.deletions.add(response_id)

    async def resolve(
        self, response_id: str | None, conn: ConnectionCache | None, scope: str | None = ANONYMOUS.id
    ) -> CachedResponse | None:
        """The parent named by ``previous_response_id``, as ``scope`` may see it (the connection's
        own cache holds only its tenant's responses)."""
        if response_id is None:
            return None
        if conn is not None:
            hit = conn.get(response_id)
            if hit is not None:
                self.conn_hits += 1
                return hit
            self.conn_misses += 1
        hit = self.responses.get(response_id, scope)
        if hit is None:
            generation = self.responses.generation
            hit = await self.persistence.load(response_id, scope)
            if hit is not None and hit.response.get("status") == "failed":
                # A failed response is stored to be read, not continued (its output may end in
                # the middle of a call). The wire reference names no error for it: the code
                # clients already handle for a parent they cannot continue, with a message that
                # says why.
                raise errors.PreviousResponseNotFound(
                    response_id, f"Previous response with id '{errors.clip(response_id)}' failed and cannot be continued."
                )
            if hit is not None and not self.responses.evicted_since(response_id, generation):
                self.responses.put(hit)  # (deleted while it loaded: used by this request, not kept)
        if hit is None:
            if self.in_flight(response_id, scope) is not None:
                # still being generated (over HTTP, or on another connection): its output is not
                # known yet; the code clients handle for a parent they cannot continue, with a
                # message that says why (it said "not found" while GET showed it in_progress)
                raise errors.PreviousResponseNotFound(
                    response_id,
                    f"Previous response with id '{errors.clip(response_id)}' is still in progress; continue from "
                    "it once it has completed.",
                )
            raise errors.PreviousResponseNotFound(response_id)
        return hit

    def in_flight(self, response_id: str, scope: str | None) -> "Run | None":
        """The stored (``store: true``) response ``response_id`` still being generated, if
        ``scope`` may see it (another tenant's, or one not stored, is None: unknown, as any
        unknown id). A scan of the responses in flight (as many as the server runs at once)."""
        for run in self.runs:
            r = run.turn.response
            if r.get("id") == response_id:
                return run if r.get("store", True) and visible(run.tenant.id, scope) else None
        return None

    # -- one response --------------------------------------------------------------------------

    def backend_request(self, plan: Plan) -> BackendRequest:
        p = plan.prepared
        req = p.req
        return BackendRequest(
            model=req.model or self.backend.default_model,
            instructions=req.instructions,
            items=plan.items,
            tools=list(p.function_tools.values()),
            tool_choice=p.tool_choice,
            parallel_tool_calls=p.parallel_tool_calls,
            max_output_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            text_format=req.text.format if req.text is not None else None,
            reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
            prompt_cache_key=req.prompt_cache_key,
            service_tier=req.service_tier,
            metadata=req.metadata or {},
            user=req.safety_identifier or req.user,
        )

    async def start(
        self,
        req: CreateRequest,
        *,
        transport: str,
        conn: ConnectionCache | None = None,
        websocket: bool = False,
        tenant: Tenant = ANONYMOUS,
        prefix: Prefix | None = None,
        raw_input: reuse.RawInput | None = None,
        request_id: str | None = None,
        received: float | None = None,
    ) -> "Run":
        """Everything before the first event. Raises ``HotloopError``; evicts on failure (but not
        when the tenant's own limits refuse the response: a retry must find the parent).

        ``prefix`` is a raw-bytes prefix hit (:func:`hotloop.pipeline.reuse.decode_create`; then
        ``req.input`` holds only the items after it) and ``raw_input`` the request's raw ``input``
        array; without a hit, a full-history input is matched by fingerprint here. ``received``:
        ``perf_counter()`` when the request began to be read (HTTP: before its body), so that the
        ``parse`` stage covers reading and decoding it too; by default now."""
        if self.stopping:
            raise errors.ServerShuttingDown("The server is shutting down; send the request again on a new connection.")
        started: list[Any] = []
        grant: Grant | None = None
        requested = False  # the backend has the request (it works for it from then on)
        slot: PushSlot | None = None
        refs: dict[str, Item] | None = None  # the stored items the input's references named
        added: dict[str, Item] = {}  # those of them this request resolved (not the raw hit's)
        clock = time.perf_counter
        marks = [clock() if received is None else received]  # each stage's end (Run.marks; metrics.STAGES)
        if req.store and self._writable is not None and not self._writable():
            raise errors.StoreUnavailable()  # the shared store is down and its write queue full
        try:
            # a registered input whose bytes this request's start with (decode_create); one
            # found by fingerprint below is not (continued() extends a copy of either)
            hit = prefix
            sent: Sent | None = None
            done = raw_input.prepared if raw_input is not None else None
            p = done if done is not None and done.req is req else validate(req, websocket=websocket)
            scope = tenant.scope
            # (a whole input's references, registered with it: reuse.registration)
            nrefs = 0 if raw_input is None else reuse.references(p.items) + (prefix.nrefs if prefix is not None else 0)
            held = raw_input.hit_refs if prefix is not None and raw_input is not None else None
            # where its references were found among the cached responses: while those are all
            # still cached and unexpired, a look-up would find the same items there (Prefix.checked)
            vouched = raw_input.hit_checked if held is not None and raw_input is not None else None
            if vouched is not None and not (
                vouched[2] == scope and self.clock() < vouched[1] and self.responses.holds(vouched[0])
            ):
                vouched = None
            named = True
            if held is not None and vouched is None and nrefs <= MAX_REFERENCE_LOOKUPS:
                named, vouched = await reuse.still_named(held, scope, self.responses.find_item_held, self.persistence.find_item)
            if prefix is not None and raw_input is not None and (nrefs > MAX_REFERENCE_LOOKUPS or not named):
                # an item the registered input named is gone (or another one has its id now), or
                # the input names more than one request may look up: it is matched with its whole
                # input, as from scratch
                self.prefixes.raw_hits -= 1
                self.prefixes.body_hits -= raw_input.by_body
                req = reuse.whole(req, raw_input)
                p = validate(req, websocket=websocket)
                prefix = hit = None
                held = vouched = None
                nrefs = reuse.references(p.items)
            marks.append(clock())
            parent = await self.resolve(req.previous_response_id, conn, scope)
            whole = probe = p.items  # probe: what is matched, the input with its references resolved
            looked: dict[str, Item] | None = None  # the stored items they name (stored_items)
            if (
                parent is None and type(req.input) is list and (prefix is not None or len(self.prefixes))
                and any(type(it) is ItemReference for it in probe)
            ):
                looked = await self.stored_items(p, None, scope)
                probe = reuse.resolved(probe, looked) or []
            if parent is None and prefix is None and type(req.input) is list and len(self.prefixes):
                prefix = reuse.match(self.prefixes, tenant.id, probe)
                if prefix is not None:
                    p = msgspec.structs.replace(p, items=p.items[prefix.n :])
                    probe = probe[prefix.n :]
            if prefix is not None:
                prefix, k = reuse.continued(prefix, probe)  # the output it produced, sent back
                if k:
                    p = msgspec.structs.replace(p, items=p.items[k:])
                parent = reuse.parent_of(prefix)  # the reused items, analysed when they were new
                if looked is not None:  # what the reused part named by reference: supplied, as from scratch
                    reuse.supply(parent, whole[: len(whole) - len(p.items)])
                self.prefixes.hits += 1
            elif req.previous_response_id is None and type(req.input) is list:
                self.prefixes.misses += 1
            # what this turn adds, bounded before it is classified, tokenized or stored (pipeline.guard):
            # of a whole history, what follows the cached prefix and the model's last output in it
            new = p.items
            if req.previous_response_id is None and type(req.input) is list:
                start = guard.turn_start(new)
                if len(new) > 1:
                    new = new[start:]
                if not start and prefix is not None:
                    # no model output after the cached prefix: from scratch the turn starts after
                    # the model's last output before it, and is measured so here too (the same
                    # body is accepted or refused whatever the prefix cache holds)
                    own = prefix.entry.context.items
                    new = own[guard.turn_start(own, prefix.n) : prefix.n] + new
            guard.check(new, self._max_new_items, self._max_new_bytes)
            marks.append(clock())
            try:
                settings_flags = None
                secrets = self._secrets
                later = self._flag_only and classifiers.text_chars(p.items, CLASSIFY_OFFLOAD_CHARS) < CLASSIFY_OFFLOAD_CHARS
                if secrets is not None and not later:  # flag-only: after the backend request too
                    # large texts of the request's own that the settings caches have not seen
                    # are scanned in the tokenizer thread (so too after the backend request)
                    chars = secrets.settings_chars(p, LARGE_JOB_CHARS, tenant.id)  # (its thread: _offload)
                    if chars >= CLASSIFY_OFFLOAD_CHARS:
                        verdict, p = await self._offload(chars, secrets.classify_settings, p, tenant.id)
                        p, settings_flags = self._settings_outcome(secrets, verdict, p, tenant)
                    else:
                        p, settings_flags = self.classify_settings(secrets, p, tenant)
                outcome = await self.classify(p, parent, tenant) if self.classifiers and not later else None
                if outcome is not None and outcome.items is not p.items:
                    sent = reuse.sent_of(p.items, outcome.items)  # matched as sent next turn (PrefixCache)
                    p = msgspec.structs.replace(p, items=outcome.items)  # redacted: tokenized and sent as such
                marks.append(clock())
                # (the items the whole input's references named, when it is still the whole input)
                stored = looked if looked is not None and prefix is None else await self.stored_items(p, parent, scope)
                if raw_input is not None and (looked or stored or held):
                    # what the whole input's references named: registered with its bytes
                    refs = dict(held) if held else {}
                    added = {**(looked or {}), **(stored or {})}
                    refs.update(added)
                plan = prepare(p, parent, self.ids, self.tokens.view(tenant.id), defer=True, stored=stored)
            except errors.HotloopError as exc:
                if prefix is not None:  # name the item's place in the whole input
                    reuse.shift(exc, prefix.n)
                raise
            plan.flags = settings_flags
            if outcome is not None:
                plan.states = outcome.states
                plan.flags = _merged(outcome.tally(), settings_flags)
            await self.fit_window(plan, req, tenant)
            if self.tenancy is not None:
                tpm = tenant.limits.tpm
                if tpm is not None and not plan.settled and window.upper_bound(plan) > tpm:
                    # The reservation counts text still to count as one token per 4 characters,
                    # corrected when the response ends; text denser than that (CJK) could make
                    # one response more than the key's whole TPM, admitted and charged into
                    # debt instead of refused "too large": an input that may be so is counted now
                    await self.count_input(plan)
                admitted = self.tenancy.admit_response(tenant, plan.input_estimate(), req.max_output_tokens)
                grant = admitted if admitted is None or isinstance(admitted, Grant) else await admitted
            counts = self._count_later(plan)
            started.append(counts)
            verdicts = self._classify_later(p, parent, tenant, plan) if later else None
            started.append(verdicts)
            marks.append(clock())
            if req.generate is False:
                stream: AsyncIterator[Chunk] = _warmup()
            else:
                breq = self.backend_request(plan)
                breq.request_id = request_id
                # chunks may be taken from the backend's read callback (Run.emit; a JSON answer's
                # run takes them into its turn, writing nothing)
                breq.push = slot = PushSlot()
                stream = self.backend.stream(breq)
            # The Response object, its turn and the events that open its stream are made while
            # the backend works on the request (after this task has written it and waits), not
            # between the backend's first chunk and the client: they depend on nothing it says.
            opening = _next_iteration(lambda: self._opening(p, plan, transport))
            started.append(opening)
            if verdicts is not None:
                # the request goes to the backend now: its deferred scan completes, and logs a
                # secret it finds, whatever happens next (the client leaving, a backend refusal)
                started.remove(verdicts)
            requested = req.generate is not False
            first = await self._first(stream, request_id)
            marks.append(clock())
        except BaseException as exc:  # any failure of a continuation evicts its parent (not only 4xx)
            charged = None
            if requested and isinstance(exc, asyncio.CancelledError):
                # its client left while the backend worked on the request (prefill, queueing):
                # charged its input, in its key's TPM budget and in the ledger, as a response
                # cut short later is (a backend's refusal or error is not charged): its count
                # when the counting has ended (it runs while the backend works), else its estimate
                if not plan.settled and counts is not None and counts.done():
                    if not counts.cancelled() and counts.exception() is None:
                        plan.settle(counts.result())
                charged = plan.input_estimate()
                model = req.model or self.backend.default_model
                usage = {"input_tokens": charged, "output_tokens": 0, "total_tokens": charged,
                         "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
                self.persistence.charge(usage_record({"model": model, "usage": usage}, tenant.id, plan.flags, tenant.name))
                if self.on_charged is not None:
                    self.on_charged(transport, model, tenant.name, usage, plan.flags)
            if grant is not None:
                grant.finish(charged)
            if not isinstance(exc, _KEEPS_PARENT):  # a retry must find the parent
                self._evict(req, conn)
            for fut in started:
                if fut is not None:
                    fut.cancel()  # nobody will read these counts
            raise
        if opening.done() and not opening.cancelled() and opening.exception() is None:
            turn, frames = opening.result()
        else:  # the first chunk came at once (no wait: a warm-up)
            opening.cancel()
            turn, frames = self._opening(p, plan, transport)
        run = Run(self, plan, p, turn, first, stream, conn, counts, tenant, grant)
        run.opening = frames
        run.prefix = prefix
        run.hit = hit
        run.sent = sent
        run.marks = marks
        run.verdicts = verdicts
        run.push_slot = slot
        run.request_id = request_id
        if req.previous_response_id is None and raw_input is not None:
            run.raw_input = reg = reuse.registration(raw_input, refs, nrefs)
            if reg is not None and reg.refs:
                # where they were found among the cached responses (Prefix.checked): with the raw
                # hit's vouched for, only those this request added are looked up (an AI SDK
                # history names every earlier reasoning item each step)
                _, reg.checked = await reuse.still_named(
                    reg.refs if vouched is None else added, scope, self.responses.find_item_held, base=vouched
                )
        return run

    def _opening(self, p: Prepared, plan: Plan, transport: str) -> tuple[Turn, list[Frame]]:
        """A new response's turn, and its opening events (``response.created``,
        ``response.in_progress``)."""
        req = p.req
        response = response_object(p, self.ids.new("resp"), int(self.clock()), model=req.model)
        turn = Turn(
            response,
            ids=self.ids,
            transport=transport,
            input_tokens=plan.input_tokens if plan.settled else 0,  # completed by Run._settle
            cached_tokens=plan.cached_tokens,
            # parallel_tool_calls false: at most one call, as OpenAI answers, whatever the backend
            # does with the flag (passed on; Ollama and some chat templates ignore it)
            max_tool_calls=req.max_tool_calls if p.parallel_tool_calls else min(req.max_tool_calls or 1, 1),
            clock=self.clock,
            quiet=transport == "json",  # a non-streaming response: nobody reads its events
            reasoning_summary=wants_summary(p),  # reasoning as its summary (verbatim: protocol.turn)
            seal=sealed.seal if wants_encrypted_reasoning(p) else None,  # include, or store: false
        )
        turn.truncated_items = plan.truncated  # (fit_window ran before)
        return turn, turn.start()

    def limits(self, model: str | None) -> ModelLimits:
        """The registry's limits for ``model`` (the backend's default when ``None``)."""
        return self.models.get(model or self.backend.default_model, getattr(self.backend, "context_windows", None))

    async def fit_window(self, plan: Plan, req: CreateRequest, tenant: Tenant = ANONYMOUS) -> int:
        """Check the input against the model's context window before any backend call
        (:mod:`hotloop.pipeline.window`); truncate it with ``truncation: "auto"``. O(new input)
        unless it truncates. The number of items dropped."""
        limits = self.limits(req.model)
        allowed = window.budget(limits, req.max_output_tokens)
        if allowed is None and not window.pending_cut(plan):
            return 0  # (an item of a call an earlier truncation dropped goes with it: window.fit)
        if not plan.settled:
            if allowed is not None and window.upper_bound(plan) <= allowed:
                return 0  # fits whatever the pending texts count
            await self.count_input(plan)
        before = plan.input_tokens
        dropped = window.fit(plan, limits, req.max_output_tokens, req.truncation)
        if dropped:
            log.info(
                "truncated the input of a response for key %s: dropped %d items (%d -> %d tokens, window %s)",
                tenant.name, dropped, before, plan.input_tokens, limits.context_window,
            )
        return dropped

    async def classify(self, p: Prepared, parent: CachedResponse | None, tenant: Tenant) -> classifiers.Outcome:
        """Run the classifiers over the request's new items with the chain's states; raise
        :class:`~hotloop.pipeline.classifiers.InputBlocked` when one blocks. A large new input
        (``CLASSIFY_OFFLOAD_CHARS`` of text or more) is scanned in the tokenizer thread (the native
        scanner releases the GIL), so the event loop serves other connections meanwhile."""
        states = parent.states if parent is not None else None
        chars = classifiers.text_chars(p.items, LARGE_JOB_CHARS)  # (its thread: _offload)
        if chars >= CLASSIFY_OFFLOAD_CHARS:
            outcome = await self._offload(chars, classifiers.classify_turn, self.classifiers, p.items, states)
        else:
            outcome = classifiers.classify_turn(self.classifiers, p.items, states)
        self._report(outcome, tenant)
        if outcome.block is not None:
            name, block = outcome.block
            log.info("classifier %s blocked a request for key %s: %s", name, tenant.name, _kinds((), block.labels))
            raise classifiers.blocked_error(block, isinstance(p.req.input, str))
        return outcome

    def classify_settings(self, secrets: SecretsClassifier, p: Prepared, tenant: Tenant) -> tuple[Prepared, dict[str, int] | None]:
        """Scan the request's own texts besides its items for secrets under the secrets policy:
        ``p`` (redacted under ``redact``) and the findings per kind, for this turn's flags; raise
        :class:`~hotloop.pipeline.classifiers.InputBlocked` under ``block``. On the event loop:
        large texts the scanner's caches have not seen go to the tokenizer thread instead
        (:meth:`SecretsClassifier.settings_chars`, in :meth:`start`)."""
        verdict, p = secrets.classify_settings(p, tenant.id)
        return self._settings_outcome(secrets, verdict, p, tenant)

    def _settings_outcome(
        self, secrets: SecretsClassifier, verdict: Verdict, p: Prepared, tenant: Tenant
    ) -> tuple[Prepared, dict[str, int] | None]:
        """What :meth:`classify_settings` makes of the scan's verdict."""
        if verdict is ALLOW:
            return p, None
        if isinstance(verdict, Block):
            log.info("classifier %s blocked a request for key %s: %s", secrets.name, tenant.name, _kinds(verdict.findings, verdict.labels))
            raise classifiers.blocked_error(verdict)
        assert isinstance(verdict, (Flag, Redact))
        log.info(
            "classifier %s %s the instructions, tools or format of a request for key %s: %s",
            secrets.name, "redacted" if isinstance(verdict, Redact) else "flagged", tenant.name,
            _kinds(verdict.findings, verdict.labels),
        )
        return p, dict(Counter(f.kind for f in verdict.findings))

    def _classify_later(self, p: Prepared, parent: CachedResponse | None, tenant: Tenant, plan: Plan) -> "asyncio.Future[None]":
        """:meth:`classify` for classifiers that can only flag (``_flag_only``), on the event loop
        in its next iteration, once the caller's task has written the backend request (the
        request's own texts in the tokenizer thread when large and not cached, as in
        :meth:`start`); the future is done once ``plan`` holds the chain's new states and this
        turn's flags (awaited before the terminal event, :meth:`Run._settle`). It never fails: a
        scan that raises is logged, and the response goes on without its flags."""
        states = parent.states if parent is not None else None
        secrets = self._secrets
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finish() -> None:
            if not done.done():
                done.set_result(None)

        def failed() -> None:
            # a flag-only scan changes nothing the client sees: the response goes on, without
            # this turn's flags (the chain keeps its parent's state); the log says why
            log.exception("the secrets scan failed (key %s); the response goes on unflagged", tenant.name)
            finish()

        def settings_done(job: "asyncio.Future[tuple[Verdict, Prepared]]", tally: dict[str, int]) -> None:
            self._deferred_scans -= 1
            if job.cancelled():  # the tokenizer thread is shutting down: this turn's other flags
                plan.flags = tally
                return finish()
            try:
                verdict, _ = job.result()
                assert secrets is not None
                _, flags = self._settings_outcome(secrets, verdict, p, tenant)
                plan.flags = _merged(tally, flags)
            except Exception:  # noqa: BLE001
                return failed()
            finish()

        def run() -> None:
            # Cancelled by a start that failed before its request went out (Engine.start takes
            # ``done`` off its list to cancel just before the request; nothing between schedules
            # this and that suspends, and Run._settle shields it): no scan, nothing was sent.
            # Once this ran, nothing cancels ``done``: a scan submitted completes and logs.
            if done.done():
                return
            try:
                outcome = classifiers.classify_turn(self.classifiers, p.items, states)
                self._report(outcome, tenant)
                plan.states = outcome.states
                tally = outcome.tally()
                flags = None
                if secrets is not None:  # flag-only: neither changes p nor raises
                    chars = secrets.settings_chars(p, LARGE_JOB_CHARS, tenant.id)  # (its thread: _offload)
                    if chars >= CLASSIFY_OFFLOAD_CHARS:
                        if self._deferred_scans >= MAX_DEFERRED_SCANS:
                            log.warning(
                                "the secrets scan of the instructions, tools or format of a request for key %s "
                                "is skipped: %d scans wait for the tokenizer thread", tenant.name, self._deferred_scans,
                            )
                            plan.flags = tally
                            return finish()
                        job = self._offload(chars, secrets.classify_settings, p, tenant.id)
                        self._deferred_scans += 1
                        job.add_done_callback(lambda j: settings_done(j, tally))
                        return
                    _, flags = self.classify_settings(secrets, p, tenant)
                plan.flags = _merged(tally, flags)
            except Exception:  # noqa: BLE001
                return failed()
            finish()

        loop.call_soon(run)
        return done

    def _report(self, outcome: classifiers.Outcome, tenant: Tenant) -> None:
        """Log what the classifiers flagged or redacted."""
        for name, verdict in outcome.verdicts:
            log.info(
                "classifier %s %s the input of a request for key %s: %s",
                name, "redacted" if isinstance(verdict, Redact) else "flagged", tenant.name,
                _kinds(verdict.findings, verdict.labels),  # type: ignore[union-attr]
            )

    async def stored_items(
        self, p: Prepared, parent: CachedResponse | None, scope: str | None = ANONYMOUS.id
    ) -> dict[str, Item] | None:
        """Items of stored responses named by ``item_reference`` (the Vercel AI SDK sends these
        without ``previous_response_id``). Only stored (``store: true``) responses that ``scope``
        may see are searched, and only for ids the server minted (the store records each item's
        provenance): an id a client supplied never stands in for a minted one."""
        ids = unresolved_references(p, parent)
        if not ids:
            return None
        found: dict[str, Item] = {}
        for item_id in dict.fromkeys(ids[:MAX_REFERENCE_LOOKUPS]):
            item = await self._stored_item(item_id, scope)
            if item is None:
                break  # prepare() reports the first unresolved reference
            found[item_id] = item
        return found

    async def _stored_item(self, item_id: str, scope: str | None) -> Item | None:
        """The stored, server-minted item of that id ``scope`` may see (:meth:`stored_items`)."""
        return self.responses.find_item(item_id, scope) or await self.persistence.find_item(item_id, scope)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._tokenize_large.shutdown(wait=False, cancel_futures=True)

    def _offload(self, chars: int, fn: Callable[..., _T], *args: Any) -> "asyncio.Future[_T]":
        """Run ``fn(*args)`` in the tokenizer thread for a job of ``chars`` characters: the
        large jobs' thread from ``LARGE_JOB_CHARS`` on (see ``_tokenize_large``)."""
        pool = self._tokenize_large if chars >= LARGE_JOB_CHARS else self._tokenize_pool
        return asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _count_later(self, plan: Plan) -> "asyncio.Future[tuple[list[int], list[int]]] | None":
        """Tokenize the new input while the backend works; the counts are awaited only before
        the terminal event (for ``usage``).

        A large input is counted in the tokenizer thread (the counter releases the GIL, so
        counting runs on another core while the event loop streams). A small one is counted on the event
        loop in its next iteration: the caller's task writes the backend request first, then
        waits for the answer, so the count is off the turn's critical path at no extra cost.
        """
        if plan.settled:
            return None
        if plan.pending_chars >= INLINE_TOKENIZE_CHARS:
            return self._offload(plan.pending_chars, itemlib.count_pending, *plan.pending_texts())
        return _next_iteration(lambda: itemlib.count_pending(*plan.pending_texts()))

    async def count_input(self, plan: Plan) -> int:
        """Settle a plan's counts off the event loop (``POST /v1/responses/input_tokens``)."""
        counts = self._count_later(plan)
        plan.settle(await counts if counts is not None else None)
        return plan.input_tokens

    async def _first(self, stream: AsyncIterator[Chunk], request_id: str | None = None) -> Chunk:
        try:
            async with asyncio.timeout(self.config.backend_timeout):
                return await anext(stream)
        except TimeoutError:
            await _aclose(stream)
            raise errors.BackendTimeout("The model backend did not answer in time.") from None
        except StopAsyncIteration:
            raise errors.BackendError("The model backend ended the stream without output.") from None
        except errors.HotloopError:
            await _aclose(stream)
            raise
        except Exception:
            await _aclose(stream)
            log.exception("backend failed before the first chunk (request %s)", request_id)
            raise errors.BackendError("The model backend failed.") from None

    def _register(self, run: "Run", entry: CachedResponse, input_bytes: int, calls: frozenset[str]) -> None:
        """Offer a finished response's input to the prefix cache (not when truncation dropped
        items from its front: its input then no longer starts where the client's does)."""
        n = entry.input_len
        if n == 0 or self.prefixes.max_entries <= 0 or run.plan.truncated:
            return
        # the last input item is the plan's last new item, fingerprinted when the turn began
        last = run.plan.last_fp or itemlib.fingerprint(entry.context.items[n - 1])
        raw = run.raw_input
        head = reuse.head_of(raw.raw) if raw is not None else None
        sent = reuse.sent_input(run.prefix, run.sent, n - len(run.prepared.items))
        if raw is None or head is None:
            self.prefixes.put(Prefix(entry, n, last, input_bytes, None, None, calls, sent=sent))
        elif self.prefixes.put(
            Prefix(
                entry, n, last, input_bytes, raw.raw, head, calls, raw.lead, sent, raw.after, raw.request, raw.refs, raw.nrefs,
                raw.checked,
            )
        ) and run.hit is not None:
            # This input's bytes start with those of the input it reused (matched by bytes,
            # never one found by fingerprint, which may be another client's): keeping both would
            # hold every earlier body of the conversation (one per turn, up to the cache's
            # bounds) and make each new body land on fresh, page-faulting memory.
            self.prefixes.drop_raw(run.hit)

    def _evict(self, req: CreateRequest, conn: ConnectionCache | None) -> None:
        # A failed continuation evicts the referenced response from the connection's cache
        # (OpenAI WebSocket mode). Stored responses stay loadable from the store.
        if conn is not None and req.previous_response_id is not None:
            conn.evict(req.previous_response_id, req.stream_id)

    async def complete(self, run: "Run") -> None:
        r = run.turn.response
        if r["status"] in ("completed", "incomplete"):
            input_bytes, input_calls = run.plan.context.nbytes, frozenset(run.plan.context.call_ids)
            entry = finished(run.plan, r, self.tokens.view(run.tenant.id), run.tenant.id)
            if run.prefix is not None and (run.plan.truncated or not stored_base(run.prefix.entry, run.prefix.n, entry)):
                reuse.adopt(entry, run.plan.parent, run.prefix)
            # (else all of a stored response's history was reused: finished() made that response
            # its parent, as the store records it, post.stored_base)
            self._register(run, entry, input_bytes, input_calls)
            nbytes = entry_nbytes(entry)
            if run.conn is not None:
                run.conn.put(entry, run.prepared.req.stream_id, nbytes)
            if entry.store:
                self.responses.put(entry, nbytes)
            run.ledgered = True  # (a store write that then fails makes it failed: not charged again)
            await self.persistence.submit(entry, run.tenant.id, run.plan.flags, name=run.tenant.name)
            self.completed += 1
        else:
            self._evict(run.prepared.req, run.conn)
            if r["status"] == "failed" and r.get("store", True):
                # Stored so that GET and input_items answer for it, as they do for OpenAI's failed
                # responses; nothing caches it for continuing (see resolve), and the usage
                # ledger keeps to responses that completed.
                run.plan.settle()
                entry = finished(run.plan, r, self.tokens.view(run.tenant.id), run.tenant.id)
                await self.persistence.submit(entry, run.tenant.id, ledger=False)


async def _aclose(stream: AsyncIterator[Chunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # closing a broken backend stream must not mask the real error
            log.debug("closing the backend stream failed", exc_info=True)


def _merged(a: dict[str, int], b: dict[str, int] | None) -> dict[str, int] | None:
    """Two tallies of findings per kind added up (``None``: none)."""
    if b:
        a = dict(Counter(a) + Counter(b))
    return a or None


def _kinds(findings: Any, labels: Any) -> str:
    """What a verdict's log line says: the kinds found and how many spans, never the text."""
    if findings:
        counts: dict[str, int] = {}
        for f in findings:
            counts[f.kind] = counts.get(f.kind, 0) + 1
        return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))
    return ", ".join(labels)


def backend_kind(exc: BaseException) -> str:
    """A backend failure's kind (``hotloop_backend_errors_total``)."""
    if isinstance(exc, errors.BackendTimeout):
        return "timeout"
    if isinstance(exc, errors.BackendUnavailable):
        return "unavailable"
    return "error"


# New input with this much text (or more) is classified in the tokenizer thread; see Engine.classify.
CLASSIFY_OFFLOAD_CHARS = 64 * 1024
# Jobs of this many characters (or more) go to the tokenizer thread for large jobs (Engine._offload):
# at most about 0.1 s of counting below it (a run of letters; prose takes a tenth of that).
LARGE_JOB_CHARS = 256 * 1024
# Deferred settings scans (flag policy) that may wait for the tokenizer thread at once. Each holds
# its request's texts, and outlives its client once the request went out (its secret is still
# logged), so clients that send large instructions and leave could otherwise queue them faster
# than one thread clears them (about 5 ms a MB). Past it a scan is skipped, with a warning.
MAX_DEFERRED_SCANS = 64

_T = TypeVar("_T")


def _next_iteration(fn: Callable[[], _T]) -> "asyncio.Future[_T]":
    """``fn()`` in the event loop's next iteration, as a future (not run if it was cancelled by
    then). Scheduled by a task just before it writes a backend request and waits for the answer,
    the work runs while the backend works, off the turn's critical path."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[_T] = loop.create_future()

    def run() -> None:
        if fut.done():  # cancelled by a failed start
            return
        try:
            fut.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - handed to whoever awaits the future
            fut.set_exception(exc)

    loop.call_soon(run)
    return fut


_TERMINAL_CHUNKS = (Finish, Failure)
MAX_REFERENCE_LOOKUPS = 1024  # store look-ups one request may cause (the rest are not found)


class _Watchdog:
    """Backend idle timeout that costs one float store per chunk, not a timer per chunk.

    ``since`` is set while the run waits on the backend and cleared when a chunk arrives. One timer
    fires per idle period; only if the run has been *waiting on the backend* for ``idle`` seconds
    does it expire the enclosing ``asyncio.timeout`` scope, so the cancellation always lands in
    the backend await (time spent sending to a slow client never counts as backend silence).
    """

    __slots__ = ("loop", "idle", "since", "progress", "_scope", "_handle", "_due")

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: float) -> None:
        self.loop = loop
        self.idle = idle
        self.since: float | None = None
        # chunks may also arrive without this run (a lane, see Run._relane): progress() is the
        # loop time of the last such read (PushSlot.read_at), which counts as the backend speaking
        self.progress: Callable[[], float] | None = None
        self._scope: asyncio.Timeout | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0  # the time the timer was set for

    def arm(self, scope: asyncio.Timeout) -> None:
        self._scope = scope
        self._set(self.loop.time() + self.idle)

    def _set(self, due: float) -> None:
        self._due = due
        self._handle = self.loop.call_at(due, self._check)

    def _check(self) -> None:
        since = self.since
        if since is not None and self.progress is not None:
            last = self.progress()
            if last > since:
                since = self.since = last
        # Silent for ``idle`` by the time the timer was set for, or by now if it fires late:
        # expired. Not by the clock alone: uvloop may fire a timer up to 1 ms early, and setting
        # it again for a time already this close would fire at once, again and again.
        if since is not None and since + self.idle <= max(self._due, self.loop.time()) and self._scope is not None:
            self._scope.reschedule(self.loop.time())
            self._handle = None
            return
        self._set((since if since is not None else self.loop.time()) + self.idle)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._scope = None


class Run:
    """One response in flight: iterate it for batches of frames (terminal event last)."""

    def __init__(
        self,
        engine: Engine,
        plan: Plan,
        prepared: Prepared,
        turn: Turn,
        first: Chunk,
        stream: AsyncIterator[Chunk],
        conn: ConnectionCache | None,
        counts: "asyncio.Future[tuple[list[int], list[int]]] | None" = None,
        tenant: Tenant = ANONYMOUS,
        grant: Grant | None = None,
    ) -> None:
        self._counts = counts
        self.verdicts: asyncio.Future[None] | None = None  # Engine._classify_later's, if deferred
        self.tenant = tenant
        self.grant = grant
        self.engine = engine
        self.plan = plan
        self.prepared = prepared
        self.turn = turn
        self._first = first
        self.opening: list[Frame] = []  # response.created and response.in_progress (Engine._opening)
        self._stream = stream
        self.conn = conn
        self.started_cpu = time.thread_time()
        self._steered = False  # steering asked this response to stop at a safe boundary
        self._abort: errors.HotloopError | None = None  # ... or to fail now (abort)
        self._sealed = False  # cached and stored before its terminal event (--store-sync full)
        self.ledgered = False  # its usage went to the ledger with the response (Engine.complete)
        self._cut = False  # ... and cut the backend wait short for either
        self._cut_done = False
        self._watch: _Watchdog | None = None
        self._task: asyncio.Task[Any] | None = None
        self.prefix: Prefix | None = None  # the reused prefix of a full-history input
        self.hit: Prefix | None = None  # ... the registered input its bytes extend (PrefixCache)
        self.raw_input: reuse.RawInput | None = None  # its raw input array to register (pipeline.reuse)
        self.sent: Sent | None = None  # its new items a classifier redacted, as sent (reuse.sent_of)
        # perf_counter at the start and at the end of each stage (hotloop.server.metrics.STAGES)
        self.marks: list[float] = []
        self.ended = 0.0  # perf_counter once cached and handed to the store
        self.left: asyncio.Future[None] | None = None  # resolved once out of the runs; made by who waits (a DELETE)
        self.request_id: str | None = None
        self.failure: str | None = None  # why the backend failed it (hotloop_backend_errors_total)
        # Push delivery: the backend's slot for a synchronous chunk sink, and the client's
        # synchronous send of a batch of frames (set by the WebSocket or SSE streaming loop,
        # which sets it back to None while the client is not taking frames). With both, the backend's read
        # callback hands delta chunks to :meth:`_push`, and their frames go out without a
        # wake-up of this run's task; everything else goes through :meth:`frames`.
        self.push_slot: PushSlot | None = None
        self._emit: Callable[[list[Frame]], None] | None = None
        # The client's send for a batch of deltas alone, if it has one quicker than ``emit``: what
        # the open item's lane is given (set with ``emit``, and used only while ``emit`` is set).
        self.emit_deltas: Callable[[list[Frame]], None] | None = None

    def _uncut(self) -> bool:
        """A backend that turned the steering cancellation into an error of its own: take the
        cancellation back (the run ends steered, not failed) unless the connection is leaving too."""
        self._cut_done = False
        if self._cut:
            self._cut = False
            task = asyncio.current_task()
            self._cut_done = task is not None and task.uncancel() == 0
        return self._cut_done

    def steer(self) -> None:
        """Stop at the next safe output boundary (:attr:`Turn.steerable`) with
        ``response.incomplete`` (reason ``steered``). If the run is waiting on the backend at
        such a boundary the wait ends now and the backend stream is cancelled; otherwise the
        stop comes after the chunk that reaches one (or the response ends on its own)."""
        self._steered = True
        self._relane()
        if self.turn.steerable:
            self._interrupt()

    def abort(self, exc: errors.HotloopError) -> None:
        """End with ``response.failed`` (``exc``) at once: now if the run is waiting on the
        backend, else after the chunk it is handling (or when its client has taken the frames
        already produced)."""
        if self._abort is None and not self.turn.done:
            self._abort = exc
            self._relane()
            self._interrupt()

    def _interrupt(self) -> None:
        watch = self._watch
        task = self._task
        if watch is not None and watch.since is not None and task is not None and not self._cut:
            # The run's task is suspended in the backend await (``since`` is set only there), so
            # the cancellation lands in it, and the run turns it into the steered or failed ending.
            self._cut = True
            task.cancel()

    def _push(self, chunks: list[Chunk]) -> int:
        """Take one backend read's chunks from its read callback (PushSlot): the deltas before
        any terminal chunk, while the client takes frames and nobody is stopping the run; their
        frames are sent at once, in one batch. Called only while the run's task waits on the
        backend (see PushSlot), so the order of frames is the stream's."""
        emit = self.emit
        if emit is None or self._abort is not None or self._steered:
            return 0
        feed = self.turn.feed
        out: list[Frame] = []
        n = 0
        for chunk in chunks:
            if type(chunk) in _TERMINAL_CHUNKS:
                break
            out += feed(chunk)
            n += 1
        watch = self._watch
        if n and watch is not None:
            watch.since = watch.loop.time()  # the backend is not silent
        self._relane()
        if out:
            emit(out)
        return n

    @property
    def emit(self) -> Callable[[list[Frame]], None] | None:
        """The client's synchronous send of a batch of frames (see ``push_slot``)."""
        return self._emit

    @emit.setter
    def emit(self, fn: Callable[[list[Frame]], None] | None) -> None:
        # The same send again (a streaming loop sets it after each batch its client took):
        # nothing to re-lane, since everything else that changes the lane re-lanes itself.
        if fn is not self._emit:
            self._emit = fn
            self._relane()

    def _relane(self) -> None:
        """Offer the backend the open item's lane (``PushSlot.lane``: its plain deltas go to
        the client as events without this run) while this run takes pushed chunks; withdraw it
        otherwise. Called after anything that may change the open item, the turn's numbering or
        whether pushes are taken."""
        slot = self.push_slot
        if slot is None or not slot.lanes:
            return
        lane = None
        emit = self._emit
        if emit is not None and slot.fn is not None and self._abort is None and not self._steered:
            lane = self.turn.lane()
            if lane is not None:
                deltas = self.emit_deltas
                lane.emit = emit if deltas is None else deltas
        old = slot.lane
        if old is not None and old is not lane:
            old.emit = None  # no cycle through the client's closure
        slot.lane = lane

    def _progress(self) -> float:
        """When the backend's last read went through a lane (the idle watchdog's sign of life)."""
        return self.push_slot.read_at if self.push_slot is not None else 0.0

    def _stop(self) -> list[Frame]:
        """The ending a steer or an abort asked for, after an interrupted backend wait."""
        return self.turn.fail(self._abort) if self._abort is not None else self.turn.finish(STEERED)

    @property
    def response(self) -> dict[str, Any]:
        return self.turn.response

    async def _settle(self) -> None:
        """Make the input token counts final (before any terminal event reports usage), and the
        classifiers' states and flags if they ran after the backend request."""
        plan = self.plan
        if self.verdicts is not None:
            verdicts, self.verdicts = self.verdicts, None
            if not verdicts.done():  # shielded: a run cancelled here (the client went away) has
                await asyncio.shield(verdicts)  # still sent its request; its scan goes on and logs
        if not plan.settled:
            counts = await self._counts if self._counts is not None else None
            plan.settle(counts)
            self.turn.input_tokens = plan.input_tokens
            self.turn.cached_tokens = plan.cached_tokens

    def frames(self) -> AsyncGenerator[list[Frame], None]:
        """The response's frames in batches, its terminal event last; with ``--store-sync full``
        the batch holding a stored response's terminal event waits until the write is done."""
        return self._synced() if self.engine.sync else self._frames()

    async def _synced(self) -> AsyncGenerator[list[Frame], None]:
        async with contextlib.aclosing(self._frames()) as frames:
            async for out in frames:
                if self.turn.done and not self._sealed and not await self._seal():
                    # not stored: the client must not be told it completed
                    out = out[:-1] + self.turn.retract(errors.ServerError("The response could not be stored."))
                yield out

    async def _seal(self) -> bool:
        """Cache and store the finished response now, and wait for its write (the store's
        barrier), before its terminal event goes out; false if its write failed (then it is
        taken out of the caches again)."""
        self._sealed = True
        self.marks.append(time.perf_counter())
        engine = self.engine
        persistence = engine.persistence
        before = persistence.seq  # the jobs holding this response's ledger entry come after it
        await engine.complete(self)
        r = self.turn.response
        if r["status"] not in ("completed", "incomplete"):
            return True
        upto = await persistence.flush()  # submitted: the ledger entry, and the response if stored
        rid = str(r["id"])
        put_lost = bool(r.get("store")) and persistence.lost(rid)
        if not put_lost and not persistence.ledger_lost(before, upto):
            return True
        if self.conn is not None:
            self.conn.evict(rid, self.prepared.req.stream_id)
        engine.responses.evict(rid)
        if r.get("store") and not put_lost:
            # stored, though its ledger entry was not: the client is told it failed, so it must
            # not stay stored as completed (retrieved, or continued) either
            try:
                await persistence.delete(rid, None)
            except Exception:  # (StoreBusy: the store still locked) it stays, and says so once
                log.warning("response %s: its ledger entry was not written, and it could not be deleted from the store", rid)
            engine.deleted(rid)
        return False

    async def _frames(self) -> AsyncGenerator[list[Frame], None]:
        turn = self.turn
        engine = self.engine
        engine.runs.add(self)
        if engine.aborting is not None:  # started after the grace ran out: fails at once
            self._abort = engine.aborting
        self._task = asyncio.current_task()
        try:
            if type(self._first) in _TERMINAL_CHUNKS:
                await self._settle()
            yield self.opening + turn.feed(self._first)
            if not turn.done:
                loop = asyncio.get_running_loop()
                watchdog = _Watchdog(loop, engine.config.backend_idle_timeout)
                it = self._stream.__aiter__()
                try:
                    async with asyncio.timeout(None) as scope:
                        watchdog.arm(scope)
                        self._watch = watchdog
                        if self.push_slot is not None:
                            self.push_slot.fn = self._push
                            watchdog.progress = self._progress
                            self._relane()
                        while True:
                            if self._abort is not None:  # aborted while its client took frames
                                await self._settle()
                                yield turn.fail(self._abort)
                                break
                            if self._steered and turn.steerable:
                                # steered while its client took frames, at a safe boundary: it
                                # stops now, not after the backend's next chunk
                                await self._settle()
                                yield turn.finish(STEERED)
                                break
                            watchdog.since = loop.time()
                            try:
                                chunk = await anext(it)
                            except StopAsyncIteration:
                                break
                            except asyncio.CancelledError:
                                if not self._uncut():
                                    raise  # not steering, or the connection is going away as well
                                # steered or aborted while waiting on the backend: its stream is
                                # closed below
                                watchdog.since = None
                                await self._settle()
                                yield self._stop()
                                break
                            finally:
                                # out of the backend await however it ended (a chunk, the stream's
                                # end, its failure): a steer or an abort from now on must not
                                # cancel this task (_interrupt), which may wait in _settle below
                                watchdog.since = None
                            if type(chunk) in _TERMINAL_CHUNKS:
                                await self._settle()
                            out = turn.feed(chunk)
                            if self._abort is not None and not turn.done:
                                await self._settle()
                                out += turn.fail(self._abort)
                            elif self._steered and turn.steerable:
                                await self._settle()
                                out += turn.finish(STEERED)
                            self._relane()
                            if out:
                                yield out
                            if turn.done:
                                break
                    watchdog.disarm()
                except TimeoutError:
                    self.failure = "timeout"
                    await self._settle()
                    yield turn.fail(errors.BackendTimeout("The model backend stopped sending output."))
                except errors.HotloopError as exc:
                    # a steered or aborted run ends as asked, and is no backend failure
                    stopped = self._uncut()
                    if not stopped:
                        self.failure = backend_kind(exc)
                    await self._settle()
                    yield self._stop() if stopped else turn.fail(exc)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    stopped = self._uncut()
                    if not stopped:
                        log.exception("backend stream failed (request %s)", self.request_id)
                        self.failure = "error"
                    await self._settle()
                    yield self._stop() if stopped else turn.fail(errors.BackendError("The model backend failed."))
                else:
                    if not turn.done:
                        self.failure = "ended_early"
                        await self._settle()
                        yield turn.fail(errors.BackendError("The model backend ended the stream early."))
                finally:
                    if self.push_slot is not None:
                        slot = self.push_slot
                        if slot.lane is not None:
                            slot.lane.emit = None
                        slot.fn = slot.lane = None
                    watchdog.disarm()
                    self._watch = None
        finally:
            engine.runs.discard(self)
            left = self.left
            if left is not None and not left.done():
                left.set_result(None)  # out of the engine's runs: cached and submitted, or cut short
            counts = self._counts
            if not turn.done and not self.plan.settled and counts is not None and counts.done():
                # cut short (its client left): its input counted, for what it is charged, if the
                # counts came; never counted here, on the event loop (its estimate is charged)
                if not counts.cancelled() and counts.exception() is None:
                    self.plan.settle(counts.result())
                    turn.input_tokens, turn.cached_tokens = self.plan.input_tokens, self.plan.cached_tokens
            self.release()
            if turn.response["status"] not in ("completed", "incomplete") and not self.ledgered:
                # The backend worked for it (a Run exists once its first chunk came): a response
                # cut short or failed is charged what it used, in the ledger as in its key's TPM
                # budget, with what its classifiers flagged (complete() records the others, with
                # the response)
                record = usage_record({**turn.response, "usage": self.spent()}, self.tenant.id, self.plan.flags, self.tenant.name)
                engine.persistence.charge(record, turn.response.get("id"))  # (named in the log if it comes after close)
            if not turn.done:
                engine.observe(self)  # the transports observe the others, after their last write
            # Once the terminal event exists the response is real: its caching and storage come
            # before anything that may suspend (closing the backend stream), and never suspend
            # themselves in a way a leaving client's cancellation could interrupt (see
            # Persistence.submit), so a client that closes right after the terminal event cannot
            # lose them.
            if not self._sealed:
                self.marks.append(time.perf_counter())
                if turn.done:
                    await engine.complete(self)
            self.ended = time.perf_counter()
            await _aclose(self._stream)

    def release(self) -> None:
        """Free the concurrency slot and correct the token reservation to the real usage (once:
        the first call does it)."""
        grant = self.grant
        if grant is not None and not grant.done:
            grant.finish(int(self.spent()["total_tokens"]))

    def spent(self) -> dict[str, Any]:
        """What this response used: its usage; without one (cut short, or failed before any
        output) its input and the output streamed so far (the input estimated while uncounted)."""
        turn = self.turn
        usage = turn.response.get("usage")
        if usage:
            return usage  # type: ignore[no-any-return]
        if not self.plan.settled:
            turn.input_tokens = self.plan.input_estimate()
        return turn.spent_usage()

    def __del__(self) -> None:
        self.release()  # a run never iterated (its client left first) still frees its slot

    async def drain(self) -> dict[str, Any]:
        """Run to the end without streaming (non-streaming HTTP); the final Response."""
        async with contextlib.aclosing(self.frames()) as frames:
            async for _ in frames:
                pass
        return self.turn.response
