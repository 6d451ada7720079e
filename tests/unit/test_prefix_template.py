"""Prefix reuse: a body decoded from its new items alone (a template), its memory, and the byte
bound when an entry takes the fingerprints of items as sent."""

from __future__ import annotations

import gc
import json
import tracemalloc
from typing import Any

import pytest

from hotloop.pipeline import items as itemlib
from hotloop.pipeline import reuse
from hotloop.protocol.request import Message
from hotloop.state.context import CachedResponse, Context
from hotloop.state.prefix import Prefix, PrefixCache
from tests.unit.test_prefix_sent import RED, SECRET, _prefix


def _escaped_dup_body(texts: list[str], dup: list[str]) -> bytes:
    items = json.dumps([{"role": "user", "content": t} for t in texts])
    again = json.dumps([{"role": "user", "content": t} for t in dup])
    return ('{"model":"m","input":' + items + ',"\\u0069nput":' + again + "}").encode()


def _register_as_engine(cache: PrefixCache, body: bytes, texts: list[str], template: bool) -> None:
    """As Engine._register does (``template``: with the bytes after the input and the template,
    the template path; without: the body path that decodes the rest of the body)."""
    _, _, raw = reuse.decode_create(body, cache, "alice")
    reg = reuse.registration(raw)
    assert reg is not None
    e = _entry(texts)
    last = itemlib.fingerprint(e.context.items[-1])
    after, request = (reg.after, reg.request) if template else (None, None)
    cache.put(Prefix(e, len(texts), last, e.context.nbytes, reg.raw, reuse.head_of(reg.raw), None, reg.lead, None, after, request))


@pytest.mark.parametrize("template", [True, False])
def test_a_second_input_key_spelled_with_escapes_wins_as_in_the_ordinary_decode(template: bool) -> None:
    """``"\\u0069nput"`` is the key ``input``; the ordinary decode takes the last of two. The
    body is registered (``_lead`` looks for the literal bytes only) and the next body with the same
    bytes after its first array is decoded as the registered input plus the first array's new
    items: by the template or by the body path without one (``template=False``)."""
    texts = ["x" * 300, "second"]
    cache = PrefixCache()
    _register_as_engine(cache, _escaped_dup_body(texts, texts), texts, template)
    body = _escaped_dup_body(texts + ["third"], texts)
    full = reuse.decode_body(body)
    assert full.input == [{"role": "user", "content": t} for t in texts]
    req, hit, _ = reuse.decode_create(body, cache, "alice")
    got = req.input if hit is None else [*[{"role": "user", "content": t} for t in texts[: hit.n]], *req.input]  # type: ignore[misc]
    assert got == full.input


def _entry(texts: list[str]) -> CachedResponse:
    items: list[Any] = [Message(role="user", content=t) for t in texts]
    ctx = Context()
    fps, toks, sizes = itemlib.analyze(items)
    ctx.extend(items, fps, toks, sizes)
    return CachedResponse({"id": "r"}, ctx, len(items), False, owner="alice")


def test_the_memory_a_template_holds_is_counted_in_the_entrys_size() -> None:
    """A template is the request decoded without its input: with a large ``text.format.schema``
    (here 590 KB of JSON after the input) it holds the schema decoded, about ten times its bytes,
    while ``Prefix.size`` adds only ``len(after)`` for it: the byte bound of the prefix cache
    (128 MiB) then holds several times that much."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
    texts = ["x" * 300, "second"]
    body = json.dumps({"model": "m", "input": [{"role": "user", "content": t} for t in texts],
                       "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}).encode()
    _, _, raw = reuse.decode_create(body, PrefixCache(), "alice")
    reg = reuse.registration(raw)
    assert reg is not None
    del raw
    e = _entry(texts)
    last = itemlib.fingerprint(e.context.items[-1])

    def prefix(template: Any) -> Prefix:
        return Prefix(e, 2, last, e.context.nbytes, reg.raw, reuse.head_of(reg.raw), None, reg.lead, None, reg.after, template)

    counted = prefix(reg.request).size - prefix(None).size
    gc.collect()
    tracemalloc.start()
    try:
        _, _, raw2 = reuse.decode_create(body, PrefixCache(), "alice")
        template = reuse.registration(raw2).request  # type: ignore[union-attr]
        del raw2
        gc.collect()
        with_it = tracemalloc.get_traced_memory()[0]
        del template
        gc.collect()
        held = with_it - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held <= counted + 64 * 1024, f"a template holds {held} bytes, its entry counts {counted} for it"


def test_new_fingerprints_as_sent_given_to_a_kept_entry_stay_within_the_byte_bound() -> None:
    """``PrefixCache.put`` of the same items without raw bytes keeps the entry that has them and
    gives it the new registration's fingerprints as sent (``_resend``): its size grows by
    SENT_BYTES each, and nothing is evicted, so the cache ends above ``max_bytes``."""
    with_raw = _prefix([RED, "b"], [RED, "b"], rid="r1")  # sent as cached: no fingerprints as sent
    with_raw.raw = memoryview(b"[" + b"x" * 300)
    with_raw.head = bytes(with_raw.raw[:256])
    cache = PrefixCache(max_bytes=1 << 30)
    assert cache.put(with_raw)
    i = 0
    while cache.nbytes < 5 * with_raw.size:  # every entry well under a quarter of the bound
        assert cache.put(_prefix([f"filler {i}", f"b{i}"], [f"filler {i}", f"b{i}"], rid=f"f{i}"))
        i += 1
    cache.max_bytes = cache.nbytes  # full
    again = _prefix([RED, "b"], [SECRET, "b"], rid="r1")  # the same items, the secret sent (a chained turn's)
    cache.put(again)
    assert with_raw.sent is not None  # it was given them
    assert cache.nbytes <= cache.max_bytes, (cache.nbytes, cache.max_bytes)
