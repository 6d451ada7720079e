"""Every native accelerator against its pure twin (asv).

Each class's ``setup`` checks the implementation's result against a reference before timing
(DESIGN principle 10); a wrong implementation makes the benchmark fail instead of looking fast.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import msgspec

from hotloop import _accel, _pure

IMPLS: dict[str, dict[str, Any]] = _accel.implementations()  # raises if the build is broken
IMPL_NAMES = ["native", "pure"]


def _message_item(i: int, text_len: int = 2000) -> dict[str, Any]:
    text = ("The quick brown fox jumps over the lazy dog. \u00e9\u4e2d\n" * 60)[:text_len]
    return {
        "type": "message",
        "id": f"msg_{i:06d}",
        "role": "user" if i % 2 else "assistant",
        "status": "completed",
        "content": [{"type": "input_text", "text": text, "annotations": []}],
    }


def _tool_item(i: int) -> dict[str, Any]:
    return {
        "type": "function_call",
        "call_id": f"call_{i}",
        "name": "apply_patch",
        "arguments": json.dumps({"path": f"src/m{i}.py", "lines": list(range(20)), "ok": True}),
        "meta": {"score": 0.125 * i, "tags": ["a", "b"], "nested": {"k": [1, 2, {"z": None}]}},
    }


KEY = bytes(range(32))
_canonical = msgspec.json.Encoder(order="sorted").encode  # hotloop.pipeline.items' canonical form


def batched(cls: type) -> type:
    """Time ``cls``'s calls batched: its ``prepare(self, *params)`` runs at the first call for a
    set of parameters (and again when they change), not as asv's ``setup``.

    asv_runner times one call per sample, each right after ``setup``, when a benchmark has one
    (asv#966); at a microsecond or less a lone call reads well above its batched time (the
    secret scanner's 2 KB scan: 12.5-13.3 us against 6-7 us). Without ``setup`` asv batches the
    calls. The price is one dictionary look-up and comparison a call (about 0.1 us), the same
    for every implementation, so the native/pure ratios are still read side by side.
    """
    prepare = cls.prepare  # type: ignore[attr-defined]
    for name, fn in list(vars(cls).items()):
        if not name.startswith("time_"):
            continue

        def timed(self: Any, *params: Any, _fn: Any = fn) -> None:
            if self.__dict__.get("_params") != params:
                prepare(self, *params)
                self._params = params
            _fn(self, *params)

        functools.update_wrapper(timed, fn)
        setattr(cls, name, timed)
    return cls


@batched
class Fingerprint:
    params = (IMPL_NAMES, [100, 2048, 204800])
    param_names = ["impl", "size"]

    def prepare(self, impl: str, size: int) -> None:
        self.fn = IMPLS[impl]["Fingerprinter"](KEY)
        self.data = (b"0123456789abcdef" * (size // 16 + 1))[:size]
        assert self.fn(self.data) == hashlib.blake2b(self.data, digest_size=16, key=KEY).digest()

    def time_fingerprint(self, impl: str, size: int) -> None:
        self.fn(self.data)


@batched
class ItemFingerprint:
    """canonical form + fingerprint of one item: the per-item work of a new turn."""

    params = (IMPL_NAMES, ["message_2kb", "tool_call"])
    param_names = ["impl", "item"]

    def prepare(self, impl: str, item: str) -> None:
        self.fp = IMPLS[impl]["Fingerprinter"](KEY)
        self.item = _message_item(7) if item == "message_2kb" else _tool_item(7)
        ref = json.dumps(self.item, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        assert json.loads(_canonical(self.item)) == self.item and len(_canonical(self.item)) == len(ref)
        assert self.fp(_canonical(self.item)) == _pure.Fingerprinter(KEY)(_canonical(self.item))

    def time_item_fingerprint(self, impl: str, item: str) -> None:
        self.fp(_canonical(self.item))


@batched
class ItemChainOps:
    """A 1,000-item history: match a resent history, then append a turn's new items."""

    params = IMPL_NAMES
    param_names = ["impl"]

    def prepare(self, impl: str) -> None:
        cls = IMPLS[impl]["ItemChain"]
        fingerprint = _pure.Fingerprinter(KEY)
        self.fps = [fingerprint(str(i).encode()) for i in range(1000)]
        self.tokens = [(i * 37) % 500 for i in range(1000)]
        self.chain = cls()
        self.chain.extend(self.fps, self.tokens)
        self.extra = [bytes([i]) * 16 for i in (1, 2, 3)]
        self.new_fps = self.fps[:990] + self.extra
        assert self.chain.common_prefix(self.new_fps) == 990
        assert self.chain.tokens_upto(990) == sum(self.tokens[:990])
        assert self.chain.total_tokens == sum(self.tokens)

    def time_common_prefix_and_tokens(self, impl: str) -> None:
        n = self.chain.common_prefix(self.new_fps)
        self.chain.tokens_upto(n)

    def time_copy_truncate_extend(self, impl: str) -> None:
        c = self.chain.copy()
        c.truncate(990)
        c.extend(self.extra, [10, 20, 30])


def _delta_event(i: int) -> bytes:
    payload = msgspec.json.encode(
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
         "model": "m", "choices": [{"index": 0, "delta": {"content": f" tok{i}"},
                                    "finish_reason": None}]}
    )
    return b"data: " + payload + b"\n\n"


