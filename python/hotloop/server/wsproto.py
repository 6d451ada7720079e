"""uvicorn's websockets sans-I/O protocol with *corked* writes.

A streamed response sends one WebSocket message per token. uvicorn writes each message to the
socket at once, one ``send()`` syscall per event, which costs more than building the event. This
subclass appends each outgoing data frame to a buffer and flushes the buffer with a single
``transport.write`` from a ``call_soon`` callback, i.e. as soon as the sending task yields to the
event loop. Every event produced in one loop iteration (several tokens due at once, several SSE
chunks in one network read) leaves in one write; no event waits for a later one, so latency is
unchanged. Control messages (accept, close) flush the buffer first, keeping the order.

Bounds: the buffer only holds what one loop iteration produced; ``send`` still awaits
``writable`` (paused when the transport's own buffer is above its high-water mark), so a slow
client applies back-pressure exactly as before.

Relies on ``WebSocketsSansIOProtocol`` internals (``conn``, ``transport``, ``writable``,
``handshake_complete``, ``close_sent``, ``initial_response``): the uvicorn version range is pinned
in ``pyproject.toml`` and the integration tests run through this class.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState


class CorkedWebSocketProtocol(WebSocketsSansIOProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cork: list[bytes] = []
        self._flush_scheduled = False

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._cork:
            data = b"".join(self._cork)
            self._cork.clear()
            if not self.transport.is_closing():
                self.transport.write(data)

    async def send(self, message: Any) -> None:
        if (
            message["type"] == "websocket.send"
            and self.handshake_complete
            and not self.close_sent
            and self.initial_response is None
        ):
            await self.writable.wait()
            if self.disconnected:
                raise ClientDisconnected()
            try:
                text = message.get("text")
                if text is not None:
                    self.conn.send_text(text.encode())
                else:
                    self.conn.send_binary(message.get("bytes") or b"")
            except InvalidState:
                raise ClientDisconnected() from None
            self._cork.extend(self.conn.data_to_send())
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self.loop.call_soon(self._flush)
            return
        self._flush()
        await super().send(message)
