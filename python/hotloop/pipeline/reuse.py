"""Finding the longest cached prefix of a full-history input (:mod:`hotloop.state.prefix`).

Two ways to a hit, both exact:

* by raw bytes (:func:`split_raw`): the request's ``input`` array starts with the very bytes of a
  registered input, followed by more items. Nothing of the prefix is decoded, validated or
  fingerprinted: the bytes are the ones that produced the cached items last time.
* by fingerprint (:func:`match`): the decoded items are fingerprinted from the probe point down,
  and the whole prefix is compared with the cached chain's fingerprints, so an item that the
  client spells differently (ids, statuses, content as a string or as parts) still matches.
  Items a classifier redacted are matched as cached or as the client sent them (its original
  text, which a client keeping its own history sends again): :func:`sent_of` and
  :func:`sent_input` tell the cache what was sent (:attr:`Prefix.sent`). Either way the hit
  reuses the cached, redacted items, their classifier states and token counts.
"""

from __future__ import annotations

import re
from typing import Any, Awaitable, Callable

import msgspec

from hotloop import errors
from hotloop.pipeline import items as itemlib
from hotloop.pipeline.settings import ToolsCache, tools_decoder
from hotloop.protocol.events import CLIENT_CREATE
from hotloop.protocol.request import (
    MAX_INPUT_ITEMS,
    CreateRequest,
    FunctionCall,
    Item,
    ItemReference,
    Prepared,
    checked_tools,
    convert_body,
    decode_body,
    validate,
)
from hotloop.state.context import CachedResponse, item_id_of, item_nbytes
from hotloop.state.prefix import Checked, Prefix, PrefixCache, Sent

TEMPLATE_MAX_BYTES = 16 * 1024  # body bytes around the input (besides instructions, shared tools) a template may hold decoded
HEAD_BYTES = 256  # leading raw bytes of an input that index its candidates (PrefixCache.by_raw)
_WS = b" \t\r\n"
_OPEN, _CLOSE, _COMMA = ord("["), ord("]"), ord(",")
Buffer = bytes | memoryview  # raw input bytes: views of a request body are kept without a copy


def head_of(raw: Buffer) -> bytes | None:
    """The index key of a raw input (``None``: too short to be matched by bytes)."""
    return bytes(raw[:HEAD_BYTES]) if len(raw) >= HEAD_BYTES else None


def open_array(raw: Buffer) -> memoryview | None:
    """The raw JSON array ``raw`` without its closing bracket and trailing whitespace (what a
    later input that extends it starts with), or ``None`` if it is not a non-empty array. A view
    of ``raw``: an input of hundreds of kilobytes is registered without a copy."""
    i, j = 0, len(raw)
    while i < j and raw[i] in _WS:
        i += 1
    while j > i and raw[j - 1] in _WS:
        j -= 1
    if j - i < 2 or raw[i] != _OPEN or raw[j - 1] != _CLOSE:
        return None
    j -= 1
    while j > i and raw[j - 1] in _WS:
        j -= 1
    return memoryview(raw)[i:j] if j - i > 1 else None


def split_raw(cache: PrefixCache, owner: str, raw: bytes) -> tuple[Prefix, bytes] | None:
    """A registered input that ``raw`` (the request's ``input`` array) extends, and the JSON array
    of the remaining items."""
    r = raw.lstrip(_WS)
    if r[:1] != b"[":
        return None
    head = head_of(r)
    p = cache.by_raw(owner, r, head) if head is not None else None
    if p is None or p.raw is None:
        return None
    rest = r[len(p.raw) :].lstrip(_WS)
    if rest[:1] != b",":
        return None
    return p, b"[" + rest[1:]


