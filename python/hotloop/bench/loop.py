"""``hotloop bench loop``: scripted coding-agent loops over the four Responses transports.

Each agent runs ``--turns`` turns. Turn 1 sends a user message; every later turn sends the output
of the tool the model called (``--bytes`` of text) and receives the next tool call (or text, then
the next input is a user message). The same conversation goes over:

* ``http-full``: ``POST /v1/responses`` (SSE) with the whole history, ``store: false``;
* ``http-prev``: ``POST`` with ``previous_response_id`` and only the new items, ``store: true``;
* ``ws-prev``: one WebSocket, ``previous_response_id``, only the new items, ``store: false``;
* ``ws-full``: one WebSocket, the whole history each turn, ``store: false``;

and, as the floor every transport is reported against, ``direct``: the same loop in chat
completions against the model server itself, with no Responses layer. ``--concurrency K`` runs K
agents at once.

Targets: by default hotloop is started here (``hotloop serve``, one fresh process per transport,
SQLite store) with the Cerebras backend on the paced chat-completions mock
(:mod:`hotloop.bench.mockchat`, its own process) or, with ``--backend simulator``, on its
built-in simulator (the direct floor is then the mock at the same pacing). ``--url`` drives any
Responses server instead (``--api-key``, ``--model``); ``--direct-url`` names the
chat-completions server behind it for the direct floor.

Checks, on every turn of every transport (a violation makes the exit code 1):

* protocol: ``sequence_number`` 0, 1, 2, ... per response; ``response.created`` first; every
  ``*.added`` closed by its ``*.done``, deltas only inside an open item or part, a ``*.done``'s
  text or arguments equal to its deltas; exactly one terminal event, last; ``usage`` present;
  the completed response's output equal to the streamed items;
* lost context: every input carries a nonce, and the mock answers with a count and CRC of the
  nonces its request held (its context echo), which must equal everything the client sent so far.
  With ``--backend simulator`` the check is on ``usage.input_tokens`` instead (each turn's input
  must exceed the last turn's by at least the new input's tokens). Against a foreign server it is
  "not available", unless that server's model is the mock (the echo is then detected and checked).

Every transport (and direct) first runs a checked warm-up conversation of two turns (reported as
agent -1 if it violates anything), then the measured agents. Reported per transport: end-to-end
wall time, time to first token (first text or arguments delta) and turn time (send to terminal
event) p50/p95, time added over direct (p50 of the per-turn differences, and the ratio of the
p50s), events per turn, and when the server is a hotloop started here its CPU per turn and per
event (whole process, every thread, from ``/proc``; per event includes the turn's fixed costs);
the mean turn time of the first and last tenth of the turns; per-turn series (median over agents)
in ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import ssl
import statistics
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from hotloop.bench import _pct, _text, mock_process, process_cpu_ns, server
from hotloop.bench.mockchat import SEEN, echo
from hotloop.bench.turns import CHAT_TOOL, TOOL
from hotloop.protocol import events as ev

TRANSPORTS = ("http-full", "http-prev", "ws-prev", "ws-full")
TERMINAL = (ev.COMPLETED, ev.FAILED, ev.INCOMPLETE, ev.ERROR)
DELTAS = (ev.OUTPUT_TEXT_DELTA, ev.FUNCTION_CALL_ARGUMENTS_DELTA)
# a delta's part: the prefix of the part's .added/.done events (the delta's content_index or
# summary_index names the part)
_PART_OF = {
    kind: prefix[: -len(".added")]
    for kind, prefix in (
        (ev.OUTPUT_TEXT_DELTA, ev.CONTENT_PART_ADDED),
        (ev.REFUSAL_DELTA, ev.CONTENT_PART_ADDED),
        (ev.REASONING_TEXT_DELTA, ev.CONTENT_PART_ADDED),
        (ev.REASONING_SUMMARY_TEXT_DELTA, ev.REASONING_SUMMARY_PART_ADDED),
    )
}
TURN_TIMEOUT = 120.0  # seconds one turn may take before it counts as failed
MAX_VIOLATIONS = 200  # violations kept in the report (the count covers all of them)
PROMPT = "Fix the failing test in the repository."


class TurnFailed(Exception):
    """A turn that could not complete (HTTP error, failed response, lost connection)."""


# --- protocol checks -------------------------------------------------------------------------


class StreamCheck:
    """Invariants of one Responses event stream, fed one parsed event at a time."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.events = 0
        self.seq = 0
        self.first = True
        self.terminal: dict[str, Any] | None = None
        self.open: dict[tuple[str, Any, Any], None] = {}  # (added prefix, output_index, part index)
        self.acc: dict[tuple[str, Any, Any], list[str]] = {}  # deltas per (kind, output_index, part)
        self.items: dict[int, dict[str, Any]] = {}  # output_item.done items by output_index

    def _bad(self, what: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(what)

    def feed(self, e: dict[str, Any]) -> None:
        self.events += 1
        kind = e.get("type")
        if not isinstance(kind, str):
            self._bad("an event without a type")
            return
        if self.terminal is not None:
            self._bad(f"{kind} after the terminal event")
        seq = e.get("sequence_number")
        if seq != self.seq:
            self._bad(f"{kind}: sequence_number {seq!r}, expected {self.seq}")
            self.seq = seq + 1 if isinstance(seq, int) else self.seq + 1
        else:
            self.seq += 1
        if self.first:
            self.first = False
            if kind != ev.CREATED and kind != ev.ERROR:
                self._bad(f"the first event is {kind}, not {ev.CREATED}")
        oi = e.get("output_index")
        part = e.get("content_index", e.get("summary_index"))
        if kind.endswith(".added"):
            key = (kind[: -len(".added")], oi, part)
            if key in self.open:
                self._bad(f"{kind} twice for output {oi} part {part}")
            self.open[key] = None
        elif kind.endswith(".delta"):
            if (ev.OUTPUT_ITEM_ADDED[: -len(".added")], oi, None) not in self.open:
                self._bad(f"{kind} outside an open output item ({oi})")
            if kind in _PART_OF:
                container = _PART_OF[kind]
                if (container, oi, part) not in self.open:
                    self._bad(f"{kind} outside an open {container[len('response.'):]} ({oi}, {part})")
            self.acc.setdefault((kind[: -len(".delta")], oi, part), []).append(str(e.get("delta", "")))
        elif kind.endswith(".done"):
            base = kind[: -len(".done")]
            if (base, oi, part) in self.open:
                del self.open[(base, oi, part)]
                if kind == ev.OUTPUT_ITEM_DONE and isinstance(oi, int):
                    self.items[oi] = e.get("item") or {}
            else:
                streamed = self.acc.pop((base, oi, part), None)
                whole = e.get("text", e.get("arguments", e.get("refusal")))
                if streamed is None and whole:
                    self._bad(f"{kind} without deltas ({oi}, {part})")
                elif streamed is not None and whole is not None and "".join(streamed) != whole:
                    self._bad(f"{kind}: the final value differs from its deltas ({oi}, {part})")
        elif kind in TERMINAL:
            self.terminal = e

    def finish(self) -> list[str]:
        """The problems of the whole stream (call once, after its last event)."""
        t = self.terminal
        if t is None:
            self._bad("the stream ended without a terminal event")
            return self.problems
        for key in self.open:
            self._bad(f"{key[0]}.added for output {key[1]} part {key[2]} never done")
        if t["type"] in (ev.COMPLETED, ev.INCOMPLETE):
            resp = t.get("response") or {}
            usage = resp.get("usage")
            if not isinstance(usage, dict) or not all(isinstance(usage.get(k), int) for k in ("input_tokens", "output_tokens", "total_tokens")):
                self._bad(f"{t['type']} without usage")
            output = resp.get("output")
            if not isinstance(output, list) or len(output) != len(self.items):
                self._bad("the response's output differs from the streamed items")
            else:
                for i, item in enumerate(output):
                    done = self.items.get(i, {})
                    for k in ("type", "id", "call_id", "arguments", "content", "summary"):
                        if item.get(k) != done.get(k):
                            self._bad(f"output[{i}].{k} differs from its {ev.OUTPUT_ITEM_DONE}")
                            break
        return self.problems


class ChatCheck:
    """Invariants of one streamed chat completion (the direct floor): chunks, one finish, usage."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.text: list[str] = []
        self.args: list[str] = []
        self.call_id: str | None = None
        self.chunks = 0

    def feed(self, chunk: dict[str, Any]) -> bool:
        """True when the chunk carried generated content (text or arguments)."""
        self.chunks += 1
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        got = False
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.text.append(delta["content"])
                got = True
            for call in delta.get("tool_calls") or ():
                self.call_id = self.call_id or call.get("id")
                fn = call.get("function") or {}
                if fn.get("arguments"):
                    self.args.append(fn["arguments"])
                    got = True
            if choice.get("finish_reason"):
                if self.finish_reason is not None:
                    self.problems.append("two finish reasons")
                self.finish_reason = choice["finish_reason"]
        return got

    def finish(self) -> list[str]:
        if self.finish_reason is None:
            self.problems.append("no finish_reason")
        if not self.usage:
            self.problems.append("no usage chunk")
        return self.problems


# --- a cheap HTTP/1.1 client --------------------------------------------------------------------


class Http:
    """One keep-alive HTTP/1.1 connection (TLS for ``https``) that streams response bodies."""

    def __init__(self, base: str, headers: dict[str, str]) -> None:
        u = urllib.parse.urlsplit(base)
        self.tls = u.scheme == "https"
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in {"host": u.netloc, **headers}.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is None or self.writer is None or self.writer.is_closing():
            ctx = ssl.create_default_context() if self.tls else None
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, ssl=ctx, limit=1 << 22)
            sock = self.writer.get_extra_info("socket")
            if sock is not None:
                import socket

                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.reader, self.writer

    async def post(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """Send ``POST prefix+path``; yield the body's pieces as they arrive. A status other than
        200 raises :class:`TurnFailed` with the start of the body."""
        try:
            reader, writer = await self._connect()
        except OSError as exc:
            raise TurnFailed(f"cannot connect to {self.host}:{self.port} ({type(exc).__name__})") from None
        writer.write(
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self.headers}content-type: application/json\r\n"
            f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
        )
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.close()
            raise TurnFailed(f"the connection closed before a response ({type(exc).__name__})") from None
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        hdrs = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            hdrs[name.strip().lower()] = value.strip()
        keep = hdrs.get("connection", "").lower() != "close"
        try:
            if status != 200:
                data = b"".join([piece async for piece in self._body(reader, hdrs)])
                raise TurnFailed(f"HTTP {status}: {data[:300].decode('utf-8', 'replace')}")
            async for piece in self._body(reader, hdrs):
                yield piece
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            keep = False
            raise TurnFailed(f"the connection broke mid-response ({type(exc).__name__})") from None
        finally:
            if not keep:
                self.close()

    @staticmethod
    async def _body(reader: asyncio.StreamReader, hdrs: dict[str, str]) -> AsyncIterator[bytes]:
        if "chunked" in hdrs.get("transfer-encoding", "").lower():
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers are expected
                    return
                yield await reader.readexactly(size + 2)
        elif "content-length" in hdrs:
            yield await reader.readexactly(int(hdrs["content-length"]))
        else:
            while data := await reader.read(65536):
                yield data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def sse_events(pieces: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """Parsed JSON of every ``data:`` of a server-sent event stream (``[DONE]`` skipped)."""
    buf = b""
    async for piece in pieces:
        buf += piece.replace(b"\r\n", b"\n") if b"\r" in piece else piece
        while (end := buf.find(b"\n\n")) >= 0:
            block, buf = buf[:end], buf[end + 2 :]
            data = b"\n".join(line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:"))
            if data and data != b"[DONE]":
                yield json.loads(data)


# --- the agent ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one turn's response said: its id, output items, usage and context echo."""

    rid: str | None
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    seen: str | None  # the mock's context echo found in the output, if any
    events: int = 0  # events in the response's stream


@dataclass
class Agent:
    """One scripted conversation: what it sent, what it must be answered with."""

    index: int
    nbytes: int
    rng: random.Random
    history: list[dict[str, Any]] = field(default_factory=list)  # Responses items, in order
    messages: list[dict[str, Any]] = field(default_factory=list)  # the same as chat messages
    nonces: list[bytes] = field(default_factory=list)
    new: list[dict[str, Any]] = field(default_factory=list)  # items not yet sent
    new_text: str = ""
    prev: str | None = None
    last_usage: dict[str, Any] | None = None
    echo_seen: bool = False

    def nonce(self) -> str:
        n = f"hlctx-{self.rng.getrandbits(32):08x}"
        self.nonces.append(n.encode())
        return n

    def start(self) -> None:
        text = f"[{self.nonce()}] {PROMPT}"
        item = {"type": "message", "role": "user", "content": text}
        self.history.append(item)
        self.messages.append({"role": "user", "content": text})
        self.new, self.new_text = [item], text

    def tool_output(self) -> str:
        head = f"[{self.nonce()}] "
        return head + _text(self.rng, max(0, self.nbytes - len(head)))

    def answered(self, out: Outcome) -> None:
        """Record the response; the next turn's input follows from it."""
        self.prev = out.rid
        self.history.extend(out.output)
        call = next((o for o in out.output if o.get("type") == "function_call"), None)
        text = self.tool_output()
        if call is not None:
            item: dict[str, Any] = {"type": "function_call_output", "call_id": call["call_id"], "output": text}
        else:
            item = {"type": "message", "role": "user", "content": text}
        self.history.append(item)
        self.new, self.new_text = [item], text

    def chat_answered(self, call_id: str | None, args: str, content: str) -> None:
        text = self.tool_output()
        if call_id is not None:
            self.messages.append(
                {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "run", "arguments": args}}]}
            )
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            self.messages.append({"role": "assistant", "content": content})
            self.messages.append({"role": "user", "content": text})


