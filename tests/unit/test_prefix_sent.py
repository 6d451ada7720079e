"""Prefix entries matched by the items as the client sent them (before a classifier redacted
them): exact over the whole prefix, never a mix of sent and cached items, owner-scoped, and
within the cache's entry and byte bounds."""

from __future__ import annotations

from typing import Any

from hotloop.pipeline import items as itemlib
from hotloop.pipeline import reuse
from hotloop.protocol.request import Message, decode_items
from hotloop.state.context import CachedResponse, Context
from hotloop.state.prefix import SENT_BYTES, Prefix, PrefixCache

SECRET = "ghp_" + "A1b2C3d4E5" * 3 + "F6g7H8"
RED = "[REDACTED:github_token]"


def _msgs(texts: list[str]) -> list[Any]:
    return decode_items([{"role": "user", "content": t} for t in texts])


def _prefix(cached: list[str], sent: list[str], owner: str = "alice", rid: str = "r1") -> Prefix:
    """An entry of the ``cached`` items that the client sent as ``sent``."""
    items: list[Any] = [Message(role="user", content=t) for t in cached]
    ctx = Context()
    fps, toks, sizes = itemlib.analyze(items)
    ctx.extend(items, fps, toks, sizes)
    e = CachedResponse({"id": rid}, ctx, len(items), False, owner=owner)
    pairs = reuse.sent_of(_msgs(sent), _msgs(cached))
    return Prefix(e, len(items), fps[-1], ctx.nbytes, sent=reuse.sent_input(None, pairs, 0))


def test_sent_of_names_only_the_changed_items() -> None:
    sent, used = _msgs(["a", SECRET, "c"]), _msgs(["a", RED, "c"])
    used[0], used[2] = sent[0], sent[2]  # a classifier keeps the items it does not change
    pairs = reuse.sent_of(sent, used)
    assert pairs is not None and [j for j, _ in pairs] == [1]
    assert pairs[0][1] == itemlib.fingerprint(sent[1])
    assert reuse.sent_of(sent, sent) is None
    # after a reused prefix, positions in the whole input; the prefix's own are kept
    p = _prefix([RED, "b"], [SECRET, "b"])
    assert reuse.sent_input(p, pairs, 5) == (*p.sent, (6, pairs[0][1]))  # type: ignore[misc]


def test_a_resent_original_hits_the_redacted_entry_as_cached_or_as_sent_but_never_mixed() -> None:
    cache = PrefixCache()
    cache.put(_prefix([RED, "b", "c " + RED], [SECRET, "b", "c " + SECRET], rid="r1"))
    # as sent (the last item redacted: found by the index of items as sent)
    hit = reuse.match(cache, "alice", _msgs([SECRET, "b", "c " + SECRET, "d"]))
    assert hit is not None and hit.n == 3 and hit.entry.id == "r1"
    assert hit.entry.context.items[0].content == RED  # type: ignore[union-attr]  # the cached, redacted items are reused
    # as cached (a client that sends the redacted text itself)
    hit = reuse.match(cache, "alice", _msgs([RED, "b", "c " + RED, "d"]))
    assert hit is not None and hit.n == 3
    # a mix of the two, another secret, another owner: no hit
    assert reuse.match(cache, "alice", _msgs([RED, "b", "c " + SECRET, "d"])) is None
    assert reuse.match(cache, "alice", _msgs([SECRET, "b", "c " + RED, "d"])) is None
    other = SECRET[:-1] + "Z"
    assert reuse.match(cache, "alice", _msgs([other, "b", "c " + SECRET, "d"])) is None
    assert reuse.match(cache, "bob", _msgs([SECRET, "b", "c " + SECRET, "d"])) is None
    assert reuse.match(cache, "bob", _msgs([RED, "b", "c " + RED, "d"])) is None


def test_an_entry_whose_last_item_was_not_redacted_is_found_as_sent_too() -> None:
    cache = PrefixCache()
    cache.put(_prefix([RED, "b"], [SECRET, "b"]))
    hit = reuse.match(cache, "alice", _msgs([SECRET, "b", "c"]))
    assert hit is not None and hit.n == 2
    assert reuse.match(cache, "alice", _msgs(["x", "b", "c"])) is None


def test_a_registration_of_the_same_items_keeps_how_they_were_sent() -> None:
    cache = PrefixCache()
    cache.put(_prefix([RED, "b"], [SECRET, "b"], rid="r1"))
    cache.put(_prefix([RED, "b"], [RED, "b"], rid="r2"))  # the same items, sent as cached
    assert len(cache) == 1
    hit = reuse.match(cache, "alice", _msgs([SECRET, "b", "c"]))
    assert hit is not None and hit.entry.id == "r2"


def test_the_index_of_items_as_sent_stays_within_the_bounds() -> None:
    cache = PrefixCache(max_entries=3)
    for i in range(10):
        cache.put(_prefix([f"{i} {RED}"], [f"{i} {SECRET}"], rid=f"r{i}"))
    assert len(cache) == 3 and len(cache._sent) == 3
    assert reuse.match(cache, "alice", _msgs([f"9 {SECRET}", "x"])) is not None
    assert reuse.match(cache, "alice", _msgs([f"0 {SECRET}", "x"])) is None  # evicted with its entry
    # an entry's fingerprints as sent count in its size, and leave with it
    p = _prefix([RED, "b"], [SECRET, "b"], rid="same")
    plain = _prefix([RED, "b"], [RED, "b"], rid="same")
    assert p.size == plain.size + SENT_BYTES
    cache.clear()
    assert cache.put(p) and cache.nbytes == p.size
    for i in range(PrefixCache.VARIANTS + 3):  # one key of items as sent keeps VARIANTS entries
        cache.put(_prefix([f"{i}", RED], [f"{i}", SECRET], rid=f"v{i}"))
    assert all(len(group) <= PrefixCache.VARIANTS for group in cache._sent.values())
    cache.clear()
    assert cache.nbytes == 0 and not cache._sent
    bounded = PrefixCache(max_entries=100, max_bytes=4 * p.size + 1)
    for i in range(20):
        bounded.put(_prefix([f"{i} {RED}", "b"], [f"{i} {SECRET}", "b"], rid=f"b{i}"))
    assert bounded.nbytes <= bounded.max_bytes
    assert len(bounded._sent) == 0  # (their last items were not redacted: indexed as cached only)
    assert sum(len(g) for g in bounded._d.values()) == len(bounded)