def match(cache: PrefixCache, owner: str, items: list[Item]) -> Prefix | None:
    """The longest registered input of ``owner`` whose items are semantically identical to the
    leading items of ``items`` (verified over the whole prefix)."""
    total = len(items)
    if total < 2:
        return None
    fps: list[bytes | None] = [None] * total
    computed = 0  # fps[:computed] are all known

    def fp(i: int) -> bytes:
        v = fps[i]
        if v is None:
            v = fps[i] = itemlib.fingerprint(items[i], f"input[{i}]")
        return v

    for n in cache.lengths(owner):
        if n > total:
            continue
        last = fp(n - 1)
        # as cached, then as sent (a last item that a classifier redacted, sent again as it was)
        group = cache.variants(owner, n, last)
        resent = cache.sent_variants(owner, n, last)
        if not group and not resent:
            continue
        if any(type(it) is ItemReference for it in items[:n]):
            return None
        while computed < n:
            fp(computed)
            computed += 1
        for p in (*group, *resent):
            if p.covers(fps, n) and _same_ids(items, p.entry.context.items, n) and not _clashes(p, n, items, n):  # type: ignore[arg-type]
                return p
    return None


def resolved(items: list[Item], stored: dict[str, Item] | None) -> list[Item] | None:
    """``items`` with each ``item_reference`` replaced by the item it names, as an input without a
    parent resolves it from scratch (:func:`hotloop.pipeline.prepare.prepare`): the first earlier
    item of the input that carries its id, else the stored item of that id (``stored``: what
    :meth:`Engine.stored_items` found). ``items`` itself when it holds no reference; ``None``
    when a reference names neither (from scratch answers for it). The Vercel AI SDK sends its
    earlier reasoning items as references (``store: true``, its default): resolved, its whole
    histories match a cached prefix as the spelled-out ones do (:func:`match`, :func:`continued`)."""
    if not any(type(it) is ItemReference for it in items):
        return items
    out: list[Item] = []
    carried: dict[str, Item] = {}  # the first item of the input carrying each id, so far
    for item in items:
        if type(item) is ItemReference:
            rid = item.id  # type: ignore[union-attr]
            found = carried.get(rid) or (stored.get(rid) if stored else None)
            if found is None:
                return None
            item = found
        iid = item_id_of(item)
        if iid is not None:
            carried.setdefault(iid, item)
        out.append(item)
    return out


def supply(stand_in: CachedResponse, reused: list[Item]) -> None:
    """The ids the ``reused`` items of a request name by ``item_reference`` are supplied ids of
    the response that reuses them (:func:`adopt`), as from scratch, where a resolved reference is
    an item of the request's own input, never one the server minted for it: a later reference to
    such an id resolves only while the response that minted it is stored (deleted, it is
    ``item_not_found`` with or without the prefix cache)."""
    named = {it.id for it in reused if type(it) is ItemReference}  # type: ignore[union-attr]
    if named:
        stand_in.supplied = stand_in.supplied | named


def sent_of(sent: list[Item], used: list[Item]) -> Sent | None:
    """The new items a classifier changed (``sent``: as the client sent them; ``used``: as
    redacted), as ``(index, fingerprint as sent)`` pairs (``None``: none, or one that cannot be
    fingerprinted, which then matches only as cached)."""
    out: list[tuple[int, bytes]] = []
    for j, (a, b) in enumerate(zip(sent, used)):
        if a is not b and a != b:
            try:
                out.append((j, itemlib.fingerprint(a, f"input[{j}]")))
            except errors.HotloopError:
                return None
    return tuple(out) or None


def sent_input(prefix: Prefix | None, new: Sent | None, base: int) -> Sent | None:
    """:attr:`Prefix.sent` of a finished input whose new items start at ``base`` (after the
    reused ``prefix``, if any): the prefix's, then the new items' (:func:`sent_of`)."""
    held = prefix.sent if prefix is not None and prefix.sent else ()
    added = tuple((base + j, fp) for j, fp in new) if new else ()
    return held + added or None


def _same_ids(items: list[Item], own: list[Item], n: int) -> bool:
    """Whether none of the first ``n`` of ``items`` carries an id other than its cached twin's.
    Fingerprints leave ids out (a client may resend items without them), but an item sent with
    an id of its own is that item: reusing the cached one would list and resolve the cached id."""
    for i in range(n):
        iid = item_id_of(items[i])
        if iid is not None and iid != item_id_of(own[i]):
            return False
    return True


