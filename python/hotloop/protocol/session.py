"""One WebSocket-mode connection, sans-I/O: frames in, actions out.

The session parses each client text frame and says what the connection must do next: start a
response on a lane, send an error frame, send a steering event, ask a running response to stop,
or close. It owns every scheduling decision of the connection, and the transport
(``hotloop.server.ws``) only moves frames and runs one task per active lane.

Lanes. The default lane (``stream_id`` absent, ``None`` here) and up to ``max_lanes`` named
lanes. On one lane responses run strictly one after another (FIFO); different lanes run
concurrently, at most ``max_in_flight`` responses at once across all lanes. A ``response.create``
that cannot start yet is queued, never rejected, within the connection's bounds (``max_queued``
responses accepted and not finished, ``queued_bytes`` of their frames checked by the transport).
A lane waiting for a slot takes the next free one in the order lanes started waiting, so a busy
lane cannot starve another. An error frame about a lane's request (or a malformed frame naming
that lane, or none: the default lane) waits behind the lane's running response, so a client
reading one lane's events in order never sees another request's error inside a response.

The transport calls :meth:`Session.started` when a response of a lane exists (its id known,
``response.created`` about to be sent) and :meth:`Session.lane_done` when the lane's response
(or its failure to start) is over; ``lane_done`` answers with what comes next on that lane and
on lanes that were waiting for a slot.

Steering (``response.steer``, beta). Choices the wire contract leaves open:

* Only ``type``, ``previous_response_id`` and ``input`` are accepted; ``input`` is a non-empty
  string or a non-empty list of ``user`` messages (``type`` optional and ``message``; only
  ``type``, ``role``, ``content``; content a string or ``input_text``/``input_image``/
  ``input_file`` parts, each as ``response.create`` validates it). Anything else:
  ``response.steer.failed`` with ``invalid_input``, and the target response is not stopped.
* The target must be this connection's response. Running: accepted (``steer_…`` id) at once and
  the response is asked to stop at a safe output boundary (the transport's run decides where:
  never inside a function call's arguments, and never once the response emitted a function
  call: such a response runs to its own end). At most ``max_pending_steers`` submissions per
  response (``too_many_pending_steers``). Finished: ``response_already_completed`` if it
  completed, ``response_not_active`` if it ended otherwise (incomplete, failed) or is already
  ending (its terminal event was sent). Unknown (or older than the last ``max_known`` responses
  of the connection): ``response_not_found``. A warmup (``generate: false``) response has no
  model output to steer: ``steering_not_supported``.
* When the steered response ends incomplete (steered, or for another reason) or completed
  without open function calls, an automatic successor starts at once on the same lane, in the
  same in-flight slot: the steered response's request with ``previous_response_id`` set to it and
  ``input`` the queued steering input in submission order. Its ``response.created`` commits the
  input; if it cannot be created, each submission comes back in ``response.steer.failed``
  (``successor_creation_failed``) with its id and input. A steered response that *failed*
  returns its submissions the same way.
* Completed with open function calls: ``response.steer.pending`` (``waiting_for_required_input``,
  one ``function_call_output`` stub per call) for each submission, and the input stays queued for
  the lane. The next ``response.create`` on that lane naming that response as
  ``previous_response_id`` gets it prepended to its input, in submission order, and keeps its own
  settings; if that request fails before ``response.created`` (refused on arrival too), the input
  comes back as ``successor_creation_failed``. If the lane moves on instead (its next response
  names another parent or none), the queued input comes back in ``response.steer.failed`` with
  ``response_not_active``; when the connection reaches its age limit first, with
  ``successor_creation_failed``.
* Steering events carry the target response's ``sequence_number`` numbering (the transport takes
  the next number of that response's stream; ``0`` when no response is involved, or when its
  terminal event exists but is not sent yet: see ``finishing``) and its lane's ``stream_id``.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any, Callable, Union

import msgspec

from hotloop import errors
from hotloop.protocol import events as ev
from hotloop.protocol.objects import IdGen
from hotloop.protocol.request import STREAM_ID_RE, CreateRequest, convert_body, decode_item, invalid_stream_id, shown

Lane = Union[str, None]


class Steer(msgspec.Struct):
    """One accepted steering submission."""

    id: str
    previous_response_id: str
    input: Any  # as the client sent it (returned on failure)
    items: list[dict[str, Any]]  # the input as message items (prepended to a continuation)


class RunCreate(msgspec.Struct):
    """Start this response now on ``lane`` (the session already took its in-flight slot)."""

    request: CreateRequest
    mark: float = 0.0  # the transport's CPU clock when the frame arrived (for turn statistics)
    size: int = 0  # bytes of its frame
    steers: list[Steer] = msgspec.field(default_factory=list)  # submissions it commits
    successor_of: str | None = None  # the response it succeeds automatically (steering)
    decoded: Any = None  # what the session's ``decode_create`` returned beside the request
    string_input: bool = False  # its own input was a string (made a message when steers went first)

    @property
    def lane(self) -> Lane:
        return self.request.stream_id


class SendError(msgspec.Struct):
    error: errors.HotloopError
    stream_id: str | None = None
    evict: str | None = None  # the parent a failed continuation names: the cache drops it
    # a refused create that waited behind its lane names this parent: the steering input the
    # lane holds for it (``response.steer.pending``) comes back once the error is sent
    unpend: str | None = None


class SteerEvent(msgspec.Struct):
    """A ``response.steer.*`` event. ``response_id``: the response whose numbering it joins."""

    kind: str  # ev.STEER_ACCEPTED | ev.STEER_PENDING | ev.STEER_FAILED
    previous_response_id: str
    stream_id: str | None = None
    response_id: str | None = None
    steer_id: str | None = None
    input: Any = None  # failed: the input that was not committed
    code: str = ""  # failed: the steering error code
    message: str = ""
    required_input: list[dict[str, Any]] = msgspec.field(default_factory=list)

    def frame(self, seq: int) -> ev.Frame:
        if self.kind == ev.STEER_ACCEPTED:
            assert self.steer_id is not None
            return ev.steer_accepted(seq, self.steer_id, self.previous_response_id)
        if self.kind == ev.STEER_PENDING:
            assert self.steer_id is not None
            return ev.steer_pending(seq, self.steer_id, self.previous_response_id, self.required_input)
        return ev.steer_failed(seq, self.code, self.message, self.previous_response_id, self.input, self.steer_id)


class StopResponse(msgspec.Struct):
    """Ask the running response to stop at its next safe output boundary (it was steered)."""

    response_id: str


class Close(msgspec.Struct):
    code: int
    reason: str = ""


class Ended(msgspec.Struct):
    """How a lane's response ended, as the transport reports it to :meth:`Session.lane_done`.

    ``response_id`` is ``None`` when it never started (an error frame was sent instead; for an
    automatic successor none is: ``refusal`` says why in its steers' ``response.steer.failed``)."""

    response_id: str | None = None
    status: str = ""  # completed | incomplete | failed
    open_calls: list[dict[str, Any]] = msgspec.field(default_factory=list)  # required_input stubs
    refusal: str = ""  # the error message of a successor that could not start


Action = Union[RunCreate, SendError, SteerEvent, StopResponse, Close]

_decode = msgspec.json.Decoder(dict[str, Any]).decode
_decode_wide = msgspec.json.Decoder(dict[str, Any], float_hook=float).decode  # 1e400: inf
# the frame's own fields besides the request's (what receive and _steer read)
_FRAME_FIELDS = frozenset(CreateRequest.__struct_fields__) | {"type", "stream_id", "input", "response_id"}


def _out_of_range(data: str | bytes) -> dict[str, Any] | None:
    """A frame holding a number beyond a double, without the top-level fields it does not know
    (ignored as ever, as the HTTP body's decoder ignores them, number and all); None when a
    field it knows holds such a number. Only after ``_decode`` refused the frame. (A known field
    given twice, out of range then not, is read as its last value, as every duplicate key is
    here; the HTTP body's decoder refuses that one.)"""
    try:
        frame = _decode_wide(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    out = {}
    for key, value in frame.items():
        if not _finite(value):
            if key in _FRAME_FIELDS:
                return None
            continue
        out[key] = value
    return out


def _finite(value: Any) -> bool:
    """Whether no float in a decoded JSON value is infinite (a number beyond a double)."""
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is float:
            if v in (math.inf, -math.inf):
                return False
        elif t is dict:
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
    return True
# Frames from OFFERED_BYTES on are offered to Session.decode_create first (the transport's
# decoder: from FAST_DECODE_BYTES on, one that matches a resent history by its bytes; below,
# one that takes an agent's tools from its cache without decoding them, declining frames
# without tools). Smaller ones are decoded the ordinary way and converted by
# Session.convert_create (the transport's: the tools taken from its cache by their JSON), which
# gives every outcome the ordinary conversion gives. That costs less than the transport's
# decoder for one small tool (3.5 us against 4.2) and more for larger tools (three: 5.7 us
# against 4.9; 14: 16.0 against 7.7), as it decodes the tools it then finds in the cache; the
# frame's size only bounds how large its tools can be.
OFFERED_BYTES = 4 * 1024
FAST_DECODE_BYTES = 16 * 1024

_UNSUPPORTED = {
    ev.CLIENT_INJECT: f"'{ev.CLIENT_INJECT}' is not supported by this server.",
    ev.CLIENT_APPEND: f"'{ev.CLIENT_APPEND}' (the 2026-02-04 beta) is not supported; use "
    f"'{ev.CLIENT_CREATE}' with 'previous_response_id'.",
}

_STEER_FIELDS = frozenset(("type", "previous_response_id", "input"))
_STEER_MESSAGE_FIELDS = frozenset(("type", "role", "content"))
_STEER_PARTS = frozenset(("input_text", "input_image", "input_file"))


class _LaneState:
    __slots__ = ("queue", "running", "response_id", "request", "steers", "ending", "pending_parent", "pending")

    def __init__(self) -> None:
        self.queue: deque[RunCreate | SendError] = deque()  # waiting behind the running response
        self.running = False  # a RunCreate of this lane is out (holding an in-flight slot)
        self.response_id: str | None = None  # the running response, once created
        self.request: CreateRequest | None = None  # its request (a successor inherits it)
        self.steers: list[Steer] = []  # accepted for the running response
        self.ending = ""  # its terminal status once that event was sent (it takes no more steering)
        self.pending_parent: str | None = None  # a completed response waiting for tool output ...
        self.pending: list[Steer] = []  # ... and the steering input queued for its continuation


class Session:
    """State of one connection. ``clock`` is injected: the session never reads time itself."""

    def __init__(
        self,
        *,
        opened_at: float,
        max_age: float = 3600.0,
        max_queued: int = 64,
        max_lanes: int = 32,
        max_in_flight: int = 16,
        max_pending_steers: int = 8,
        max_known: int = 256,
        ids: IdGen | None = None,
        decode_create: Callable[[str], tuple[CreateRequest, Any] | None] | None = None,
        convert_create: Callable[[dict[str, Any]], CreateRequest] | None = None,
        check_steer: Callable[[list[dict[str, Any]]], None] | None = None,
        finishing: Callable[[str], bool] | None = None,
    ) -> None:
        """``decode_create``: a faster decoder the transport may offer for frames of
        OFFERED_BYTES or more (a full-history input matched against cached prefixes by its
        bytes, an agent's tools taken from a cache): it returns the request of a well-formed
        ``response.create`` frame and something the transport wants back in the
        :class:`RunCreate` (``decoded``), or ``None``, and the frame is decoded the ordinary way
        (so every error is the ordinary one). ``convert_create``: what makes the request of a
        ``response.create`` frame decoded the ordinary way, instead of
        :func:`~hotloop.protocol.request.convert_body`, whose outcomes it must give (raising
        only :class:`~hotloop.errors.HotloopError`). ``check_steer``: the turn bounds the
        steered response's successor will be held to, checked on its steering items (those
        pending and a new submission's, as message items) before the submission is accepted
        and cuts the running response; raises :class:`~hotloop.errors.HotloopError`.
        ``finishing``: whether a running response's terminal event exists but may not have been
        sent yet (``--store-sync full`` holds it for the store's write): such a response is
        ending (``response_not_active``), and the reply is numbered ``0``, as a number after
        its terminal event would go out before that event."""
        self.check_steer = check_steer
        self.finishing = finishing
        self.decode_create = decode_create
        self.convert_create = convert_create if convert_create is not None else convert_body
        self.opened_at = opened_at
        self.max_lanes = max_lanes
        self.lanes: set[str] = set()  # named lanes seen (the default lane does not count)
        self._ran: set[str] = set()  # named lanes a response started on (a subset of lanes)
        self.max_age = max_age
        self.max_queued = max_queued
        self.max_in_flight = max(1, max_in_flight)
        self.max_pending_steers = max_pending_steers
        self.max_known = max_known
        self.ids = ids or IdGen()
        self.queued = 0  # responses accepted and not finished (running or waiting)
        self.queued_bytes = 0  # bytes of the frames of waiting (not yet started) responses
        self.in_flight = 0
        self.closing = False  # past the age limit: nothing new starts
        self.closed = False  # the close was said (the last action): nothing more to say
        self._lanes: dict[Lane, _LaneState] = {}
        self._ready: deque[Lane] = deque()  # idle lanes whose next response waits for a slot
        self._active: dict[str, Lane] = {}  # running response id -> lane
        self._known: OrderedDict[str, tuple[Lane, str]] = OrderedDict()  # finished id -> (lane, status)

    # -- lifetime ------------------------------------------------------------------------------

    def expired(self, now: float) -> bool:
        return now - self.opened_at >= self.max_age

    def expire(self) -> list[Action]:
        """The connection reached its age limit (the transport's timer says so, or a frame arrived
        after it): nothing new starts. Every ``response.create`` not started yet is answered on
        its lane (``websocket_connection_limit_reached``), as are those that arrive later: at
        once on a lane with nothing running, else right after the lane's running response (in
        order with the lane's other waiting errors, which are all sent). Running responses
        finish; once the last is done the connection says why it closes (a limit error without
        ``stream_id``) and closes with 1001."""
        if self.closing:
            return []
        return self._close_if_idle(self._begin_closing())

    def _begin_closing(self) -> list[Action]:
        self.closing = True
        self._ready.clear()  # lanes waiting for a slot: answered below, nothing more starts
        out: list[Action] = []
        for lane, st in self._lanes.items():
            # steering input waiting for its continuation (``response.steer.pending``) will not
            # be committed by any response on this connection now: it comes back, as when its
            # continuation fails, before the connection says why it closes
            pending, st.pending_parent, st.pending = st.pending, None, []
            out += [_failed(x, "successor_creation_failed", "The connection is closing.", lane) for x in pending]
            self._refuse_queue(st, lane)
            if not st.running:
                out += self._flush(st)
        return out

    def _refuse_queue(self, st: _LaneState, lane: Lane) -> None:
        """The lane's waiting creates become their refusals, in place (after its running
        response, in order with its waiting errors)."""
        for i, a in enumerate(st.queue):
            if isinstance(a, RunCreate):
                self.queued -= 1
                self.queued_bytes -= a.size
                st.queue[i] = SendError(self.limit_error(), lane)

    def _flush(self, st: _LaneState) -> list[Action]:
        """A closing connection's idle lane: everything that waited behind it, now."""
        out: list[Action] = []
        while st.queue:
            a = st.queue.popleft()
            if isinstance(a, RunCreate):  # (refused by _begin_closing: not expected here)
                self.queued -= 1
                self.queued_bytes -= a.size
                a = SendError(self.limit_error(), a.lane)
            out.append(a)
        return out

    def _close_if_idle(self, out: list[Action]) -> list[Action]:
        """``out``, then (once nothing runs) why the connection closes and the close, once.
        The reason is not repeated when ``out`` just said it on the default lane (the same
        frame)."""
        if self.closing and not self.closed and self.in_flight == 0:
            self.closed = True
            last = out[-1] if out else None
            said = (
                isinstance(last, SendError) and last.stream_id is None
                and isinstance(last.error, errors.ConnectionLimitReached)
            )
            if not said:
                out.append(SendError(self.limit_error()))
            out.append(Close(1001, "connection limit reached"))
        return out

    def limit_error(self) -> errors.HotloopError:
        minutes = self.max_age / 60
        return errors.ConnectionLimitReached(
            f"Responses websocket connection limit reached ({minutes:g} minutes). Create a new "
            "websocket connection to continue."
        )

    @property
    def backlog(self) -> int:
        """Actions waiting behind running responses (the transport stops reading past a bound)."""
        return sum(len(st.queue) for st in self._lanes.values())

    def lane_allowed(self, stream_id: str) -> bool:
        """Whether a request may run on lane ``stream_id``: one the connection has, or a new one
        while it has fewer than ``max_lanes``. A lane counts once a request on it is accepted
        (:meth:`_accept`), and stops counting if that request is refused before it becomes a
        response and none ever ran on it (:meth:`lane_done`): a frame refused for what it holds
        takes none of the slots."""
        return stream_id in self.lanes or len(self.lanes) < self.max_lanes

    def _lane(self, lane: Lane) -> _LaneState:
        st = self._lanes.get(lane)
        if st is None:
            st = self._lanes[lane] = _LaneState()
        return st

    # -- frames --------------------------------------------------------------------------------

    def receive(self, data: str | bytes, now: float) -> list[Action]:
        """Actions for one client frame (binary frames are rejected, as Codex expects text)."""
        if self.closed:
            return []  # the close is on its way: nothing more is sent
        # Past the age limit (closing) every frame is still answered as ever, except that a
        # ``response.create`` is refused (_admit) on its lane instead of starting.
        if isinstance(data, bytes):
            return self._error(
                errors.BinaryFrame("Binary frames are not supported; send JSON text frames."),
                None,
            )
        fast = self.decode_create
        if fast is not None and len(data) >= OFFERED_BYTES and not self.closing:
            got = fast(data)
            if got is not None:
                req, decoded = got
                refused = self._admit(req.stream_id, now)
                if refused is not None:  # [] too: refused, its error queued behind its lane
                    return refused + self._unpend(req.stream_id, req.previous_response_id)
                return self._accept(req, len(data), decoded)
        try:
            frame = _decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if isinstance(exc, msgspec.ValidationError) and str(exc).startswith("Number out of range"):
                # valid JSON, with a number beyond a double (1e400): refused where the request
                # reads it, ignored in a field it does not know, as over HTTP (_out_of_range)
                wide = _out_of_range(data)
                if wide is None:
                    return self._error(errors.InvalidValue("Invalid value: a number in the frame is out of range."), None)
                frame = wide
            else:
                return self._error(errors.InvalidJSON("The frame is not a valid JSON object."), None)
        except RecursionError:
            return self._error(errors.InvalidJSON("The frame's JSON is nested too deeply."), None)
        kind = frame.get("type")
        if kind == ev.CLIENT_PROCESSED:
            return []  # Codex's acknowledgement expects no reply
        if kind == ev.CLIENT_STEER:
            return self._steer(frame)
        stream_id = frame.get("stream_id") if isinstance(frame.get("stream_id"), str) else None
        if kind != ev.CLIENT_CREATE:
            if stream_id is not None and not STREAM_ID_RE.match(stream_id):
                stream_id = None  # names no lane: not echoed (it may be a megabyte long)
            if isinstance(kind, str) and kind in _UNSUPPORTED:
                return self._error(errors.UnsupportedParameter(_UNSUPPORTED[kind], param="type"), stream_id)
            return self._error(
                errors.InvalidValue(
                    f"Invalid 'type': {shown(kind)}. Supported client events are '{ev.CLIENT_CREATE}', "
                    f"'{ev.CLIENT_STEER}' and '{ev.CLIENT_PROCESSED}'.",
                    param="type",
                ),
                stream_id,
            )
        prev = frame.get("previous_response_id")
        prev = prev if isinstance(prev, str) else None
        refused = self._admit(stream_id, now)
        if refused is not None:
            return refused + self._unpend(stream_id, prev)
        try:
            req = self.convert_create(frame)
        except errors.HotloopError as exc:
            return self._error(exc, stream_id, prev) + self._unpend(stream_id, prev)
        return self._accept(req, len(data), None)

    def _unpend(self, stream_id: str | None, prev: str | None) -> list[Action]:
        """A ``response.create`` continuing the lane's pending response (the one its queued
        steering input waits for) was refused before it became a response: the input comes back
        (``successor_creation_failed``) after the refusal, as when the request fails later."""
        st = self._lanes.get(stream_id)
        if st is None or prev is None:
            return []
        if st.running or st.queue:
            # its error waits behind the lane (the last thing queued there), and the lane's
            # running response may still leave input pending for ``prev``: decided once it is sent
            last = st.queue[-1] if st.queue else None
            if isinstance(last, SendError) and last.stream_id == stream_id:
                last.unpend = prev
            return []
        return self._refused_pending(st, stream_id, prev)

    def _refused_pending(self, st: _LaneState, lane: Lane, prev: str) -> list[Action]:
        """The lane's pending steering input, back, if it waits for ``prev`` (whose continuation
        was refused)."""
        if st.pending_parent != prev:
            return []
        pending, st.pending_parent, st.pending = st.pending, None, []
        return [
            _failed(s, "successor_creation_failed", "The request that was to commit this input was refused.", lane)
            for s in pending
        ]

    def _admit(self, stream_id: str | None, now: float) -> list[Action] | None:
        """What refuses one more response on lane ``stream_id`` now (``None``: nothing)."""
        if self.closing or self.expired(now):
            # past the age limit: refused on its lane (one with an invalid id: the default
            # lane's), at once or after the lane's running response
            out = [] if self.closing else self._begin_closing()
            lane = stream_id if stream_id is not None and STREAM_ID_RE.match(stream_id) else None
            return self._close_if_idle(out + self._error(self.limit_error(), lane))
        if stream_id is not None and not STREAM_ID_RE.match(stream_id):
            # An invalid id names no lane, so none is made for it: the error is the default
            # lane's, without the id (as in the guide's example), after that lane's running
            # response like any of its errors.
            return self._error(invalid_stream_id(), None)
        if self.queued >= self.max_queued:
            return self._error(
                errors.QueueFull(
                    f"Too many queued '{ev.CLIENT_CREATE}' events on this connection (limit "
                    f"{self.max_queued}); wait for responses to complete.",
                ),
                stream_id,
            )
        if stream_id is not None and not self.lane_allowed(stream_id):
            return self._error(
                errors.InvalidValue(
                    f"This WebSocket connection has reached its maximum number of distinct stream IDs "
                    f"({self.max_lanes}). Reuse an existing stream_id or open a new WebSocket connection.",
                    param="stream_id",
                    code="websocket_stream_limit_reached",
                ),
                stream_id,
            )
        return None

    def _accept(self, req: CreateRequest, size: int, decoded: Any) -> list[Action]:
        if req.stream_id is not None:
            self.lanes.add(req.stream_id)  # a valid id: _admit refused any other
        self.queued += 1
        return self._submit(RunCreate(req, size=size, decoded=decoded))

    def _error(self, err: errors.HotloopError, stream_id: str | None, evict: str | None = None) -> list[Action]:
        """An error about a request of lane ``stream_id``: now, or behind the lane's response."""
        action = SendError(err, stream_id, evict)
        st = self._lanes.get(stream_id)
        if st is not None and (st.running or st.queue):
            st.queue.append(action)
            return []
        return [action]

    def _submit(self, action: RunCreate) -> list[Action]:
        st = self._lane(action.lane)
        self.queued_bytes += action.size
        if st.running or st.queue:
            st.queue.append(action)  # behind the lane's response (and anything already waiting)
            return []
        if self.in_flight >= self.max_in_flight:
            st.queue.append(action)
            self._ready.append(action.lane)
            return []
        return self._start(st, action)

    def _start(self, st: _LaneState, action: RunCreate) -> list[Action]:
        """Give ``action`` a slot on its (idle) lane; attach the lane's pending steering input."""
        self.in_flight += 1
        self.queued_bytes -= action.size
        st.running = True
        out: list[Action] = []
        if st.pending_parent is not None and action.successor_of is None:
            parent, pending = st.pending_parent, st.pending
            st.pending_parent, st.pending = None, []
            if action.request.previous_response_id == parent:
                action.steers = pending
                action.string_input = isinstance(action.request.input, str)
                action.request = _prepend(action.request, [it for s in pending for it in s.items])
            else:
                for s in pending:
                    out.append(
                        _failed(
                            s,
                            "response_not_active",
                            f"Response '{parent}' is no longer waiting for input on this lane: another "
                            "response started on it.",
                            action.lane,
                        )
                    )
        out.append(action)
        return out

    def _fill(self) -> list[Action]:
        """Start waiting lanes while slots are free (in the order the lanes started waiting)."""
        out: list[Action] = []
        while self._ready and self.in_flight < self.max_in_flight:
            st = self._lanes[self._ready.popleft()]
            out.extend(self._advance(st, ready=True))
        return out

    def _advance(self, st: _LaneState, ready: bool = False) -> list[Action]:
        """The lane is idle: send its waiting errors and start its next response if a slot is free
        (else the lane waits for one)."""
        out: list[Action] = []
        while st.queue:
            head = st.queue[0]
            if isinstance(head, SendError):
                out.append(st.queue.popleft())
                if head.unpend is not None:
                    out.extend(self._refused_pending(st, head.stream_id, head.unpend))
                continue
            if self.in_flight < self.max_in_flight:
                st.queue.popleft()
                out.extend(self._start(st, head))
            elif not ready:
                self._ready.append(head.lane)
            else:
                self._ready.appendleft(head.lane)  # keep its turn
            break
        return out

    # -- the transport's reports ---------------------------------------------------------------

    def started(self, lane: Lane, response_id: str, request: CreateRequest) -> None:
        """A response of ``lane`` exists (``response.created`` is about to be sent)."""
        st = self._lane(lane)
        st.response_id = response_id
        st.request = request
        st.steers = []
        st.ending = ""
        self._active[response_id] = lane
        if lane is not None:
            self._ran.add(lane)

    def in_progress(self, response_id: str) -> bool:
        """Whether ``response_id`` is a response of this connection that has not sent its terminal
        event yet (a continuation of it on another lane cannot start: its output is not known)."""
        if response_id not in self._active:
            return False
        st = self._lanes.get(self._active[response_id])
        return st is not None and st.response_id == response_id and not st.ending

    def ending(self, lane: Lane, status: str) -> None:
        """The lane's response sent its terminal event (``status``): it takes no more steering."""
        st = self._lanes.get(lane)
        if st is not None:
            st.ending = status

    def lane_done(self, lane: Lane, ended: Ended, action: RunCreate) -> list[Action]:
        """``action`` (the lane's running response) is over; what comes next."""
        st = self._lane(lane)
        self.in_flight -= 1
        self.queued -= 1
        st.running = False
        steers, st.steers = st.steers, []
        st.ending = ""
        request = st.request
        st.response_id = st.request = None
        out: list[Action] = []
        rid = ended.response_id
        if rid is None:
            # it never started: the input it was to commit comes back
            why = f" {ended.refusal}" if ended.refusal else ""
            for s in action.steers:
                out.append(_failed(s, "successor_creation_failed", "The response that was to commit this "
                                   f"input could not be created.{why}", lane))
        else:
            self._active.pop(rid, None)
            self._known[rid] = (lane, ended.status)
            while len(self._known) > self.max_known:
                self._known.popitem(last=False)
        if steers:
            assert rid is not None and request is not None
            if self.closing:
                for s in steers:
                    out.append(_failed(s, "successor_creation_failed", "The connection is closing.", lane))
            elif ended.status == "failed":
                for s in steers:
                    out.append(_failed(s, "successor_creation_failed", f"Response '{rid}' failed; no "
                                       "successor was created.", lane))
            elif ended.open_calls:  # (completed or incomplete) with complete calls: their outputs first
                for s in steers:
                    out.append(
                        SteerEvent(
                            ev.STEER_PENDING, s.previous_response_id, lane, rid, s.id, required_input=ended.open_calls
                        )
                    )
                st.pending_parent, st.pending = rid, steers
            else:
                # the automatic successor: same lane, same slot, before anything queued there
                successor = _prepend(
                    msgspec.structs.replace(request, input=[], previous_response_id=rid, generate=None),
                    [it for s in steers for it in s.items],
                )
                self.queued += 1
                self.in_flight += 1
                st.running = True
                out.append(RunCreate(successor, steers=steers, successor_of=rid))
                return out
        if rid is None and lane is not None and lane not in self._ran and not st.queue and st.pending_parent is None:
            # refused before it became a response (the engine's validation, a limit), on a lane
            # no response ever ran on, and nothing else waits there: the lane takes no slot
            self.lanes.discard(lane)
            del self._lanes[lane]
        if self.closing:
            # what waited behind this response (its refusals and errors), then the close if
            # nothing runs any more
            return self._close_if_idle(out + self._flush(st))
        out.extend(self._fill())  # lanes already waiting for a slot go before this lane's next
        out.extend(self._advance(st))
        return out

    # -- steering ------------------------------------------------------------------------------

    def _steer(self, frame: dict[str, Any]) -> list[Action]:
        prev = frame.get("previous_response_id")
        raw_input = frame.get("input")
        target: Lane = None
        st: _LaneState | None = None
        if isinstance(prev, str) and prev in self._active:
            target = self._active[prev]
            st = self._lanes[target]
        elif isinstance(prev, str) and prev in self._known:
            target = self._known[prev][0]
        # its terminal event exists but is still to be sent: a reply numbered after it would
        # go out first, so the reply is numbered 0, as for a response that is over
        finishing = st is not None and not st.ending and self.finishing is not None and self.finishing(str(prev))
        numbered = st is not None and not finishing  # the reply joins the running response's numbering

        def fail(code: str, message: str) -> list[Action]:
            return [
                SteerEvent(
                    ev.STEER_FAILED, prev if isinstance(prev, str) else "", target,
                    prev if numbered else None, input=raw_input, code=code, message=message,
                )
            ]

        extra = sorted(set(frame) - _STEER_FIELDS)
        if extra:
            return fail("invalid_input", f"Unknown parameter: '{errors.clip(extra[0])}'. '{ev.CLIENT_STEER}' accepts only "
                        "'type', 'previous_response_id' and 'input' (the target response determines the lane).")
        if not isinstance(prev, str) or not prev:
            return fail("invalid_input", "Missing required parameter: 'previous_response_id' (a response id).")
        try:
            items = steer_items(raw_input)
        except ValueError as exc:
            return fail("invalid_input", str(exc))
        if st is None:
            if prev in self._known:
                if self._known[prev][1] == "completed":
                    return fail("response_already_completed", f"Response '{errors.clip(prev)}' has completed and no longer "
                                "accepts steering input.")
                return fail("response_not_active", f"Response '{errors.clip(prev)}' is no longer active.")
            return fail("response_not_found", f"Response '{errors.clip(prev)}' is not running on this connection.")
        if st.ending == "completed":
            return fail("response_already_completed", f"Response '{prev}' has completed and no longer accepts "
                        "steering input.")
        if st.ending or finishing or self.closing:
            return fail("response_not_active", f"Response '{prev}' is ending and no longer accepts steering input.")
        assert st.request is not None
        if st.request.generate is False:
            return fail("steering_not_supported", f"Response '{prev}' is a warmup ('generate': false); it has no "
                        "model output to steer.")
        if len(st.steers) >= self.max_pending_steers:
            return fail("too_many_pending_steers", f"Response '{prev}' already has {len(st.steers)} pending "
                        f"steering submissions (limit {self.max_pending_steers}).")
        if self.check_steer is not None:
            # what the successor would add, refused now: accepted, it would cut the running
            # response and its successor would fail to start
            try:
                self.check_steer([*(it for p in st.steers for it in p.items), *items])
            except errors.HotloopError as exc:
                return fail(exc.code or "invalid_input", exc.message)
        s = Steer(self.ids.new("steer"), prev, raw_input, items)
        st.steers.append(s)
        out: list[Action] = [SteerEvent(ev.STEER_ACCEPTED, prev, target, prev, s.id)]
        if len(st.steers) == 1:
            out.append(StopResponse(prev))
        return out


def _failed(s: Steer, code: str, message: str, lane: Lane) -> SteerEvent:
    return SteerEvent(ev.STEER_FAILED, s.previous_response_id, lane, None, s.id, s.input, code, message)


def _prepend(req: CreateRequest, items: list[dict[str, Any]]) -> CreateRequest:
    """``req`` with ``items`` before its own input (a string input becomes a user message)."""
    own = req.input
    if own is None:
        rest: list[Any] = []
    elif isinstance(own, str):
        rest = [{"type": "message", "role": "user", "content": own}]
    else:
        rest = list(own)
    return msgspec.structs.replace(req, input=[*items, *rest])


def steer_items(raw: Any) -> list[dict[str, Any]]:
    """The steering input as message items; ``ValueError`` (the client's message) if invalid."""
    if isinstance(raw, str):
        if not raw:
            raise ValueError("Invalid 'input': expected a non-empty string or a non-empty array of user messages.")
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list) or not raw:
        raise ValueError("Invalid 'input': expected a non-empty string or a non-empty array of user messages.")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"Invalid '{where}': expected a message object.")
        extra = sorted(set(item) - _STEER_MESSAGE_FIELDS)
        if extra:
            raise ValueError(f"Invalid '{where}': unknown field '{errors.clip(extra[0])}'; steering messages may contain only "
                             "'type', 'role' and 'content'.")
        if item.get("type", "message") != "message":
            raise ValueError(f"Invalid '{where}.type': steering accepts only 'message' items.")
        if item.get("role") != "user":
            raise ValueError(f"Invalid '{where}.role': steering accepts only messages with the 'user' role.")
        content = item.get("content")
        if isinstance(content, str):
            pass
        elif isinstance(content, list) and content:
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if not isinstance(kind, str) or kind not in _STEER_PARTS:  # (a list or dict is not hashable)
                    raise ValueError(f"Invalid '{where}.content[{j}]': expected an 'input_text', 'input_image' "
                                     "or 'input_file' part.")
                if part["type"] == "input_text" and not isinstance(part.get("text"), str):
                    raise ValueError(f"Invalid '{where}.content[{j}].text': expected a string.")
        else:
            raise ValueError(f"Invalid '{where}.content': expected a string or a non-empty array of parts.")
        msg = {"type": "message", "role": "user", "content": content}
        try:
            # the item validation of response.create: a steer that would fail its successor's
            # creation is refused here, before it cuts the running response
            decode_item(msg, i)
        except errors.HotloopError as exc:
            raise ValueError(exc.message) from None
        out.append(msg)
    return out