def _seen_in(output: list[dict[str, Any]]) -> str | None:
    for item in output:
        texts = [item.get("arguments") or ""]
        texts += [c.get("text") or "" for c in item.get("content") or () if isinstance(c, dict)]
        for t in texts:
            m = SEEN.search(t)
            if m:
                return m.group(0)
    return None


# --- one transport ------------------------------------------------------------------------------


@dataclass
class Target:
    base: str  # http(s)://host:port[/prefix], Responses at base + /v1/responses
    headers: dict[str, str]
    model: str
    pid: int | None  # a hotloop process started here: its CPU is measured


@dataclass
class TurnRecord:
    agent: int
    turn: int
    wall: float
    ttft: float | None
    events: int = 0  # Responses events (direct: chat chunks) of the turn's stream
    cpu_ns: int | None = None


@dataclass
class Run:
    """Measurements and violations of one transport (or the direct floor)."""

    name: str
    records: list[TurnRecord] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    wall: float = 0.0
    cpu_ns: int | None = None
    failed_turns: int = 0

    def violate(self, agent: int, turn: int, what: str) -> None:
        self.violations.append({"transport": self.name, "agent": agent, "turn": turn, "what": what})


class Loop:
    """Shared settings of a run; :meth:`turn` is one Responses turn over a given transport."""

    def __init__(self, args: argparse.Namespace, context: str) -> None:
        self.args = args
        self.context = context  # "echo" (required), "usage", "auto" (echo if the server shows it)
        self.echo_seen = False
        self._tokens: Any = None

    def body(self, transport: str, agent: Agent, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "tools": [TOOL], "tool_choice": "required"}
        if transport.endswith("-prev"):
            body["input"] = agent.new
            if agent.prev is not None:
                body["previous_response_id"] = agent.prev
        else:
            body["input"] = agent.history
        body["store"] = transport == "http-prev"
        return body

    def check_context(self, run: Run, agent: Agent, turn: int, out: Outcome) -> None:
        if self.context == "usage":
            usage = out.usage or {}
            now = usage.get("input_tokens")
            last = (agent.last_usage or {}).get("input_tokens")
            if isinstance(now, int) and isinstance(last, int):
                need = last + self.tokens(agent.new_text)
                if now < need:
                    run.violate(agent.index, turn, f"lost context: input_tokens {now} < {need} (the last turn's plus the new input)")
            agent.last_usage = usage
            return
        if out.seen is not None:
            agent.echo_seen = self.echo_seen = True
        if self.context == "echo" or agent.echo_seen:
            want = echo(agent.nonces)
            if out.seen != want:
                got = out.seen or "no context echo"
                run.violate(agent.index, turn, f"lost context: the model received {got}, the client sent {want}")

    def agent(self, index: int, seed: int) -> Agent:
        """A new conversation, its first input ready."""
        agent = Agent(index, self.args.bytes, random.Random(seed * 1_000_003 + index))
        agent.start()
        return agent

    def tokens(self, text: str) -> int:
        if self._tokens is None:
            from hotloop import tokenizer

            self._tokens = tokenizer.encoding()
        return len(self._tokens.encode_ordinary(text))