def _clashes(p: Prefix, n: int, items: list[Item], start: int = 0) -> bool:
    """Whether an item of ``items[start:]`` (what follows a reuse of the first ``n`` items of
    ``p``'s entry) carries the id of one of those ``n``, or names one (``item_reference``). From
    scratch, a reference resolves to the item of the input itself that carries its id, an id sent
    twice is refused, and an item sent without an id gets a new one; the cached items keep their
    ids (sent then, or minted then), so reusing them would answer such a request otherwise: it
    is not matched there. Only the suffix is scanned (the entry's ids are indexed once)."""
    ctx = p.entry.context
    for i in range(start, len(items)):
        iid = item_id_of(items[i])  # (an item_reference's: the item it names)
        if iid is not None:
            pos = ctx.position(iid)
            if pos is not None and pos < n:
                return True
    return False


def continued(p: Prefix, items: list[Item]) -> tuple[Prefix, int]:
    """``p`` extended over the leading ``items`` that continue its entry's context, and how many
    they are. A client that keeps its own history sends back the output of the response its
    last input produced: those items are the entry's own (same fingerprints), already analysed,
    fingerprinted and counted when the response finished, exactly as a ``previous_response_id``
    continuation reuses them (and, like it, not classified as the client's input). At least one
    item is left to be the request's own."""
    ctx = p.entry.context
    room = min(len(ctx.items) - p.n, len(items) - 1)
    own = ctx.items
    fps: list[bytes] = []
    last: dict[str, int] = {}  # where an id is last carried or named (item_reference) in items
    for j in range(len(items)):
        iid = item_id_of(items[j])
        if iid is not None:
            last[iid] = j
    for j in range(max(0, room)):
        item = items[j]
        if type(item) is ItemReference:
            break
        iid = item_id_of(item)
        mine = item_id_of(own[p.n + j])
        if iid is not None and iid != mine:
            break  # another item than the entry's own, whatever its content (see _same_ids)
        if mine is not None and last.get(mine, j) > j:
            break  # carried or named again later: from scratch, this one is new input (_clashes)
        if item == own[p.n + j]:
            # the entry's own item, field for field (a client that sends back the output it was
            # given, as it was given): its fingerprint is the one the chain holds for it, so it
            # is not encoded and hashed again (cold, that cost 14-23 us a turn at 200 KB)
            fps.append(ctx.chain.fingerprint_at(p.n + j))
            continue
        try:
            fps.append(itemlib.fingerprint(item, f"input[{p.n + j}]"))
        except errors.HotloopError:
            break  # reported against the request by its own analysis
    k = ctx.chain.common_prefix(fps, p.n) if fps else 0
    if k == 0:
        return p, 0
    n = p.n + k
    added = ctx.items[p.n : n]
    nbytes = ctx.nbytes if n == len(ctx.items) else p.nbytes + sum(map(item_nbytes, added))
    calls = None
    if p.calls is not None:
        calls = p.calls | {it.call_id for it in added if type(it) is FunctionCall}  # type: ignore[union-attr]
    return Prefix(p.entry, n, fps[k - 1], nbytes, calls=calls, sent=p.sent), k


def parent_of(p: Prefix) -> CachedResponse:
    """A stand-in parent that holds the reused prefix (never named as the response's parent).
    Its ``supplied`` holds the entry's own client-chosen ids and, once :func:`supply` ran, the
    ids the request named by reference; :func:`adopt` adds the ids the entry inherited
    (:meth:`Prefix.supplied`, a walk of its items: only when the response does not keep the
    entry as its parent)."""
    e = p.entry
    return CachedResponse(e.response, p.context(), p.n, False, None, 0, e.owner, e.supplied, e.states, e.settings)


_INDEX = re.compile(r"input\[(\d+)\]")


def shift(exc: errors.HotloopError, n: int) -> None:
    """An error about the suffix after a prefix of ``n`` items, renumbered to name the item's
    place in the whole input (``input[2]`` of the suffix is ``input[n + 2]``)."""

    def renumber(text: str) -> str:
        return _INDEX.sub(lambda m: f"input[{int(m.group(1)) + n}]", text)

    if exc.param is not None and exc.param.startswith("input["):
        exc.param = renumber(exc.param)
        exc.message = renumber(exc.message)
        exc.args = (exc.message,)


def input_index(param: str | None) -> int | None:
    """The item index a ``param`` names (``input[3].output`` -> 3), if it names one."""
    m = _INDEX.match(param or "")
    return None if m is None else int(m.group(1))