@batched
class SseFeed:
    """One backend network chunk per feed: a single delta event, or 64 KiB of them."""

    params = (IMPL_NAMES, ["one_event", "64kb_split"])
    param_names = ["impl", "chunk"]

    def prepare(self, impl: str, chunk: str) -> None:
        self.cls = IMPLS[impl]["SseDecoder"]
        if chunk == "one_event":
            self.chunks = [_delta_event(1)]
        else:
            stream = b"".join(_delta_event(i) for i in range(400))[:65536]
            cut = stream.rindex(b"\n\n") + 2
            self.chunks = [stream[:cut]]
        want = _pure.SseDecoder().feed(b"".join(self.chunks))
        assert want and all(t == "message" and d.startswith("{") for t, d in want)
        self.dec = self.cls()
        assert [e for c in self.chunks for e in self.dec.feed(c)] == want

    def time_feed(self, impl: str, chunk: str) -> None:
        feed = self.dec.feed
        for c in self.chunks:
            feed(c)


@batched
class PlainDeltas:
    """One backend read holding one plain delta, taken into its item and made into its event:
    ``SseDecoder.feed_lane`` (native and pure), against the general path it replaces (SSE
    decode, msgspec, the chunk assembler, the turn machine's event)."""

    params = ["native", "pure", "general_path"]
    param_names = ["impl"]

    def prepare(self, impl: str) -> None:
        from hotloop.backends.chat.assemble import ChunkAssembler, chunk_decoder
        from hotloop.protocol.objects import IdGen, response_object
        from hotloop.protocol.request import decode_body, validate
        from hotloop.protocol.turn import Turn

        self.chunk = _delta_event(7)
        p = validate(decode_body(b'{"model":"m","input":"x"}'))
        ids = IdGen(deterministic=True)
        turn = Turn(response_object(p, ids.new("resp"), 1), ids=ids, transport="ws", clock=lambda: 2.0)
        turn.start()
        assembler = ChunkAssembler()
        for out in assembler.feed(chunk_decoder.decode(self.chunk[6:-2])):
            turn.feed(out)  # the message is open
        self.turn, self.assembler, self.decode = turn, assembler, chunk_decoder.decode
        self.parts = turn.lane().parts  # the message's pieces, emptied after each timed read
        if impl == "general_path":
            self.dec = IMPLS["native"]["SseDecoder"]()
            frames = self._general()
        else:
            self.dec = IMPLS[impl]["SseDecoder"]()
            self.lane = IMPLS[impl]["DeltaLane"](_accel.PLAIN_TEXT, 0, "response.output_text.delta", "msg_1", 0, 0, True, [])
            frames, rest = self.dec.feed_lane(self.chunk, self.lane, 0, None)
            assert not rest
        assert len(frames) == 1 and json.loads(frames[0][1])["delta"] == " tok7"

    def _general(self) -> list[Any]:
        frames = []
        for _, data in self.dec.feed(self.chunk):
            for out in self.assembler.feed(self.decode(data)):
                frames += self.turn.feed(out)
        del self.parts[:]
        return frames

    def time_one_read(self, impl: str) -> None:
        if impl == "general_path":
            self._general()
        else:
            self.dec.feed_lane(self.chunk, self.lane, 0, None)
            del self.lane.parts[:]


