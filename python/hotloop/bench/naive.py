"""A naive one-hop Responses proxy, the reference ``hotloop bench agent-turns`` compares against.

``python -m hotloop.bench.naive --port P --upstream http://HOST:PORT`` serves just enough of
``POST /v1/responses`` (SSE) and WebSocket mode for the benchmark's agent loop, the way a
straightforward gateway would: aiohttp server, aiohttp client to the chat-completions upstream,
one ``json.dumps`` and one socket write per event, items mapped to chat messages by dict
look-ups. No validation, no token counting, no store: ``previous_response_id`` resolves against
an in-memory dict (bounded to the last 1,024 responses). Needs ``aiohttp`` (``hotloop[bench]``).
It exists to measure against, not to serve anyone.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from collections import OrderedDict
from typing import Any

from hotloop.protocol import events as ev

MAX_REMEMBERED = 1024


def _messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for it in items:
        kind = it.get("type", "message")
        if kind == "message":
            content = it["content"]
            if not isinstance(content, str):
                content = "".join(p.get("text", "") for p in content)
            out.append({"role": it["role"], "content": content})
        elif kind == "function_call":
            out.append({"role": "assistant", "tool_calls": [{"id": it["call_id"], "type": "function",
                                                             "function": {"name": it["name"], "arguments": it["arguments"]}}]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools or ()]


class Naive:
    def __init__(self, upstream: str) -> None:
        import aiohttp

        self.upstream = upstream.rstrip("/") + "/v1/chat/completions"
        self.session: aiohttp.ClientSession | None = None
        self.history: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    async def turn(self, body: dict[str, Any], send: Any) -> None:
        """Stream one response through ``send(event_dict)``."""
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession()
        prev = self.history.get(body.get("previous_response_id") or "", [])
        messages = prev + _messages(body["input"])
        rid = "resp_" + secrets.token_hex(24)
        response: dict[str, Any] = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                                    "model": body["model"], "output": []}
        seq = 0

        async def emit(kind: str, **fields: Any) -> None:
            nonlocal seq
            await send({"type": kind, "sequence_number": seq, **fields})
            seq += 1

        await emit(ev.CREATED, response=response)
        text: list[str] = []
        call: dict[str, Any] | None = None
        req = {"model": body["model"], "messages": messages, "tools": _tools(body.get("tools")), "stream": True}
        async with self.session.post(self.upstream, json=req) as r:
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", ()):
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        text.append(delta["content"])
                        await emit(ev.OUTPUT_TEXT_DELTA, item_id="msg", output_index=0, content_index=0, delta=delta["content"])
                    for tc in delta.get("tool_calls") or ():
                        fn = tc.get("function") or {}
                        if call is None:
                            call = {"type": "function_call", "id": "fc_" + secrets.token_hex(8), "call_id": tc.get("id"),
                                    "name": fn.get("name"), "arguments": ""}
                            await emit(ev.OUTPUT_ITEM_ADDED, output_index=0, item=call)
                        call["arguments"] += fn.get("arguments") or ""
                        await emit(ev.FUNCTION_CALL_ARGUMENTS_DELTA, item_id=call["id"], output_index=0,
                                   delta=fn.get("arguments") or "")
        if call is not None:
            response["output"] = [call]
            await emit(ev.OUTPUT_ITEM_DONE, output_index=0, item=call)
        else:
            response["output"] = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "".join(text)}]}]
        response["status"] = "completed"
        await emit(ev.COMPLETED, response=response)
        self.history[rid] = messages + _messages(response["output"])
        while len(self.history) > MAX_REMEMBERED:
            self.history.popitem(last=False)


def app(upstream: str) -> Any:
    from aiohttp import WSMsgType, web

    naive = Naive(upstream)

    async def responses(request: web.Request) -> web.StreamResponse:
        if request.headers.get("upgrade", "").lower() == "websocket":
            ws = web.WebSocketResponse(max_msg_size=0, compress=False)
            await ws.prepare(request)
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await naive.turn(json.loads(msg.data), lambda e: ws.send_str(json.dumps(e)))
            return ws
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def send(e: dict[str, Any]) -> None:
            await resp.write(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode())

        await naive.turn(body, send)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "turns": []})

    async def close(_app: web.Application) -> None:
        if naive.session is not None:
            await naive.session.close()

    a = web.Application(client_max_size=64 * 1024 * 1024)
    a.on_cleanup.append(close)
    a.router.add_route("*", "/v1/responses", responses)
    a.router.add_get("/healthz", health)
    a.router.add_get("/hotloop/stats", health)
    return a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="the chat-completions server, without /v1")
    args = p.parse_args()
    from aiohttp import web

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app(args.upstream), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