def unshift(exc: errors.HotloopError, n: int) -> None:
    """An error about an input that had ``n`` items put before it (WebSocket steering input,
    prepended to the continuation that commits it), renumbered to name the item's place in the
    input the client sent; one about those ``n`` items keeps their place in the whole."""
    index = input_index(exc.param)
    if index is not None and index >= n:
        shift(exc, -n)


def adopt(entry: CachedResponse, stand_in: CachedResponse | None, prefix: Prefix) -> None:
    """A finished response that reused ``prefix`` and is stored with its whole input (or not
    stored): the reused items are its own, not a parent's. None of their ids is one this
    response minted: a client chose it, or the server minted it for the response the prefix
    came from (or an earlier one). So every id among them counts as chosen here (with those of
    ``stand_in``, :func:`parent_of`): it never resolves as a minted id through this response (an
    ``item_reference``, an admin's look-up across keys), only through the response that minted
    it, while that one is kept; deleted, a reference to it is not found, as from scratch, where
    this response would have minted ids of its own for those items. (One that reused all of a
    stored response's history keeps that response as its parent instead, as
    :func:`prepare.finished` made it: see :func:`hotloop.pipeline.post.stored_base`.)"""
    entry.parent_id = None
    entry.base_len = 0
    chosen = prefix.supplied() | {i for i in map(item_id_of, entry.context.items[: prefix.n]) if i}
    if stand_in is not None and stand_in.supplied:
        chosen = chosen | stand_in.supplied
    if chosen:
        entry.supplied = entry.supplied | chosen


class RawInput:
    """An HTTP request's ``input`` array as the client sent it (``raw``), and the body's bytes
    before it (``lead``; ``None`` when it could not be told for sure). ``prepared``: the request
    that a prefix hit left with only its new items, already validated (:func:`validate`), which
    :meth:`Engine.start` then takes instead of validating it again. ``after``: the body's bytes
    after the array (with ``lead``), and ``request`` what the body decoded to: registered as the
    template of the next body that has the same bytes around its longer input (:func:`_by_body`).
    """

    __slots__ = ("raw", "lead", "prepared", "after", "request", "refs", "nrefs", "by_body", "hit_refs", "checked", "hit_checked")

    def __init__(
        self, raw: Buffer, lead: bytes | None, after: bytes | None = None, request: Any = None,
        refs: dict[str, Item] | None = None, nrefs: int = 0,
    ) -> None:
        self.raw = raw
        self.lead = lead
        self.prepared: Prepared | None = None
        self.after = after if lead is not None else None
        self.request: CreateRequest | None = request
        # the stored items its references named (Prefix.refs), and its references (Prefix.nrefs),
        # when registered
        self.refs = refs or None
        self.nrefs = nrefs
        self.by_body = False  # a raw hit found by the body's bytes (PrefixCache.body_hits)
        # the raw hit's Prefix.refs, taken when it matched: a newer registration may drop them
        # (PrefixCache.drop_raw) before Engine.start checks them
        self.hit_refs: dict[str, Item] | None = None
        # Prefix.checked of its registration, and of the raw hit (taken with hit_refs)
        self.checked: Checked | None = None
        self.hit_checked: Checked | None = None


def registration(raw: RawInput | None, refs: dict[str, Item] | None = None, nrefs: int = 0) -> RawInput | None:
    """What to register by bytes for a finished input: its array without the closing bracket
    (``None``: not registered by bytes). ``refs``: the stored items its ``item_reference`` items
    named, as they resolved (:attr:`Prefix.refs`: a raw hit on it holds only while each still
    resolves to the same item, :func:`still_named`); ``nrefs``: how many such items it holds."""
    if raw is None:
        return None
    opened = open_array(raw.raw)
    if opened is None:
        return None
    req = raw.request
    # the request without its input (its items are the entry's, held by the cache once), when
    # what it holds besides its instructions and shared tools is small (Prefix.size counts those
    # bytes once; decoded, a large schema or unshared tools array holds about ten times them)
    template = None
    if req is not None and raw.after is not None and raw.lead is not None:
        other = len(raw.lead) + len(raw.after) - len(req.instructions or "")
        shared = checked_tools(req.tools)
        if shared is not None:
            other -= len(shared.json)
        if other <= TEMPLATE_MAX_BYTES:
            template = msgspec.structs.replace(req, input=None)
    return RawInput(opened, raw.lead, raw.after, template, refs, nrefs)


