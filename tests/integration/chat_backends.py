"""The chat backends' servers for end-to-end tests: ``hotloop serve`` (subprocess) with the
cerebras backend (the real cerebras-cloud-sdk configuration) or the openai-compat one, over both
HTTP transports, pointed at :mod:`tests.mock_chat_server`. A test module imports these fixtures."""

from __future__ import annotations

from typing import Iterator

import pytest
from openai import OpenAI

from tests.conftest import Server, run_server
from tests.mock_chat_server import MockChatServer


@pytest.fixture(autouse=True)
def _fresh_mock(mock: MockChatServer) -> None:
    mock.reset()


@pytest.fixture(scope="module", params=["lean", "sdk"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every backend test runs over both HTTP transports."""
    return str(request.param)


@pytest.fixture(scope="module")
def cerebras(tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer, transport: str) -> Iterator[Server]:
    env = {
        "HOTLOOP_BACKEND_TRANSPORT": transport,
        "CEREBRAS_API_KEY": "test",
        "CEREBRAS_BASE_URL": mock.url,  # without /v1: the SDK adds it
        "HOTLOOP_BACKEND_IDLE_TIMEOUT": "1",
        "HOTLOOP_BACKEND_TIMEOUT": "10",
        "HOTLOOP_BACKEND_RETRIES": "0",
    }
    with run_server(tmp_path_factory.mktemp("cerebras"), "--backend", "cerebras", "--store", "memory", env=env) as s:
        yield s


@pytest.fixture(scope="module")
def compat(tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer, transport: str) -> Iterator[Server]:
    env = {
        "HOTLOOP_BACKEND_TRANSPORT": transport,
        "HOTLOOP_BACKEND_API_KEY": "compat-key",
        "HOTLOOP_BACKEND_IDLE_TIMEOUT": "1",
        "HOTLOOP_BACKEND_TIMEOUT": "10",
        "HOTLOOP_BACKEND_RETRIES": "1",
    }
    args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model", "--store", "memory")
    with run_server(tmp_path_factory.mktemp("compat"), *args, env=env) as s:
        yield s


@pytest.fixture(params=["cerebras", "compat"])
def server(request: pytest.FixtureRequest, transport: str) -> Server:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def client_for(server: Server) -> OpenAI:
    return OpenAI(api_key="sk-client", base_url=server.v1, max_retries=0, timeout=30)
