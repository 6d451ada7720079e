"""A backend's model list is bounded in time (``MODELS_TIMEOUT``): a backend that accepts the
connection and never answers ``GET /models`` held start-up for the backend timeout (300 s by
default) before the server served anything, and every ``GET /v1/models`` as long again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from hotloop.backends.chat import backend as chat_backend
from hotloop.backends.chat.backend import ChatBackend
from hotloop.backends.openai_compat import OpenAICompatBackend
from hotloop.config import Config


class _Stalled(ChatBackend):
    def __init__(self, model: str) -> None:
        super().__init__(model=model, retries=0)
        self.asked = 0

    async def _get_models(self) -> bytes:
        self.asked += 1
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


def test_a_listing_that_never_comes_offers_the_default_model_and_asks_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_backend, "MODELS_TIMEOUT", 0.2, raising=False)
    backend = _Stalled("m")

    async def main() -> None:
        t0 = time.monotonic()
        models = await backend.list_models()
        assert time.monotonic() - t0 < 2
        assert [m["id"] for m in models] == ["m"]
        await backend.list_models()  # not cached: asked again
        assert backend.asked == 2

    asyncio.run(asyncio.wait_for(main(), 10))


@pytest.mark.parametrize("transport", ["lean", "sdk"])
def test_start_up_does_not_wait_for_a_silent_model_list(monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """An OpenAI-compatible backend that accepts connections and never answers: start-up ends
    within the bound, on the model given (``--model``)."""
    monkeypatch.setattr(chat_backend, "MODELS_TIMEOUT", 0.3, raising=False)
    held: list[Any] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing, keep the connection
        await reader.read()

    async def main() -> None:
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        backend = OpenAICompatBackend(
            Config(backend="openai-compat", base_url=f"http://127.0.0.1:{port}/v1", model="m", backend_transport=transport)
        )
        t0 = time.monotonic()
        await backend.start()
        assert time.monotonic() - t0 < 3
        assert backend.default_model == "m"
        assert [m["id"] for m in await backend.list_models()] == ["m"]
        await backend.close()
        for w in held:
            w.close()
        server.close()

    asyncio.run(asyncio.wait_for(main(), 20))