def references(items: list[Item]) -> int:
    """How many ``item_reference`` items ``items`` holds (an input may make at most
    ``MAX_REFERENCE_LOOKUPS`` look-ups: a raw hit whose whole input holds more is matched whole,
    as from scratch)."""
    return sum(type(it) is ItemReference for it in items)


def _lead(body: bytes | bytearray, raw: bytes) -> bytes | None:
    """The body's bytes before its ``input`` array (``raw``, the top-level value the decoder
    found), or ``None``: the first ``"input"`` in the body must be a key (a colon follows; inside
    a JSON string a quote is escaped, so a string cannot fake it) followed by ``raw``, and no
    ``"input"`` may follow ``raw``. Then it is the top-level key: had an earlier nested key been
    followed by the same bytes, the top-level key would come after them (the tail check) or
    inside them (impossible: a bracket-balanced array cannot contain itself at an offset).
    Compares in place; a search for ``raw`` in the body would cost about 1 us per KB."""
    i = body.find(b'"input"')
    if i < 0:
        return None
    i += 7
    n = len(body)
    while i < n and body[i] in _WS:
        i += 1
    if body[i : i + 1] != b":":
        return None
    i += 1
    while i < n and body[i] in _WS:
        i += 1
    if not body.startswith(raw, i) or body.find(b'"input"', i + len(raw)) >= 0 or not _plain_after(body, i + len(raw)):
        return None
    return bytes(body[:i])


_KEYS: Any = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _plain_after(body: bytes | bytearray, start: int) -> bool:
    """Whether the body's bytes from ``start`` (just after its input array) hold no other
    ``input`` key. Callers look for the literal bytes; a key spelled with escapes
    (``"\\u0069nput"``) is the same key, and the ordinary decode takes the last one: only a
    decode of those keys tells, needed only where a ``\\u`` escape follows the array."""
    if body.find(b"\\u", start) < 0:
        return True
    rest = bytes(body[start:]).lstrip(_WS)
    if rest[:1] != b",":
        return True  # "}": no key follows
    try:
        return "input" not in _KEYS.decode(b"{" + rest[1:])
    except msgspec.DecodeError:
        return False


def _lazy_struct() -> Any:
    fields: list[Any] = []
    for f in msgspec.structs.fields(CreateRequest):
        if f.name in _LEFT_RAW:
            fields.append((f.name, msgspec.Raw, msgspec.Raw(b"null")))
        elif f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct("LazyCreateRequest", fields, kw_only=True)


# CreateRequest with ``input`` and ``tools`` left as raw JSON bytes: decoding it only scans the
# history, and an agent's tools are decoded once (pipeline.settings), not on every turn.
_LEFT_RAW = ("input", "tools")
_LazyCreateRequest = _lazy_struct()
_lazy_decoder: Any = msgspec.json.Decoder(_LazyCreateRequest)
_asdict = msgspec.structs.asdict
_NULL = b"null"
# What decoding a body the fast way may raise: the body is then decoded the ordinary way
_UNUSUAL = (errors.HotloopError, msgspec.MsgspecError, RecursionError, ValueError, TypeError)


def _with_input(lazy: Any, value: Any, tools: ToolsCache | None, owner: str) -> CreateRequest:
    """The request of a lazily decoded body, with ``value`` as its input and its tools decoded
    (and checked) once per owner and bytes. Raises what decoding or checking the tools raises."""
    fields = _asdict(lazy)  # in C: half the time of a getattr per field
    fields["input"] = value
    raw = fields["tools"]  # msgspec.Raw: its bytes are read through its buffer, not copied
    if len(raw) == 4 and bytes(raw) == _NULL:
        fields["tools"] = None
    else:
        shared = tools.get(owner, raw) if tools is not None else None
        fields["tools"] = shared.tools if shared is not None else tools_decoder.decode(raw)
    return CreateRequest(**fields)