@batched
class EncodeDelta:
    """Once per streamed token: the delta event's JSON, then its SSE frame."""

    params = IMPL_NAMES
    param_names = ["impl"]

    def prepare(self, impl: str) -> None:
        self.enc = IMPLS[impl]["encode_delta"]
        self.sse = IMPLS[impl]["encode_sse"]
        self.args = ("response.output_text.delta", 1234, "msg_67a1b2c3d4e5f6", 0, 0,
                     " token\u00e9", False)
        want = msgspec.json.encode(
            {"type": self.args[0], "sequence_number": 1234, "item_id": self.args[2],
             "output_index": 0, "content_index": 0, "delta": self.args[5]}
        )
        assert self.enc(*self.args) == want
        assert self.sse(self.args[0], want) == (
            b"event: response.output_text.delta\ndata: " + want + b"\n\n"
        )

    def time_encode_delta(self, impl: str) -> None:
        self.enc(*self.args)

    def time_encode_delta_and_sse(self, impl: str) -> None:
        self.sse("response.output_text.delta", self.enc(*self.args))


def _secret_text(size: int) -> tuple[str, list[tuple[str, int, int]]]:
    """``size`` characters of tool-output-like text (code, logs, some non-ASCII) with a few
    planted secrets (assembled from a seeded random source), and where they are."""
    import random

    rng = random.Random(7)
    alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"

    def rnd(alphabet: str, n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    planted = [
        ("github_token", "gh" + "p_" + rnd(alnum, 36)),
        ("aws_access_key_id", "AK" + "IA" + rnd("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", 16)),
        ("generic_secret", rnd(alnum, 20)),
        ("openai_api_key", "sk-" + "proj-" + rnd(alnum + "_-", 120)),
    ]
    filler = (
        "def handler(event, context):\n    token_count = len(event['items'])  # d\u00e9j\u00e0 vu\n"
        "2024-06-01T12:00:00Z INFO request_id=7f3a9c path=/v1/responses status=200 ms=12\n"
        "    url = 'https://api.example.com/v2/items?page=3&limit=50'\n"
        "    headers = {'Accept': 'application/json', 'User-Agent': 'agent/1.0'}\n"
    )
    gap = max(size // (len(planted) + 1) - 60, 0)
    parts: list[str] = []
    spans: list[tuple[str, int, int]] = []
    at = 0
    for kind, secret in planted:
        chunk = (filler * (gap // len(filler) + 1))[:gap]
        head = "\nDB_PASSWORD='" if kind == "generic_secret" else "\nvalue: "
        parts.append(chunk + head)
        at += len(chunk) + len(head)
        spans.append((kind, at, at + len(secret)))
        parts.append(secret + "\n")
        at += len(secret) + 1
    text = "".join(parts)
    text += (filler * (size // len(filler) + 1))[: max(size - len(text), 0)]
    return text, spans


@batched
class SecretScan:
    """One new input text of 2 KB or 200 KB scanned for secrets (and redacted)."""

    params = (IMPL_NAMES, [2_000, 200_000])
    param_names = ["impl", "size"]

    def prepare(self, impl: str, size: int) -> None:
        self.scanner = IMPLS[impl]["SecretScanner"](_pure.SECRET_PATTERNS)
        self.text, want = _secret_text(size)
        assert len(self.text) == size
        assert self.scanner.scan(self.text) == want
        redacted, spans = self.scanner.redact(self.text)
        assert spans == want and redacted.count("[REDACTED:") == len(want)
        # The server builds its scanner once; the regexes' lazy DFAs fill their caches over the
        # first few texts (the first 2 KB scan costs about 150 us). Time the warm scanner.
        for _ in range(max(1, 400_000 // size) if impl == "native" else 0):
            self.scanner.scan(self.text)

    def time_scan(self, impl: str, size: int) -> None:
        self.scanner.scan(self.text)

    def time_redact(self, impl: str, size: int) -> None:
        self.scanner.redact(self.text)