async def _responses_turn(
    events: AsyncIterator[dict[str, Any]], sent: float, run: Run, agent: Agent, turn: int
) -> tuple[Outcome, float | None, float]:
    """Read one response's events to the end of its stream: (outcome, time to first token,
    time to the terminal event)."""
    check = StreamCheck()
    ttft: float | None = None
    end = 0.0
    async for e in events:
        if ttft is None and e.get("type") in DELTAS:
            ttft = time.perf_counter() - sent
        check.feed(e)
        if not end and check.terminal is not None:
            end = time.perf_counter() - sent
    for p in check.finish():
        run.violate(agent.index, turn, p)
    t = check.terminal
    if t is None or t["type"] != ev.COMPLETED:
        detail = json.dumps((t or {}).get("error") or (t or {}).get("response", {}).get("error") or (t or {}).get("type"))
        raise TurnFailed(f"the turn did not complete: {detail[:300]}")
    resp = t["response"]
    output = list(resp.get("output") or [])
    return Outcome(resp.get("id"), output, resp.get("usage"), _seen_in(output), check.events), ttft, end


class _Conn:
    """One agent's connection for one transport: an :class:`Http` or a WebSocket."""

    def __init__(self, transport: str, target: Target) -> None:
        self.transport = transport
        self.target = target
        self.http: Http | None = None
        self.ws: Any = None

    async def open(self) -> None:
        if self.transport.startswith("http"):
            self.http = Http(self.target.base, self.target.headers)
        else:
            from websockets.asyncio.client import connect

            url = self.target.base.replace("http", "ws", 1) + "/v1/responses"
            self.ws = await connect(
                url, max_size=None, compression=None, additional_headers=self.target.headers, ping_interval=None, open_timeout=30
            )

    async def events(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        if self.http is not None:
            async for e in sse_events(self.http.post("/v1/responses", json.dumps({**body, "stream": True}).encode())):
                yield e
            return
        await self.ws.send(json.dumps({"type": ev.CLIENT_CREATE, **body}))
        while True:
            try:
                raw = await self.ws.recv()
            except Exception as exc:  # websockets' ConnectionClosed and kin
                raise TurnFailed(f"the WebSocket closed ({type(exc).__name__})") from None
            e = json.loads(raw)
            yield e
            if e.get("type") in TERMINAL:  # a WebSocket response ends at its terminal event
                return

    async def close(self) -> None:
        if self.http is not None:
            self.http.close()
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()


async def _agent_responses(
    loop: Loop, transport: str, target: Target, rec: Run, index: int, turns: int, seed: int, tick: Callable[[TurnRecord], None]
) -> None:
    """One agent's conversation over ``transport``; ``tick`` gets each measured turn."""
    agent = loop.agent(index, seed)
    conn = _Conn(transport, target)
    try:
        await conn.open()
    except (OSError, asyncio.TimeoutError, TurnFailed) as exc:
        rec.failed_turns += 1
        rec.violate(index, 0, f"turn failed: cannot open the WebSocket ({type(exc).__name__}: {exc})"[:300])
        return
    try:
        for i in range(turns):
            body = loop.body(transport, agent, target.model)
            sent = time.perf_counter()
            try:
                async with asyncio.timeout(TURN_TIMEOUT):
                    out, ttft, wall = await _responses_turn(conn.events(body), sent, rec, agent, i)
            except (TurnFailed, TimeoutError) as exc:
                rec.failed_turns += 1
                rec.violate(index, i, f"turn failed: {exc or 'timed out'}")
                return
            loop.check_context(rec, agent, i, out)
            agent.answered(out)
            tick(TurnRecord(index, i, wall, ttft, out.events))
    finally:
        await conn.close()


async def _agent_direct(
    loop: Loop, base: str, model: str, rec: Run, index: int, turns: int, seed: int, tick: Callable[[TurnRecord], None]
) -> None:
    """The same conversation in chat completions against the model server (the direct floor)."""
    agent = loop.agent(index, seed)
    http = Http(base, {})
    try:
        for i in range(turns):
            body = {"model": model, "messages": agent.messages, "tools": [CHAT_TOOL], "tool_choice": "required",
                    "stream": True, "stream_options": {"include_usage": True}}
            payload = json.dumps(body).encode()
            sent = time.perf_counter()
            check = ChatCheck()
            ttft = None
            try:
                async with asyncio.timeout(TURN_TIMEOUT):
                    async for chunk in sse_events(http.post("/v1/chat/completions", payload)):
                        if check.feed(chunk) and ttft is None:
                            ttft = time.perf_counter() - sent
            except (TurnFailed, TimeoutError) as exc:
                rec.failed_turns += 1
                rec.violate(index, i, f"turn failed: {exc or 'timed out'}")
                return
            wall = time.perf_counter() - sent
            for p in check.finish():
                rec.violate(index, i, p)
            args, content = "".join(check.args), "".join(check.text)
            seen = SEEN.search(args or content)
            want = echo(agent.nonces)
            if seen is None or seen.group(0) != want:
                rec.violate(index, i, f"lost context: the model received {seen.group(0) if seen else 'no context echo'}, the client sent {want}")
            agent.chat_answered(check.call_id, args, content)
            tick(TurnRecord(index, i, wall, ttft, check.chunks))
    finally:
        http.close()


async def _measure(
    name: str, pid: int | None, agent: Callable[..., Awaitable[None]], concurrency: int, turns: int, seed: int, progress: "Progress"
) -> Run:
    """Warm up (one agent, two turns, checked like the others), then ``concurrency`` agents of
    ``turns`` turns."""
    run = Run(name)
    await agent(run, -1, 2, seed + 7919, lambda r: None)
    per_turn_cpu = pid is not None and concurrency == 1
    mark = [process_cpu_ns(pid) if pid is not None else 0]

    def tick(r: TurnRecord) -> None:
        if per_turn_cpu:
            assert pid is not None
            now = process_cpu_ns(pid)
            r.cpu_ns, mark[0] = now - mark[0], now
        run.records.append(r)
        progress.advance(name)

    cpu0 = mark[0]
    t0 = time.perf_counter()
    await asyncio.gather(*(agent(run, k, turns, seed, tick) for k in range(concurrency)))
    run.wall = time.perf_counter() - t0
    if pid is not None:
        run.cpu_ns = process_cpu_ns(pid) - cpu0
    return run


# --- progress and output ------------------------------------------------------------------------


class Progress:
    """A rich progress bar on a terminal, else a plain line per transport and per 25% on stderr."""

    def __init__(self, names: list[str], turns: int) -> None:
        self.total = turns
        self.done: dict[str, int] = {n: 0 for n in names}
        self.rich: Any = None
        self.tasks: dict[str, Any] = {}
        if sys.stderr.isatty():
            with contextlib.suppress(ImportError):
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

                self.rich = Bar(TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=False)
                self.tasks = {n: self.rich.add_task(n, total=turns) for n in names}

    def __enter__(self) -> "Progress":
        if self.rich is not None:
            self.rich.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.rich is not None:
            self.rich.stop()

    def advance(self, name: str) -> None:
        self.done[name] += 1
        n = self.done[name]
        if self.rich is not None:
            self.rich.advance(self.tasks[name])
        elif n == self.total or n % max(1, self.total // 4) == 0:
            print(f"bench loop: {name} {n}/{self.total} turns", file=sys.stderr, flush=True)


def _ms(x: float) -> float:
    return round(x * 1e3, 3)


def _series(run: Run, turns: int) -> dict[str, list[float | None]]:
    by_turn: list[list[TurnRecord]] = [[] for _ in range(turns)]
    for r in run.records:
        by_turn[r.turn].append(r)
    out: dict[str, list[float | None]] = {"turn_ms": [], "ttft_ms": []}
    if any(r.cpu_ns is not None for r in run.records):
        out["server_cpu_ms"] = []
    for rs in by_turn:
        out["turn_ms"].append(_ms(statistics.median(r.wall for r in rs)) if rs else None)
        tt = [r.ttft for r in rs if r.ttft is not None]
        out["ttft_ms"].append(_ms(statistics.median(tt)) if tt else None)
        if "server_cpu_ms" in out:
            cpu = [r.cpu_ns for r in rs if r.cpu_ns is not None]
            out["server_cpu_ms"].append(round(statistics.median(cpu) / 1e6, 3) if cpu else None)
    return out


def summarize(run: Run, turns: int, direct: Run | None) -> dict[str, Any]:
    walls = [r.wall for r in run.records]
    ttfts = [r.ttft for r in run.records if r.ttft is not None]
    s: dict[str, Any] = {"turns": len(walls), "failed_turns": run.failed_turns, "wall_s": round(run.wall, 3)}
    if walls:
        s["events_per_turn"] = round(sum(r.events for r in run.records) / len(walls), 2)
    if walls:
        s.update(turn_p50_ms=_ms(_pct(walls, 0.5)), turn_p95_ms=_ms(_pct(walls, 0.95)), turn_mean_ms=_ms(statistics.mean(walls)))
    if ttfts:
        s.update(ttft_p50_ms=_ms(_pct(ttfts, 0.5)), ttft_p95_ms=_ms(_pct(ttfts, 0.95)))
    if direct is not None and direct.records and walls and run is not direct:
        floor = {(r.agent, r.turn): r.wall for r in direct.records}
        added = [r.wall - floor[(r.agent, r.turn)] for r in run.records if (r.agent, r.turn) in floor]
        if added:
            s["added_p50_ms"] = _ms(_pct(added, 0.5))
            s["added_mean_ms"] = _ms(statistics.mean(added))
        s["over_direct_p50"] = round(_pct(walls, 0.5) / _pct([r.wall for r in direct.records], 0.5), 4)
    if run.cpu_ns is not None and walls:
        s["server_cpu_per_turn_ms"] = round(run.cpu_ns / len(walls) / 1e6, 3)
        events = sum(r.events for r in run.records)
        if events:
            # the turn's fixed costs included: an upper bound of the streaming cost per event
            s["server_cpu_per_event_us"] = round(run.cpu_ns / events / 1e3, 2)
        per = [float(r.cpu_ns) for r in run.records if r.cpu_ns is not None]
        if per:
            s["server_cpu_per_turn_p50_ms"] = round(_pct(per, 0.5) / 1e6, 3)
    series = _series(run, turns)
    tw = [w for w in series["turn_ms"] if w is not None]
    if len(tw) >= 20:
        k = max(5, len(tw) // 10)
        s["first_turns_ms"] = round(statistics.mean(tw[:k]), 3)
        s["last_turns_ms"] = round(statistics.mean(tw[-k:]), 3)
        s["last_over_first"] = round(s["last_turns_ms"] / s["first_turns_ms"], 3)
    s["series"] = series
    return s


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


COLUMNS = [
    ("wall s", "wall_s"), ("ttft p50", "ttft_p50_ms"), ("ttft p95", "ttft_p95_ms"), ("turn p50", "turn_p50_ms"),
    ("turn p95", "turn_p95_ms"), ("+direct p50", "added_p50_ms"), ("x direct", "over_direct_p50"),
    ("cpu/turn", "server_cpu_per_turn_ms"), ("first", "first_turns_ms"), ("last", "last_turns_ms"),
]


def render(report: dict[str, Any]) -> str:
    """The human-readable report (times in ms unless marked)."""
    rows = ([("direct", report["direct"])] if report.get("direct") else []) + list(report["transports"].items())
    cfg = report["config"]
    lines = [
        f"hotloop bench loop: {cfg['turns']} turns x {cfg['concurrency']} agent(s), {cfg['bytes']} B per tool output, "
        f"target {cfg['target']}, model {cfg['model']}; context check: {report['context_check']}",
        "times in ms; first/last: mean turn time of the first and last tenth of the turns (growth with history)",
    ]
    width = [max(10, len(h) + 1) for h, _ in COLUMNS]
    lines.append(f"{'':10s}" + "".join(f"{h:>{w}s}" for (h, _), w in zip(COLUMNS, width)))
    for name, s in rows:
        lines.append(f"{name:10s}" + "".join(f"{_fmt(s.get(k)):>{w}s}" for (_, k), w in zip(COLUMNS, width)))
    n = report["violation_count"]
    lines.append(f"violations: {n}" if n else "violations: none (protocol and context checked on every turn)")
    for v in report["violations"][:20]:
        lines.append(f"  {v['transport']} agent {v['agent']} turn {v['turn']}: {v['what']}")
    return "\n".join(lines)


def _smooth(ys: list[float | None], k: int) -> list[float | None]:
    """Rolling median over ``k`` turns (centred), so growth shows through the noise."""
    out: list[float | None] = []
    for i in range(len(ys)):
        window = [y for y in ys[max(0, i - k // 2) : i + k // 2 + 1] if y is not None]
        out.append(statistics.median(window) if window else None)
    return out


def plot(report: dict[str, Any], path: str) -> None:
    """Per-turn latency (median over agents) against turn index, each transport and the direct
    floor (thin: every turn; thick: rolling median); below, server CPU per turn when measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(report["transports"].items())
    cpu = any("server_cpu_ms" in s["series"] for _, s in rows)
    fig, axes = plt.subplots(2 if cpu else 1, 1, figsize=(8, 7 if cpu else 4.5), dpi=120, sharex=True, squeeze=False)
    ax = axes[0][0]
    n = report["config"]["turns"]
    k = max(1, n // 20) | 1
    lines: list[tuple[str, list[float | None], dict[str, Any]]] = [(name, s["series"]["turn_ms"], {}) for name, s in rows]
    if report.get("direct"):
        lines.append(("direct (floor)", report["direct"]["series"]["turn_ms"], {"color": "black", "linestyle": "--"}))
    shown: list[float] = []
    for name, ys, style in lines:
        xs = range(1, len(ys) + 1)
        smooth = _smooth(ys, k)
        shown += [y for y in smooth if y is not None]
        (line,) = ax.plot(xs, smooth, label=name, linewidth=1.6, **style)
        ax.plot(xs, ys, color=line.get_color(), alpha=0.25, linewidth=0.8)
    if k > 1 and shown:  # the medians' range: single slow turns (in the p95 columns) run off it
        low, high = min(shown), max(shown)
        pad = max(0.5, (high - low) * 0.3)
        ax.set_ylim(max(0.0, low - pad), high + pad)
    cfg = report["config"]
    ax.set_ylabel("turn time, ms")
    ax.set_title(
        f"hotloop bench loop: {cfg['turns']} turns, {cfg['bytes']} B tool output per turn, {cfg['concurrency']} agent(s)"
        + (f"; rolling median of {k}" if k > 1 else ""), fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if cpu:
        ax2 = axes[1][0]
        for name, s in rows:
            ys = s["series"].get("server_cpu_ms")
            if ys:
                ax2.plot(range(1, len(ys) + 1), _smooth(ys, k), label=name, linewidth=1.6)
        ax2.set_ylabel("server CPU per turn, ms")
        ax2.grid(alpha=0.3)
        ax2.set_ylim(bottom=0)
    axes[-1][0].set_xlabel("turn (history grows by one tool call and its output per turn)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- the run ------------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    m: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    m["cpu"] = line.split(":", 1)[1].strip()
                    break
    return m


@contextlib.contextmanager
def _targets(args: argparse.Namespace, model: str) -> Iterator[tuple[str | None, Callable[[str], contextlib.AbstractContextManager[Target]]]]:
    """(the direct floor's chat-completions base or None, a context manager per transport)."""
    if args.url:
        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}

        @contextlib.contextmanager
        def foreign(_transport: str) -> Iterator[Target]:
            yield Target(args.url.rstrip("/"), headers, model, None)

        yield args.direct_url, foreign
        return
    with mock_process() as (mock, _mock_pid):
        os.environ.setdefault("CEREBRAS_API_KEY", "bench")
        flags: tuple[str, ...]
        if args.backend == "simulator":
            flags = ("--sim-rate", f"{args.rate:g}", "--sim-ttft", f"{args.ttft / 1000:g}",
                     "--sim-output-tokens", str(args.output_tokens), "--sim-seed", str(args.seed))
        else:
            flags = ("--backend", "cerebras", "--base-url", mock)

        @contextlib.contextmanager
        def own(_transport: str) -> Iterator[Target]:
            with server(*flags, "--store", "sqlite") as (base, pid):
                yield Target(base, {}, model, pid)

        yield mock, own


def _sim_call_tokens() -> int:
    """Tokens the simulator streams for a call of :data:`TOOL`: its example arguments, plus one
    for the call's header (as the mock's first chunk carries the name)."""
    from hotloop import tokenizer
    from hotloop.backends.simulator import example_value

    schema: dict[str, Any] = TOOL["parameters"]  # type: ignore[assignment]
    args = json.dumps(example_value(schema), separators=(",", ":"))
    return max(3, len(tokenizer.encoding().encode_ordinary(args)) + 1)


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    answer = _sim_call_tokens() if args.backend == "simulator" and not args.url else args.output_tokens
    mock_model = f"bench-{args.rate:g}-{answer}-tool-ttft{args.ttft:g}"
    model = args.model or (mock_model if args.backend == "cerebras" else "hotloop-sim")
    context = "auto" if args.url else ("usage" if args.backend == "simulator" else "echo")
    loop = Loop(args, context)
    transports = list(args.transports)
    names = (["direct"] if not args.no_direct else []) + transports
    direct: Run | None = None
    runs: dict[str, Run] = {}
    with contextlib.ExitStack() as stack:
        direct_url, target_of = stack.enter_context(_targets(args, model))
        if direct_url is None:
            names = [n for n in names if n != "direct"]
        with Progress(names, args.turns * args.concurrency) as progress:
            if "direct" in names:
                assert direct_url is not None
                direct_model = args.direct_model or (mock_model if not args.url else model)

                async def direct_agent(run: Run, k: int, turns: int, seed: int, tick: Callable[[TurnRecord], None]) -> None:
                    await _agent_direct(loop, direct_url, direct_model, run, k, turns, seed, tick)

                direct = await _measure("direct", None, direct_agent, args.concurrency, args.turns, args.seed, progress)
            for name in transports:
                with target_of(name) as target:

                    async def agent(run: Run, k: int, turns: int, seed: int, tick: Callable[[TurnRecord], None],
                                    name: str = name, target: Target = target) -> None:
                        await _agent_responses(loop, name, target, run, k, turns, seed, tick)

                    runs[name] = await _measure(name, target.pid, agent, args.concurrency, args.turns, args.seed, progress)
    all_runs = ([direct] if direct is not None else []) + list(runs.values())
    violations = [v for r in all_runs for v in r.violations]
    if context == "auto":
        context = "echo (detected: the server's model is the mock)" if loop.echo_seen else "not available (foreign server)"
    return {
        "scenario": "loop",
        "config": {
            "turns": args.turns, "bytes": args.bytes, "concurrency": args.concurrency, "transports": transports,
            "target": args.url or f"hotloop serve --backend {args.backend} (started here)", "model": model,
            "backend": None if args.url else args.backend, "rate": args.rate, "ttft_ms": args.ttft,
            "output_tokens": args.output_tokens, "seed": args.seed,
        },
        "machine": _machine(),
        "context_check": context,
        "direct": summarize(direct, args.turns, None) if direct is not None else None,
        "transports": {name: summarize(r, args.turns, direct) for name, r in runs.items()},
        "violation_count": len(violations),
        "violations": violations[:MAX_VIOLATIONS],
        "ok": not violations,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hotloop bench loop",
        description=(__doc__ or "").replace(":mod:", "").replace(":func:", "").replace("`", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Exit status: 0 when every stream and every turn passed the checks, 1 on any violation or\n"
            "failed turn, 2 on a usage error (e.g. --plot without matplotlib). The lost-context check\n"
            "needs the mock as the model: it is 'not available' against a foreign --url server unless\n"
            "that server's model is python -m hotloop.bench.mockchat."
        ),
    )
    p.add_argument("--url", help="a running Responses server (base URL, without /v1); default: start hotloop here")
    p.add_argument("--api-key", help="--url: bearer token sent to the server")
    p.add_argument("--model", help="model id (default: the mock's bench-<rate>-<tokens>-tool-ttft<ms>, or hotloop-sim)")
    p.add_argument("--direct-url", help="--url: the chat-completions server (without /v1) behind it, for the direct floor")
    p.add_argument("--direct-model", help="--direct-url: its model id (default: --model)")
    p.add_argument("--backend", choices=["cerebras", "simulator"], default="cerebras",
                   help="the hotloop started here: Cerebras backend on the paced mock (default) or the simulator")
    p.add_argument("--rate", type=float, default=1000.0, help="model tokens/s (mock and simulator; default 1000)")
    p.add_argument("--ttft", type=float, default=20.0, help="model time to first token, ms (default 20)")
    p.add_argument("--output-tokens", type=int, default=24,
                   help="tokens of each model answer (default 24; the simulator's tool calls carry its example "
                   "arguments instead, and the direct floor is then paced to their length)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tool outputs and the simulator (default 0)")
    p.add_argument("--turns", type=int, default=100, help="turns per agent (default 100)")
    p.add_argument("--bytes", type=int, default=4096, help="bytes of each tool result sent (default 4096)")
    p.add_argument("--concurrency", type=int, default=1, help="agents running at once per transport (default 1)")
    p.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma-separated subset of {','.join(TRANSPORTS)}")
    p.add_argument("--no-direct", action="store_true", help="skip the direct floor")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--plot", metavar="PNG", help="write per-turn latency against turn index (needs matplotlib: hotloop[bench])")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in args.transports if t not in TRANSPORTS]
    if bad or not args.transports:
        p.error(f"--transports: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(TRANSPORTS)}")
    if args.turns < 1 or args.concurrency < 1 or args.bytes < 16 or args.output_tokens < 3 or args.rate < 0 or args.ttft < 0:
        p.error("--turns and --concurrency must be >= 1, --bytes >= 16, --output-tokens >= 3, --rate and --ttft >= 0")
    if args.url and not args.model:
        p.error("--url needs --model")
    if args.url and not args.url.startswith(("http://", "https://")):
        p.error(f"--url: an http:// or https:// base URL, not {args.url!r}")
    if args.plot:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            p.error(f"--plot: no writable directory {folder!r} to write {os.path.basename(args.plot)!r} in")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("hotloop bench loop: --plot needs matplotlib (pip install 'hotloop[bench]')", file=sys.stderr)
            return 2
    from hotloop.bench.wsload import _run

    try:
        report = _run(run_all(args))
    except RuntimeError as exc:  # a server or the mock did not start
        print(f"hotloop bench loop: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        print(render(report))
    return 0 if report["ok"] else 1