def _longer(cache: PrefixCache, owner: str, n: int, suffix: list[Item]) -> bool:
    """Whether an input registered without these bytes (a chained response's, or one the client
    spelled differently) may extend the raw hit of ``n`` items into ``suffix``: then the request
    is matched by fingerprint instead, which finds the longest prefix."""
    for j, item in enumerate(suffix):
        if type(item) is ItemReference:
            # an input of that length registered with the item it names may be longer: only the
            # engine can tell, resolving the reference (Engine.start, resolved), and it matches
            # by fingerprint. None of that length: the conversation goes on past its last input
            # (the Vercel AI SDK's next step names the reasoning of the response it got).
            if cache.has_length(owner, n + j + 1):
                return True
            continue
        # fingerprinted only where an input of that length exists (a linear conversation has none)
        if cache.has_length(owner, n + j + 1) and cache.has(owner, n + j + 1, itemlib.fingerprint(item, f"input[{n + j}]")):
            return True
    return False


def _by_body(
    cache: PrefixCache, owner: str, body: bytes | bytearray, tools: ToolsCache | None
) -> tuple[CreateRequest, Prefix, RawInput] | None:
    """A body that starts with the very bytes of a registered request up to its last input item
    (same fields before ``input``, same items), then more items: the request decoded from a body
    without those items (only the new ones are decoded, as its ``input``), the hit, and its raw
    input."""
    found = cache.by_body(owner, body)
    if found is None:
        return None
    p, end = found
    lead = p.lead
    size = len(body)
    k = end
    while k < size and body[k] in _WS:
        k += 1
    if k == size or body[k] != _COMMA or lead is None:
        return None
    after, template = p.after, p.template
    if template is not None and after is not None and body.endswith(after):
        # The same bytes before and after the input as the registered request's: the same
        # request with more items. Only the new items are decoded (the registered body had one
        # "input" key, before its items: the bytes after them hold none).
        close = size - len(after)
        while close > k and body[close - 1] in _WS:
            close -= 1
        if close - k > 2 and body[close - 1] == _CLOSE:
            added = msgspec.json.decode(b"[" + memoryview(body)[k + 1 : close])
            if type(added) is list and added:  # ("[A,B, ]" is no JSON: not taken for "[A,B]")
                req = msgspec.structs.replace(template, input=added)
                return req, p, _by_body_input(memoryview(body)[len(lead) : close], lead, after)
    rest = body[k:]
    if b'"input"' in rest:
        return None
    short = lead + b"[" + rest[1:]  # the body without the registered items
    lazy = _lazy_decoder.decode(short)
    tail = len(lazy.input)  # "[" + the new items + "]"
    added = msgspec.json.decode(lazy.input)
    if not added:  # "[A,B, ]": no JSON, which the ordinary decode refuses
        return None
    req = _with_input(lazy, added, tools, owner)
    start = k + 1  # where the new items start in the body
    close = start + tail - 1
    if not _plain_after(body, close) or not body.startswith(memoryview(lazy.input)[1:], start):
        return None  # the input the decoder took is not this array (another, its key spelled with escapes)
    raw = memoryview(body)[len(lead) : close]  # a view: no copy of the history
    return req, p, _by_body_input(raw, lead, bytes(body[close:]))


def _by_body_input(raw: Buffer, lead: bytes, after: bytes) -> RawInput:
    out = RawInput(raw, lead, after)
    out.by_body = True
    return out


def decode_create(
    body: bytes | bytearray, cache: PrefixCache | None, owner: str, tools: ToolsCache | None = None
) -> tuple[CreateRequest, Prefix | None, RawInput | None]:
    """Decode an HTTP body for :meth:`Engine.start`: the request (with only the items after a
    prefix hit as its ``input``), the hit, and the raw ``input`` array to register later.

    A body that repeats a registered request's bytes up to its last input item is decoded
    without them (:meth:`PrefixCache.by_body`); otherwise ``input`` is left raw by the decoder
    and matched by its bytes (:func:`split_raw`). Anything unusual (a decode or validation
    error, ``input`` of another type) is decoded again the ordinary way, so errors are exactly
    :func:`decode_body`'s and :func:`validate`'s. ``tools``: where an owner's tool arrays are
    kept decoded and checked (:mod:`hotloop.pipeline.settings`).
    """
    if cache is None or cache.max_entries <= 0:
        return decode_body(body), None, None
    got = _decode(body, cache, owner, tools)
    return got if got is not None else (decode_body(body), None, None)


