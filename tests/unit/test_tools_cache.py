"""An agent's tools decoded and checked once per key (pipeline.settings): the same request, the
same errors and the same event bytes as decoding them every time; bounded; scoped per owner."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from hotloop import errors
from hotloop.pipeline import reuse
from hotloop.pipeline.prepare import tools_json
from hotloop.pipeline.settings import EDGE, ToolsCache, entry_bytes
from hotloop.protocol import events as ev
from hotloop.protocol.request import checked_tools, decode_body, validate
from hotloop.state.prefix import PrefixCache


def _tools(n: int = 6, tag: str = "") -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": f"tool_{i}{tag}",
            "description": f"Tool {i}: " + "does a careful thing with the repository. " * 8,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}},
            "strict": False,
        }
        for i in range(n)
    ]


def _body(tools: Any, **more: Any) -> bytes:
    return json.dumps({"model": "m", "instructions": "Be brief.", "tools": tools, "input": "hi", **more}).encode()


def _decode(body: bytes, cache: ToolsCache, owner: str = "alice") -> Any:
    # a prefix cache with room (decode_create then takes the lazy path that the tools cache is on)
    return reuse.decode_create(body, PrefixCache(), owner, cache)[0]


def test_a_request_is_what_decoding_it_gives_and_its_tools_are_shared() -> None:
    cache = ToolsCache()
    body = _body(_tools())
    first = _decode(body, cache)
    again = _decode(_body(_tools(), input=[{"role": "user", "content": "more"}]), cache)
    plain = decode_body(body)
    assert first == plain  # every field, the tools included
    assert (cache.misses, cache.hits, len(cache)) == (1, 1, 1)
    assert again.tools is first.tools  # the same bytes: the same (shared) list
    shared = checked_tools(first.tools)
    assert shared is not None and shared.tools is first.tools
    # validating takes the functions checked once; they are what checking them again gives
    p, q = validate(first), validate(plain)
    assert p.function_tools is shared.functions and p.function_tools == q.function_tools
    assert checked_tools(plain.tools) is None  # an ordinary list is checked as before
    assert tools_json(p) == shared.json == msgspec.json.encode(plain.tools)


def test_the_tools_of_one_key_are_never_another_keys() -> None:
    cache = ToolsCache()
    alice = _decode(_body(_tools()), cache, "alice")
    bob = _decode(_body(_tools()), cache, "bob")
    assert (cache.misses, cache.hits) == (2, 0)
    assert bob.tools is not alice.tools and bob.tools == alice.tools
    assert _decode(_body(_tools()), cache, "bob").tools is bob.tools


@pytest.mark.parametrize(
    "tools",
    [
        _tools() + [_tools()[0]],  # a duplicate name
        _tools() + [{"name": "untyped", "description": "x" * 2000}],  # no type
        _tools() + [{"type": "function", "name": "bad name!", "description": "x" * 2000}],
        _tools() + [{"type": "function", "name": "s", "parameters": {"type": "string"}, "description": "x" * 2000}],
        [*_tools(), 5],  # not an object
        {"not": "an array", "pad": "x" * 2000},
    ],
)
def test_tools_that_fail_are_not_kept_and_fail_as_before(tools: Any) -> None:
    cache = ToolsCache()
    body = _body(tools)

    def outcome(decode: Any) -> tuple[type, str, str | None]:
        with pytest.raises(errors.HotloopError) as info:
            validate(decode(body))
        return type(info.value), info.value.message, info.value.param

    assert outcome(lambda b: _decode(b, cache)) == outcome(decode_body)
    assert len(cache) == 0 and cache.hits == 0
    # and after the valid array is cached, the invalid one still fails the same way
    _decode(_body(_tools()), cache)
    assert outcome(lambda b: _decode(b, cache)) == outcome(decode_body)


def test_small_or_missing_tools_are_decoded_as_before() -> None:
    cache = ToolsCache()
    small = [{"type": "function", "name": "f"}]
    for tools in (None, [], small):
        body = _body(tools)
        assert _decode(body, cache) == decode_body(body)
    assert _decode(b'{"model":"m","input":"x"}', cache).tools is None
    assert len(cache) == 0 and cache.hits == 0


def test_bounded_by_entries_and_bytes() -> None:
    cache = ToolsCache(max_entries=2)
    raws = [msgspec.json.encode(_tools(tag=str(i))) for i in range(3)]
    for raw in raws:
        assert cache.get("o", raw) is not None
    assert len(cache) == 2 and cache.nbytes == entry_bytes(len(raws[1])) + entry_bytes(len(raws[2]))
    cache.get("o", raws[0])  # evicted: decoded again
    assert cache.misses == 4 and cache.hits == 0
    one = entry_bytes(len(raws[0]))  # each of the same size
    by_bytes = ToolsCache(max_bytes=4 * one + one // 2)
    for raw in [msgspec.json.encode(_tools(tag=str(i))) for i in range(6)]:
        by_bytes.get("o", raw)
    assert len(by_bytes) == 4 and by_bytes.nbytes == 4 * one <= by_bytes.max_bytes
    tiny = ToolsCache(max_bytes=one)  # an entry over a quarter of the bound is not kept...
    got = tiny.get("o", raws[0])
    assert got is not None and len(tiny) == 0
    assert checked_tools(got.tools) is got  # ...but its request's validation takes it as checked
    off = ToolsCache(max_entries=0)
    assert off.get("o", raws[0]) is None and len(off) == 0  # the caller decodes them
    assert ToolsCache().get("o", b'[{"type":"function","name":"f"}]') is None  # small: likewise


def test_arrays_alike_at_both_ends_never_get_each_others_result() -> None:
    # Looked up by length and the first and last EDGE bytes: these two share all three and
    # differ in the middle only (a description), so only the comparison of the whole tells them
    # apart.
    cache = ToolsCache()
    a, b = _tools(), _tools()
    b[3]["description"] = b[3]["description"].replace("careful", "helpful")
    ra, rb = msgspec.json.encode(a), msgspec.json.encode(b)
    assert len(ra) == len(rb) and ra[:EDGE] == rb[:EDGE] and ra[-EDGE:] == rb[-EDGE:] and ra != rb
    for raw, tools in ((ra, a), (rb, b), (ra, a), (ra, a), (rb, b)):
        got = cache.get("o", msgspec.Raw(raw))  # as reuse hands it over: no copy first
        assert got is not None and got.tools == tools and got.json == raw
    # they take turns in one entry: a miss each time the other was last, a hit otherwise
    assert (cache.misses, cache.hits, len(cache)) == (4, 1, 1)
    assert cache.nbytes == entry_bytes(len(ra))


def test_response_events_write_shared_tools_as_they_were_encoded() -> None:
    cache = ToolsCache()
    req = _decode(_body(_tools()), cache)
    shared = checked_tools(req.tools)
    assert shared is not None
    response = {"id": "resp_1", "object": "response", "instructions": "Be brief.", "tools": req.tools, "usage": None}
    plain = {**response, "tools": json.loads(json.dumps(req.tools))}  # equal, not shared
    for kind in (ev.CREATED, ev.IN_PROGRESS, ev.COMPLETED):
        assert ev.response_event(kind, 7, response) == ev.event(kind, 7, response=plain)
        assert ev.response_event(kind, 7, plain) == ev.event(kind, 7, response=plain)
    # long instructions, encoded once for a response's events (its memo); the same memo given
    # another response's instructions encodes those
    memo: list[Any] = [None, None]
    for text in ("Be careful \u00e9 \"quoted\"\n" * 200, "Other instructions. " * 100, "short"):
        a = {**response, "instructions": text}
        b = {**plain, "instructions": "".join(text)}  # equal, another object
        for kind in (ev.CREATED, ev.IN_PROGRESS, ev.COMPLETED):
            assert ev.response_event(kind, 3, a, memo) == ev.event(kind, 3, response=b)
            assert ev.response_event(kind, 3, b, memo) == ev.event(kind, 3, response=b)
            assert ev.response_event(kind, 3, a) == ev.event(kind, 3, response=b)
        assert (memo[0] is b["instructions"]) == (len(text) >= ev.LONG_INSTRUCTIONS)


def test_tools_after_a_reused_prefix_are_shared_and_fail_as_before() -> None:
    # A full-history body that repeats a registered one (decoded without its prefix, _by_body),
    # with its tools before or after the input: the tools are the cached ones; invalid ones fail
    # as the ordinary decode does.
    from tests.unit.test_prefix_reuse import _register

    tools = _tools()
    for place in ("before", "after"):
        prefixes, cache = PrefixCache(), ToolsCache()

        def body(texts: list[str], t: Any = tools) -> bytes:
            items = ",".join(json.dumps({"role": "user", "content": x}) for x in texts)
            settings = '"tools":' + json.dumps(t)
            parts = (settings + ',"model":"m","input":[' + items + "]") if place == "before" else ('"model":"m","input":[' + items + "]," + settings)
            return ("{" + parts + "}").encode()

        texts = ["x" * 300, "second"]
        _register(prefixes, body(texts), texts)
        req, hit, _ = reuse.decode_create(body(texts + ["third"]), prefixes, "alice", cache)
        again, hit2, _ = reuse.decode_create(body(texts + ["fourth"]), prefixes, "alice", cache)
        assert hit is not None and hit2 is not None and prefixes.body_hits == 2
        assert req.tools == tools and again.tools is req.tools and checked_tools(req.tools) is not None
        bad = body(texts + ["third"], tools + [tools[0]])  # a duplicate name
        with pytest.raises(errors.HotloopError) as got:
            validate(reuse.decode_create(bad, prefixes, "alice", cache)[0])
        with pytest.raises(errors.HotloopError) as want:
            validate(decode_body(bad))
        assert (type(got.value), got.value.message, got.value.param) == (type(want.value), want.value.message, want.value.param)


@pytest.mark.parametrize("way", ["decode_settings", "convert_create"])
def test_a_frame_with_tools_is_decoded_as_the_session_would(way: str) -> None:
    # Frames under FAST_DECODE_BYTES that carry tools: the request the ordinary conversion gives,
    # the tools from the cache. From OFFERED_BYTES (reuse.decode_settings) anything unusual is
    # declined, then decoded the ordinary way by the session; below (reuse.convert_create, after
    # the ordinary decode) it gets what the ordinary conversion gives.
    from hotloop.protocol.request import convert_body

    cache = ToolsCache()

    def decode(frame: str) -> Any:
        if way == "decode_settings":
            return reuse.decode_settings(frame, "alice", cache)
        return reuse.convert_create(json.loads(frame), "alice", cache)

    frames = [
        {"type": "response.create", "model": "m", "tools": _tools(), "input": "hi", "stream_id": "a"},
        {"type": "response.create", "model": "m", "tools": _tools(), "previous_response_id": "resp_1", "input": [{"role": "user", "content": "x"}]},
        {"type": "response.create", "model": "m", "tools": _tools(), "input": None, "previous_response_id": "resp_1"},
    ]
    shared = None
    for obj in frames:
        frame = json.dumps(obj)
        req = decode(frame)
        assert req is not None and req == convert_body(json.loads(frame))
        shared = shared or req.tools
        assert req.tools is shared and checked_tools(req.tools) is not None
    assert (cache.misses, cache.hits) == (1, 2)
    for obj in (
        {"type": "response.create", "model": "m", "tools": _tools() + [_tools()[0]], "input": "x"},  # duplicate
        {"type": "response.create", "model": "m", "tools": _tools(), "input": 5},
        {"type": "response.create", "model": 5, "tools": _tools(), "input": "x"},
        {"type": "response.create", "model": "m", "tools": {"a": 1}, "input": "x"},
    ):
        frame = json.dumps(obj)
        outcomes = []
        for convert in (convert_body, decode):
            try:
                req = convert(json.loads(frame) if convert is convert_body else frame)
                outcomes.append(None if req is None else (req, checked_tools(req.tools)))  # not shared
            except errors.HotloopError as exc:
                outcomes.append((type(exc), str(exc), exc.param))
        assert outcomes[1] is None if way == "decode_settings" else outcomes[0] == outcomes[1]
    if way == "decode_settings":
        assert decode(json.dumps({"type": "response.steer", "model": "m", "tools": _tools(), "input": "x"})) is None
        assert decode("{not json") is None
    assert len(cache) == 1


_TOOL = {"type": "function", "name": "run", "description": "Run a shell command.",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
_PAD = "p" * 300


def _create(**kw: Any) -> str:
    return json.dumps({"type": "response.create", "model": "m", "input": "hi", "instructions": _PAD, **kw})


_TOOLS_JSON = json.dumps([_TOOL])
_SMALL_FRAMES = [
    (_create(tools=[_TOOL]), True),
    (_create(tools=None), False),
    (_create(tools="x"), False),
    (_create(tools=[1]), False),
    (_create(tools=[_TOOL, _TOOL]), False),  # a duplicate name
    (_create(tools=[{**_TOOL, "name": "bad name!"}]), False),
    (_create(tools=[_TOOL], stream_id="bad id"), True),
    (_create(tools=[_TOOL], stream_id="lane-1", previous_response_id="resp_1"), True),
    (_create(tools=[_TOOL], previous_response_id=5), True),
    (_create(tools=[_TOOL], input=5), True),
    (_create(tools=[_TOOL], input=[{"type": "nope"}]), True),
    (_create(tools=[_TOOL], model=7), True),
    (_create(tools=[_TOOL], unknown_field=1), True),
    (_create(tools=[_TOOL], tool_choice={"type": "function", "name": "zzz"}), True),
    (_create(tools=[{"type": "web_search"}]), False),  # under 128 bytes: not kept
    (json.dumps({"type": "response.steer", "input": "tools" + _PAD, "tools": [_TOOL]}), False),
    (json.dumps({"type": "response.create", "input": _PAD, "tools": [_TOOL]}), True),  # no model
    # numbers out of range: in a field the request does not have (ignored, as over HTTP),
    # shadowed by a later key, in a field it has, in the tools
    (_create(tools=[_TOOL])[:-1] + ', "x": 1e400}', True),
    (_create(tools=[_TOOL])[:-1] + ', "x": 1.8e308}', True),
    (_create(tools=[_TOOL])[:-1] + ', "input": 1e400, "input": "hi"}', True),
    (_create(tools=[_TOOL])[:-1] + ', "temperature": 1e400}', False),
    (_create(tools=[{**_TOOL, "x": 1}]).replace('"x": 1', '"x": ' + "9" * 400 + ".0"), False),
    ('{"type": "response.create", "model": "m", "input": "a", "tools": ' + _TOOLS_JSON + ', "tools": null}', False),
    (_create(tools=[_TOOL])[:-1], False),  # truncated
    ('{"type": "response.create", "model": "m", "input": "x", "tools": [' + "[" * 1900 + "]" * 1900 + "]}", False),
]


def test_small_frames_with_tools_are_answered_as_the_ordinary_conversion_answers_them() -> None:
    """WebSocket frames under OFFERED_BYTES are decoded the ordinary way and converted with
    their tools taken from the tools cache (``reuse.convert_create``, as ``server.ws`` wires it):
    every outcome, a run's request or an error's status, code, param and message, and the
    session's queue, is the one ``convert_body`` gives, and valid tools of 128 bytes or more come
    from the cache (one cache for all the frames: misses, then hits)."""
    from hotloop.protocol.session import OFFERED_BYTES, RunCreate, SendError, Session

    cache = ToolsCache()

    def outcomes(convert: Any, frame: str) -> tuple[list[Any], list[bool]]:
        assert len(frame) < OFFERED_BYTES
        sess = Session(opened_at=0.0, max_age=3600.0, convert_create=convert)
        out: list[Any] = []
        shared: list[bool] = []
        for _ in range(2):  # the second queues behind the first, or is refused as the first
            for a in sess.receive(frame, 1.0):
                if isinstance(a, RunCreate):
                    out.append(("run", a.lane, msgspec.json.encode(a.request), a.size))
                    shared.append(checked_tools(a.request.tools) is not None)
                elif isinstance(a, SendError):
                    out.append(("error", a.stream_id, a.error.status, a.error.code, a.error.param, str(a.error)))
                else:
                    out.append(type(a).__name__)
            out.append((sess.queued, sess.queued_bytes))
        return out, shared

    runs = 0
    for frame, want_shared in _SMALL_FRAMES:
        mine, shared = outcomes(lambda f: reuse.convert_create(f, "owner", cache), frame)
        ordinary, _ = outcomes(None, frame)
        assert mine == ordinary, frame[:200]
        assert all(shared) if want_shared else not any(shared), frame[:200]
        runs += len(shared) if want_shared else 0
    assert runs >= 4 and cache.hits >= 5 and cache.misses >= 1
