"""The process-wide prefix cache: reuse for clients that resend the whole conversation.

A client without ``previous_response_id`` (an HTTP client keeping its own history, a WebSocket
client after a reconnect) sends every earlier item again each turn. When a finished response
completes, its *input* (the items its chain's classifier states describe) is registered here; a
later request of the same owner whose input starts with exactly those items reuses them: the
cached item objects, their fingerprints and token counts in the native chain, their validation
and the classifier states, so only the suffix is analysed.

Matching is exact. Each entry is indexed by ``(owner, length, fingerprint of its last item)``;
a probe is verified against the whole cached chain (:meth:`ItemChain.common_prefix`), so a hash
collision on the index key can never make a wrong hit. A key keeps up to ``VARIANTS`` entries
whose earlier items differ; a registration of the same items replaces the older one, except that
one registered without its raw bytes never replaces one that has them. Entries also keep the raw JSON bytes of
their input items as the client sent them (when the transport has them): a request whose input
bytes start with the same items is matched without decoding or fingerprinting those items.

Owner scoping: every key includes the owner, so one API key can never hit another key's
prefixes (another owner's entries behave as if they did not exist).

Items as sent (redaction): a classifier that redacts (``--secrets redact``) makes the cached items
differ from what the client sent, and a client that keeps its own history sends the original
again next turn. An entry keeps :attr:`Prefix.sent`, the fingerprints of the items the client
sent that differ from the cached ones (position, fingerprint), and is matched *either* by the
cached items' fingerprints *or* by the items as sent, each over the whole prefix
(:meth:`Prefix.covers`); an entry whose last item was redacted is also indexed by that item's
fingerprint as sent (``_sent``, keyed by owner as every index). A hit reuses the cached, redacted
items: only the client's own earlier input matches them, and they are what it became.

A registration's raw bytes are a view of its request body. When a newer registration extends the
input a request reused, the older entry gives its bytes up (:meth:`PrefixCache.drop_raw`) and is
matched by fingerprint from then on: a conversation holds one body, not one per turn.

Bounds (DESIGN principle 8): LRU by entries (default 512) and by bytes (default 128 MiB; an entry
larger than a quarter of it is not cached). An entry's size is its context's
:attr:`~hotloop.state.context.Context.nbytes` plus its raw bytes: entries of one conversation
share their item objects, so the total over-counts what is held (the safe direction). Fingerprints
as sent count SENT_BYTES each; the ``_sent`` index holds only registered entries (at most
``VARIANTS`` per key), so it stays within the same entry and byte bounds.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any
from hotloop.protocol.request import FunctionCall
from hotloop.state.context import CachedResponse, Context, entry_nbytes, item_id_of

# Trailing bytes of a registered input compared first: inputs that share their leading bytes
# (one agent's instructions, tools and first messages, sent by all its conversations) end
# differently, so all but the right one are told apart in TAIL bytes, not in a compare of
# everything they share.
TAIL = 64

# What one fingerprint as sent (Prefix.sent) holds: a (position, 16-byte fingerprint) tuple (56
# bytes), its bytes object (49), its int (28) and the pointer to it (8), rounded up
SENT_BYTES = 160

#: Fingerprints of the items a client sent that differ from the cached ones: (position, fingerprint)
#: pairs, by position.
Sent = tuple[tuple[int, bytes], ...]

#: Where a registered input's references were all found among the cached responses
#: (:attr:`Prefix.checked`): the ids of the responses they were found in, the earliest expiry of
#: those, and the scope they were looked up for.
Checked = tuple[frozenset[str], float, str | None]


class Prefix:
    """One registered input: the first ``n`` items of ``entry.context`` (its input).

    ``last_fp`` is the fingerprint of item ``n - 1``; ``nbytes`` the size of those ``n`` items
    (:attr:`Context.nbytes` of the input); ``raw`` the JSON array the client sent without its
    closing bracket (``b'[{..},{..}'``), or ``None``; ``head`` its leading raw bytes (the index key of ``raw``);
    ``lead`` the body's bytes before that array (``{"model":..,"input":``), or ``None``;
    ``sent`` the fingerprints of the items as the client sent them where they differ from the
    cached ones (a classifier redacted them; positions below ``n``), or ``None``; ``refs``
    (with ``raw``) the stored items its ``item_reference`` items named, by id, as they resolved
    when it was registered: a raw hit holds only while each still resolves to the same item
    (:func:`hotloop.pipeline.reuse.still_named`), or ``None``; ``nrefs`` how many
    ``item_reference`` items it holds; ``checked`` (with ``refs``), where each of ``refs`` was
    found among the cached responses (:data:`Checked`), or ``None``: while those responses are
    all still cached and none has expired, a look-up would find the same items there, so a raw
    hit need not look them up again. (By id: a response the cache let go and took back from the
    store holds equal items, its ids minted once, and equal is what a look-up asks of them.)
    """

    __slots__ = (
        "entry", "n", "last_fp", "nbytes", "raw", "head", "owner", "calls", "lead", "tail", "sent", "after", "template", "refs",
        "nrefs", "checked",
    )

    def __init__(
        self,
        entry: CachedResponse,
        n: int,
        last_fp: bytes,
        nbytes: int,
        raw: bytes | memoryview | None = None,
        head: bytes | None = None,
        calls: frozenset[str] | None = None,
        lead: bytes | None = None,
        sent: Sent | None = None,
        after: bytes | None = None,
        template: Any = None,
        refs: dict[str, Any] | None = None,
        nrefs: int = 0,
        checked: Checked | None = None,
    ) -> None:
        self.entry = entry
        self.n = n
        self.last_fp = last_fp
        self.nbytes = nbytes
        self.raw = raw
        # the last bytes of ``raw``: a candidate whose tail is not where its end would be in a
        # probe is rejected without comparing the bytes before it (see PrefixCache.by_body)
        self.tail = bytes(raw[-TAIL:]) if raw is not None else b""
        self.head = head
        self.owner = entry.owner
        self.calls = calls  # call ids of the n items (None: found by walking them)
        # the HTTP body's bytes before the input array (with ``raw``: the body up to the last item)
        self.lead = lead if raw is not None else None
        # the body's bytes after the input array, and the request decoded from that body without
        # its input (a CreateRequest with ``input=None``): a later body with the same lead and the
        # same bytes after its input is the same request with more items (reuse._by_body)
        self.after = after if self.lead is not None and template is not None else None
        self.template = template if self.after is not None else None
        self.sent = tuple(x for x in sent if x[0] < n) or None if sent else None
        self.refs = refs if raw is not None and refs else None
        self.nrefs = nrefs  # its item_reference items (with the same one named twice counted twice)
        self.checked = checked if self.refs is not None else None

    @property
    def sent_last(self) -> bytes | None:
        """The fingerprint of item ``n - 1`` as the client sent it, when a classifier changed it."""
        sent = self.sent
        return sent[-1][1] if sent and sent[-1][0] == self.n - 1 else None

    def covers(self, fps: list[bytes], n: int) -> bool:
        """Whether ``fps`` (at least ``n``) are the fingerprints of the first ``n`` items, either
        all as cached or all as the client sent them (never a mix of the two)."""
        chain = self.entry.context.chain
        if chain.common_prefix(fps[:n]) >= n:
            return True
        i = 0
        for j, fp in self.sent or ():
            if j >= n:
                break
            if fps[j] != fp or (j > i and chain.common_prefix(fps[i:j], i) < j - i):
                return False
            i = j + 1
        return i > 0 and (i >= n or chain.common_prefix(fps[i:n], i) >= n - i)

    @property
    def size(self) -> int:
        # a raw view holds the whole request body it was cut from, as allocated (a body read
        # directly has room beyond its length: httpproto.BODY_STEP)
        raw = self.raw
        held = 0 if raw is None else raw.obj.__sizeof__() if type(raw) is memoryview else len(raw)  # type: ignore[union-attr]
        # the entry as the caches of responses count it (its Response object too: its echoed
        # instructions and tools once held about 4 times what was counted here)
        lead = len(self.lead) if self.lead is not None else 0
        template = self.template
        if self.after is not None and template is not None:  # (its tools: the owner's shared ones, pipeline.settings)
            lead += len(self.after) + len(template.instructions or "")
        # (a reference's item is one of the entry's items: its dict slot is counted, not the item)
        refs = len(self.refs) * SENT_BYTES if self.refs else 0
        checked = self.checked
        if checked is not None:  # its set of holder ids (the ids themselves are the cache's keys)
            refs += checked[0].__sizeof__()
        return entry_nbytes(self.entry) + held + lead + (len(self.sent) * SENT_BYTES if self.sent else 0) + refs

    def context(self) -> Context:
        """A fresh context of the ``n`` reused items (shared item objects, a copied chain)."""
        ctx = self.entry.context
        chain = ctx.chain.copy()
        chain.truncate(self.n)
        items = ctx.items[: self.n]
        if self.calls is not None:
            calls = set(self.calls)
        else:
            calls = {it.call_id for it in items if type(it) is FunctionCall}  # type: ignore[union-attr]
        return Context(items, chain, calls, self.nbytes, ids_from=ctx)

    def supplied(self) -> frozenset[str]:
        """Ids among the reused items that a client chose (conservatively: every id of items the
        entry inherited from a parent counts as chosen, so it never resolves as a minted one)."""
        e = self.entry
        if e.parent_id is None:
            return e.supplied
        inherited = {i for i in map(item_id_of, e.context.items[: min(e.base_len, self.n)]) if i}
        return e.supplied | inherited


def _same_items(a: Prefix, b: Prefix) -> bool:
    """Whether two registrations of one index key hold the same items (their chains agree on
    all ``n`` fingerprints; a key names only the last one)."""
    n = a.n
    if b.n != n:
        return False
    return a.entry is b.entry or a.entry.context.chain.common_prefix(b.entry.context.chain.fingerprints()[:n]) >= n


BODY_KEY = 256  # leading bytes of an HTTP body that index the registered requests it may repeat


def _body_key(p: Prefix) -> tuple[str, bytes]:
    """The ``_bodies`` index key of a registration with raw bytes and a lead (its first
    BODY_KEY bytes, taken without joining the lead, often tens of KB, to the raw input)."""
    lead = p.lead
    assert lead is not None and p.raw is not None
    if len(lead) >= BODY_KEY:
        return p.owner, lead[:BODY_KEY]
    return p.owner, lead + bytes(p.raw[: BODY_KEY - len(lead)])


def _unlist(index: dict[tuple[str, bytes], list[Prefix]], key: tuple[str, bytes], p: Prefix) -> None:
    lst = index.get(key)
    if lst is not None:
        lst[:] = [q for q in lst if q is not p]
        if not lst:
            del index[key]


class PrefixCache:
    """Owner-scoped LRU of registered inputs, bounded by entries and bytes."""

    # Entries kept per (owner, leading raw bytes): forks of one conversation, and conversations
    # that start alike (one agent's instructions, tools and first messages); the rest are still
    # found by fingerprint. A lookup scans them (each ruled out by its TAIL: about 0.5 us here).
    MAX_HEADS = 256
    # Entries kept per index key (owner, length, last item's fingerprint): conversations that
    # differ earlier but reach the same length with the same last item (the same scripted turns
    # against a model that answered differently) each keep theirs instead of evicting each other
    # every turn. A registration of the same items replaces the older one.
    VARIANTS = 4

    def __init__(self, max_entries: int = 512, max_bytes: int = 128 * 1024 * 1024) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        # index key -> its entries, newest first; LRU over keys
        self._d: OrderedDict[tuple[str, int, bytes], list[Prefix]] = OrderedDict()
        self._heads: dict[tuple[str, bytes], list[Prefix]] = {}
        self._bodies: dict[tuple[str, bytes], list[Prefix]] = {}  # by the body's leading bytes
        # (owner, length, fingerprint of the last item as sent) -> the registered entries whose
        # last item a classifier changed (Prefix.sent_last), newest first, at most VARIANTS
        self._sent: dict[tuple[str, int, bytes], list[Prefix]] = {}
        self._lengths: dict[str, dict[int, int]] = {}  # owner -> length -> entries of that length
        self._count = 0
        self._bytes = 0
        self.hits = 0  # requests that reused a prefix: raw_hits of them found by raw bytes,
        self.raw_hits = 0  # body_hits of those by the body's bytes (by_body)
        self.body_hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._bytes

    def with_bytes(self) -> int:
        """How many entries hold raw bytes (a request body each); O(entries)."""
        return sum(1 for group in self._d.values() for p in group if p.raw is not None)

    def put(self, prefix: Prefix) -> bool:
        """Register ``prefix``; whether it is now registered (not when it is too large, or when
        an entry of the same items that has raw bytes is kept instead of it)."""
        if prefix.n <= 0 or self.max_entries <= 0:
            return False
        size = prefix.size
        if size > self.max_bytes // 4:
            return False
        key = (prefix.owner, prefix.n, prefix.last_fp)
        for old in self._d.get(key, ()):
            if _same_items(old, prefix):
                if prefix.raw is None and old.raw is not None:
                    # The same input again, registered without its bytes (a chained response's,
                    # a small WebSocket frame's): the entry that has them serves both ways of
                    # matching. Replacing it would send every later request of the conversation
                    # matched by its bytes to a full decode and fingerprint match.
                    self._d.move_to_end(key)
                    if prefix.sent is not None and prefix.sent != old.sent:
                        self._resend(old, prefix.sent)  # the items as last sent
                        self._evict()  # (it grew by SENT_BYTES each)
                    return False
                if prefix.sent is None and old.sent is not None:
                    # the same items (sent as cached this time): how they were sent before
                    # still names them
                    prefix.sent = old.sent
                    size = prefix.size
                self._remove(key, old)
                break
        group = self._d.get(key)
        if group is None:
            group = self._d[key] = []
        group.insert(0, prefix)
        self._d.move_to_end(key)
        self._count += 1
        self._bytes += size
        lengths = self._lengths.setdefault(prefix.owner, {})
        lengths[prefix.n] = lengths.get(prefix.n, 0) + 1
        if prefix.head is not None:
            lst = self._heads.setdefault((prefix.owner, prefix.head), [])
            lst.insert(0, prefix)
            del lst[self.MAX_HEADS :]
        if prefix.lead is not None and prefix.raw is not None:
            lst = self._bodies.setdefault(_body_key(prefix), [])
            lst.insert(0, prefix)
            del lst[self.MAX_HEADS :]
        self._index_sent(prefix)
        while len(group) > self.VARIANTS:
            self._remove(key, group[-1])
        self._evict()
        return any(q is prefix for q in self._d.get(key, ()))  # not evicted by its own bounds

    def _evict(self) -> None:
        """The least recently used entries leave until the cache is within its bounds."""
        while self._count > self.max_entries or self._bytes > self.max_bytes:
            oldest = next(iter(self._d))
            self._remove(oldest, self._d[oldest][-1])

    def _index_sent(self, p: Prefix) -> None:
        last = p.sent_last
        if last is not None:
            lst = self._sent.setdefault((p.owner, p.n, last), [])
            lst.insert(0, p)
            del lst[self.VARIANTS :]  # (an entry left out is still found by its cached items)

    def _resend(self, p: Prefix, sent: Sent) -> None:
        """Give the registered ``p`` the fingerprints ``sent`` (those of a newer registration of
        the same items), re-indexed and accounted."""
        self._unindex_sent(p)
        size = p.size
        p.sent = tuple(x for x in sent if x[0] < p.n) or None
        self._bytes += p.size - size
        self._index_sent(p)

    def _unindex_sent(self, p: Prefix) -> None:
        last = p.sent_last
        if last is not None:
            key = (p.owner, p.n, last)
            lst = self._sent.get(key)
            if lst is not None:
                lst[:] = [q for q in lst if q is not p]
                if not lst:
                    del self._sent[key]

    def drop_raw(self, p: Prefix) -> None:
        """Forget the raw bytes of ``p`` (a registered input that a newer registration of the
        same conversation extends), keeping the entry: it is then matched by fingerprint only,
        as a fork or a retry from that point is. Releases the request body its bytes were cut
        from: a conversation keeps one body, not one per turn."""
        if p.raw is None:
            return
        group = self._d.get((p.owner, p.n, p.last_fp))
        if group is None or not any(q is p for q in group):
            return  # no longer registered: the cache holds nothing of it
        size = p.size
        self._unindex(p)
        # (a request that matched its bytes before took its refs then: RawInput.hit_refs)
        p.raw = p.lead = p.head = p.after = p.template = p.refs = p.checked = None
        self._bytes -= size - p.size

    def _remove(self, key: tuple[str, int, bytes], p: Prefix) -> None:
        group = self._d[key]
        group.remove(p)
        if not group:
            del self._d[key]
        self._count -= 1
        self._bytes -= p.size
        lengths = self._lengths[p.owner]
        left = lengths[p.n] - 1
        if left:
            lengths[p.n] = left
        else:
            del lengths[p.n]
            if not lengths:
                del self._lengths[p.owner]
        self._unindex(p)
        self._unindex_sent(p)

    def _unindex(self, p: Prefix) -> None:
        """Take ``p`` out of the indexes by its bytes (``_heads``, ``_bodies``)."""
        if p.head is not None:
            _unlist(self._heads, (p.owner, p.head), p)
        if p.lead is not None and p.raw is not None:
            _unlist(self._bodies, _body_key(p), p)

    def clear(self) -> None:
        self._d.clear()
        self._heads.clear()
        self._bodies.clear()
        self._sent.clear()
        self._lengths.clear()
        self._count = 0
        self._bytes = 0

    def lengths(self, owner: str) -> list[int]:
        """Registered input lengths of ``owner``, longest first."""
        return sorted(self._lengths.get(owner, ()), reverse=True)

    def has_length(self, owner: str, n: int) -> bool:
        """Whether any input of ``n`` items of ``owner`` is registered."""
        lengths = self._lengths.get(owner)
        return lengths is not None and n in lengths

    def has(self, owner: str, n: int, last_fp: bytes) -> bool:
        """Whether an input of ``n`` items ending with ``last_fp`` (as cached or as sent) is
        registered (no LRU touch)."""
        key = (owner, n, last_fp)
        return key in self._d or key in self._sent

    def variants(self, owner: str, n: int, last_fp: bytes) -> list[Prefix]:
        """The registered inputs of ``n`` items ending with ``last_fp``, newest first (the caller
        verifies which, if any, holds its items)."""
        key = (owner, n, last_fp)
        group = self._d.get(key)
        if group is None:
            return []
        self._d.move_to_end(key)
        return group

    def sent_variants(self, owner: str, n: int, last_fp: bytes) -> list[Prefix]:
        """The registered inputs of ``n`` items whose last item, as the client sent it, had the
        fingerprint ``last_fp`` before a classifier changed it; newest first (the caller verifies
        which, if any, holds its items: :meth:`Prefix.covers`)."""
        group = self._sent.get((owner, n, last_fp))
        if not group:
            return []
        for key in {(owner, n, p.last_fp) for p in group}:
            self._d.move_to_end(key)  # (registered: _remove takes an entry out of _sent too)
        return list(group)

    def by_body(self, owner: str, body: bytes | bytearray) -> tuple[Prefix, int] | None:
        """The longest registered request of ``owner`` whose body bytes up to its last input item
        ``body`` starts with, and where those bytes end in ``body``."""
        best: Prefix | None = None
        end = 0
        size = len(body)
        for p in self._bodies.get((owner, bytes(body[:BODY_KEY])), ()):
            lead, raw = p.lead, p.raw
            if lead is None or raw is None or (best is not None and p.n <= best.n):
                continue
            e = len(lead) + len(raw)
            tail = p.tail
            if e < size and body.startswith(tail, e - len(tail)) and body.startswith(lead) and body.startswith(raw, len(lead)):
                best, end = p, e
        if best is not None:
            self._d.move_to_end((best.owner, best.n, best.last_fp))
            return best, end
        return None

    def by_raw(self, owner: str, raw: bytes, head: bytes) -> Prefix | None:
        """The longest registered input of ``owner`` whose raw bytes ``raw`` (the incoming JSON
        array) starts with, followed by another item (a ``,``)."""
        best: Prefix | None = None
        for p in self._heads.get((owner, head), ()):
            r = p.raw
            if r is None or (best is not None and p.n <= best.n):
                continue
            e = len(r)
            tail = p.tail
            if raw[e : e + 1] == b"," and raw.startswith(tail, e - len(tail)) and raw.startswith(r):
                best = p
        if best is not None:
            self._d.move_to_end((best.owner, best.n, best.last_fp))
        return best
