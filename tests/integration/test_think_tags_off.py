"""``--think-tags off`` (``HOTLOOP_THINK_TAGS=off``): a chat backend's content is text as it
comes, ``<think>`` blocks included (tests.integration.test_think_tags: the default, auto)."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.conftest import Server, run_server
from tests.integration.chat_backends import client_for
from tests.mock_chat_server import MockChatServer, Reply, chunk


@pytest.fixture(scope="module")
def off(tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer) -> Iterator[Server]:
    env = {"HOTLOOP_BACKEND_API_KEY": "k", "HOTLOOP_BACKEND_RETRIES": "0"}
    args = ("--backend", "openai-compat", "--base-url", mock.v1, "--store", "memory", "--think-tags", "off")
    with run_server(tmp_path_factory.mktemp("off"), *args, env=env) as s:
        yield s


def test_the_content_is_text(off: Server, mock: MockChatServer) -> None:
    mock.reset()
    mock.push(Reply.stream([chunk({"content": p}) for p in ("<th", "ink>plan</think>", "\n\nanswer")] + [chunk({}, "stop")]))
    response = client_for(off).responses.create(model="qwen-3-32b", input="Hi", store=False)
    assert [o.type for o in response.output] == ["message"]
    assert response.output_text == "<think>plan</think>\n\nanswer"