def decode_frame(
    frame: str, cache: PrefixCache, owner: str, tools: ToolsCache | None = None
) -> tuple[CreateRequest, tuple[Prefix | None, RawInput | None]] | None:
    """:func:`decode_create` for a WebSocket ``response.create`` frame (the session's
    ``decode_create``): the request and ``(prefix, raw input)``, or ``None`` for any other or
    unusual frame, which the session then decodes the ordinary way (with its own errors)."""
    if cache.max_entries <= 0:
        return None
    got = _decode(frame.encode(), cache, owner, tools)
    if got is None or got[0].type != CLIENT_CREATE:
        return None
    return got[0], (got[1], got[2])


def decode_settings(frame: str, owner: str, tools: ToolsCache) -> CreateRequest | None:
    """A ``response.create`` frame too small to be matched by its bytes but large enough to
    carry a large tools array, decoded with its tools taken from ``tools`` (decoded and checked
    once per owner and bytes, and never decoded here: 7.7 us for a 10 KB frame with 14 tools,
    against 16.0 us by :func:`convert_create`); ``None`` for any other or unusual frame, which
    the session then decodes the ordinary way (with its own errors), as a frame whose ``tools``
    are null or missing is. As with an HTTP body, a field the request does not have is skipped
    unread: a number out of range for a double there is not an error, where the ordinary frame
    decode makes it one."""
    try:
        lazy = _lazy_decoder.decode(frame.encode())
        if lazy.type != CLIENT_CREATE or bytes(lazy.tools) == _NULL:  # no tools: nothing to gain
            return None
        return _unmatched(lazy, bytes(lazy.input), tools, owner)
    except _UNUSUAL:
        return None


def convert_create(frame: dict[str, Any], owner: str, tools: ToolsCache) -> CreateRequest:
    """:func:`convert_body` for a ``response.create`` frame already decoded the ordinary way
    (the session's ``convert_create``, for frames under OFFERED_BYTES), with its tools taken
    from ``tools``: decoded and checked once per owner and JSON (their compact encoding: 0.3 us
    for one tool; 3.5 us in all for a 1.4 KB frame with one tool, against 4.2 us by
    :func:`decode_settings` and 2.0 us for the ordinary conversion, which leaves the tools to be
    checked, scanned and rendered again). The frame's other fields are converted as they are, so
    every outcome is :func:`convert_body`'s: tools that do not check, or anything unusual about
    them, are converted the ordinary way and get the ordinary error."""
    value = frame.get("tools")
    if type(value) is list and value:
        try:
            shared = tools.get(owner, msgspec.json.encode(value))
        except _UNUSUAL:
            shared = None
        if shared is not None:
            req = convert_body({**frame, "tools": None})
            return msgspec.structs.replace(req, tools=shared.tools)
    return convert_body(frame)


def _unmatched(lazy: Any, raw: bytes, tools: ToolsCache | None, owner: str) -> CreateRequest | None:
    """The request of a lazily decoded body whose input (``raw``) is not matched against
    prefixes here; ``None`` for an input of a type the request does not take (the ordinary
    decode then reports it)."""
    value = msgspec.json.decode(raw)
    if value is None or type(value) is str or type(value) is list:
        return _with_input(lazy, value, tools, owner)
    return None


def _suffix(
    req: CreateRequest, prefix: Prefix, raw_input: RawInput, cache: PrefixCache, owner: str
) -> tuple[CreateRequest, Prefix | None, RawInput]:
    """A raw hit's request, whose ``input`` holds the items after the prefix, validated; or, when
    a longer registered input may exist, the whole request, to be matched by fingerprint."""
    p = validate(req)  # the suffix alone; an error is reported against the whole input below
    if _longer(cache, owner, prefix.n, p.items) or _clashes(prefix, prefix.n, p.items):
        # matched by fingerprint in Engine.start, which finds the longest prefix
        raw_input.by_body = False
        return whole(req, raw_input), None, raw_input
    raw_input.prepared = p
    raw_input.hit_refs = prefix.refs
    raw_input.hit_checked = prefix.checked
    cache.raw_hits += 1
    cache.body_hits += raw_input.by_body
    return req, prefix, raw_input


