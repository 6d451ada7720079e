"""A paced chat-completions server for benchmarks: ``python -m hotloop.bench.mockchat --port P``.

It streams Cerebras-shaped ``chat.completion.chunk`` SSE events, one token per chunk, paced by
absolute deadlines, so ``hotloop bench --backend cerebras`` measures hotloop's Cerebras path
(SDK client, request rendering, SSE parsing, turn machine, WebSocket frames) against a model that
behaves like Cerebras at a chosen rate. It runs in its own process so its CPU is not counted as
the server's.

The model id selects the behaviour: ``bench-<rate>-<tokens>[-tool][-ttft<ms>][-think]`` streams ``tokens``
chunks at ``rate`` tokens/s (rate 0: unpaced) after ``ms`` milliseconds, as text or, with
``-tool``, as one function call (``run``) whose arguments arrive over the chunks, e.g.
``bench-4000-4000`` or ``bench-1000-40-tool-ttft20``; ``-think`` sends a reasoning model's
``reasoning`` delta first (:data:`THOUGHT`). Any other id gets 16 tokens unpaced. Raw
asyncio HTTP/1.1 with keep-alive and chunked bodies; not a general server. ``--certfile PEM``
(certificate and key) serves it over TLS instead, as Cerebras is served (``hotloop bench
--mock-tls``).

Context echo: a request whose body carries nonces (``hlctx-`` and 8 hex digits, as ``hotloop
bench loop`` puts one in every input it sends) is answered with the word ``seen-<n>-<crc>`` in
place of its first word: ``n`` nonces, in the order they appear, with the CRC-32 of them joined by
commas. The client, knowing what it sent, can tell from the answer whether the model received the
whole conversation (:func:`echo`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import ssl
import time
import zlib

_WORDS = [" alpha", " beta", " gamma", " delta", " kappa", " sigma"]
NONCE = re.compile(rb"hlctx-[0-9a-f]{8}")
SEEN = re.compile(r"seen-(\d+)-([0-9a-f]{8})")


def echo(nonces: list[bytes]) -> str:
    """The context echo word for the nonces a request carried, in order."""
    return f"seen-{len(nonces)}-{zlib.crc32(b','.join(nonces)):08x}"


def _params(model: str) -> tuple[float, int, bool, float, bool]:
    """(rate, tokens, tool call?, seconds to the first token, reasoning first?) of a model id."""
    parts = model.split("-")
    if len(parts) >= 3 and parts[0] == "bench":
        try:
            rate, tokens = float(parts[1]), int(parts[2])
            tool = "tool" in parts[3:]
            ttft = next((float(p[4:]) / 1000 for p in parts[3:] if p.startswith("ttft")), 0.0)
            return rate, tokens, tool, ttft, "think" in parts[3:]
        except ValueError:
            pass
    return 0.0, 16, False, 0.0, False


# What a ``-think`` model reasons before its answer: one chunk of the ``reasoning`` delta field,
# as Cerebras streams a reasoning model's (hotloop makes it the response's reasoning item)
THOUGHT = "The test fails on the last assertion; run it again to see the whole output first. "


def _delta(i: int, content: str | None, tool: bool) -> dict:
    if content is None:
        return {}
    if not tool:
        return {"content": content}
    fn = {"name": "run", "arguments": content} if i == 0 else {"arguments": content}
    call = {"index": 0, "id": "call_bench", "type": "function", "function": fn} if i == 0 else {"index": 0, "function": fn}
    return {"tool_calls": [call]}


def _chunk(
    i: int, created: int, model: str, content: str | None, finish: str | None = None, usage: dict | None = None, tool: bool = False,
    reasoning: bool = False,
) -> bytes:
    delta = {"reasoning": content} if reasoning else _delta(i, content, tool)
    obj: dict = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": "fp_bench",
        "choices": [] if usage is not None else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        obj["usage"] = usage
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _arguments(tokens: int) -> list[str]:
    """A JSON object ``{"cmd": "..."}`` split into ``tokens`` pieces (at least 3)."""
    words = [_WORDS[i % len(_WORDS)] for i in range(max(1, tokens - 2))]
    return ['{"cmd": "', *words, '"}']


async def _stream(writer: asyncio.StreamWriter, model: str, prompt_tokens: int, seen: str | None = None) -> None:
    rate, tokens, tool, ttft, think = _params(model)
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"x-ratelimit-remaining-tokens-minute: 1000000\r\n\r\n"
    )
    loop = asyncio.get_running_loop()
    created = int(time.time())
    await writer.drain()
    if ttft:
        await asyncio.sleep(ttft)
    t0 = loop.time()
    interval = 1.0 / rate if rate > 0 else 0.0
    pieces = _arguments(tokens) if tool else [_WORDS[i % len(_WORDS)] for i in range(tokens)]
    if seen is not None and len(pieces) > (1 if tool else 0):
        pieces[1 if tool else 0] = " " + seen
    if think:
        writer.write(_chunk(0, created, model, THOUGHT, reasoning=True))
    if not tool:
        writer.write(_chunk(0, created, model, ""))
    for i, piece in enumerate(pieces):
        if interval:
            due = t0 + i * interval
            now = loop.time()
            if due > now:
                await writer.drain()
                await asyncio.sleep(due - now)
        writer.write(_chunk(i, created, model, piece, tool=tool))
    writer.write(_chunk(tokens, created, model, None, "tool_calls" if tool else "stop"))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens,
             "prompt_tokens_details": {"cached_tokens": 0}}
    writer.write(_chunk(tokens, created, model, None, usage=usage))
    done = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    await writer.drain()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            body = await reader.readexactly(length) if length else b""
            if method == "POST" and path.endswith("/chat/completions"):
                req = json.loads(body)
                nonces = NONCE.findall(body)
                await _stream(writer, str(req.get("model", "")), len(body) // 4, echo(nonces) if nonces else None)
            elif path.endswith("/models"):
                data = json.dumps({"object": "list", "data": [{"id": "bench-4000-4000", "object": "model", "created": 0, "owned_by": "bench"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(host: str, port: int, ssl_ctx: ssl.SSLContext | None = None) -> None:
    server = await asyncio.start_server(_handle, host, port, ssl=ssl_ctx)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--certfile", help="serve over TLS with this PEM file (certificate chain and key)")
    args = p.parse_args()
    ctx = None
    if args.certfile:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(args.certfile)
    try:
        import uvloop

        uvloop.run(serve(args.host, args.port, ctx))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