def whole(req: CreateRequest, raw_input: RawInput) -> CreateRequest:
    """A raw hit's request with its whole input again (decoded from its raw bytes)."""
    return msgspec.structs.replace(req, input=msgspec.json.decode(raw_input.raw))


async def still_named(
    refs: dict[str, Item],
    scope: str | None,
    cached: Callable[[str, str | None], tuple[Item, str, float] | None],
    stored: Callable[[str, str | None], Awaitable[Item | None]] | None = None,
    base: Checked | None = None,
) -> tuple[bool, Checked | None]:
    """Whether every reference of a registered input (:attr:`Prefix.refs`) still resolves to the
    item it resolved to then, for a caller of ``scope``: the item of an id as
    :meth:`Engine.stored_items` finds it, among the cached responses (``cached``: the item, the
    response it was found in and when that one expires) or else in the store (``stored``; without
    it, an item the cached responses lack counts as not found). Matched by its bytes, an input's
    references are not resolved again; one whose item was deleted since (or that names another
    now) is answered as from scratch, so the request is then matched with its whole input.
    Beside it, when every one was found among the cached responses, where
    (:data:`~hotloop.state.prefix.Checked`, added to ``base``: where others were found), else
    ``None``."""
    deadline = base[1] if base is not None else float("inf")
    holders: set[str] | None = set(base[0]) if base is not None else set()
    for rid, item in refs.items():
        got = cached(rid, scope)
        if got is None:
            if stored is None:
                return False, None
            holders = None
            found = await stored(rid, scope)
        else:
            found, holder, until = got
            if holders is not None:
                holders.add(holder)
            if until < deadline:
                deadline = until
        if found is None or (found is not item and found != item):
            return False, None
    return True, (frozenset(holders), deadline, scope) if holders is not None else None


def _decode(
    body: bytes | bytearray, cache: PrefixCache, owner: str, tools: ToolsCache | None
) -> tuple[CreateRequest, Prefix | None, RawInput | None] | None:
    """The request of ``body`` with its prefix hit and raw input (``None``: anything unusual)."""
    got = _decoded(body, cache, owner, tools)
    if got is not None and got[2] is not None:
        got[2].request = got[0]  # (registered without its input: registration())
    return got


def _decoded(
    body: bytes | bytearray, cache: PrefixCache, owner: str, tools: ToolsCache | None
) -> tuple[CreateRequest, Prefix | None, RawInput | None] | None:
    try:
        prefix: Prefix | None
        by_body = _by_body(cache, owner, body, tools) if len(cache) else None
        if by_body is not None:
            req, prefix, raw_input = by_body
            suffix = req.input
            if req.previous_response_id is not None or type(suffix) is not list or prefix.n + len(suffix) > MAX_INPUT_ITEMS:
                return None
            return _suffix(req, prefix, raw_input, cache, owner)
        lazy = _lazy_decoder.decode(body)
        raw = bytes(lazy.input)
        if lazy.previous_response_id is not None or raw[:1] != b"[":
            plain = _unmatched(lazy, raw, tools, owner)  # a continuation, or a string input
            return (plain, None, None) if plain is not None else None
        lead = _lead(body, raw)
        raw_input = RawInput(raw, lead, bytes(body[len(lead) + len(raw) :]) if lead is not None else None)
        hit = split_raw(cache, owner, raw)
        prefix, suffix_raw = hit if hit is not None else (None, None)
        if prefix is not None and suffix_raw is not None:
            suffix = msgspec.json.decode(suffix_raw)
            if type(suffix) is not list or prefix.n + len(suffix) > MAX_INPUT_ITEMS:  # (no continuation: above)
                return None
            return _suffix(_with_input(lazy, suffix, tools, owner), prefix, raw_input, cache, owner)
        value = msgspec.json.decode(raw_input.raw)
        if type(value) is not list:
            return None
        return _with_input(lazy, value, tools, owner), None, raw_input
    except _UNUSUAL:
        return None
