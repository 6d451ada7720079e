"""Request bodies sent compressed (``Content-Encoding``): gzip and deflate decoded, bounded by the
body limit as they inflate; a coding the server cannot decode refused with 415 in the OpenAI
error shape, never read as malformed JSON (a real server, HTTP/1.1 clients)."""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import Server, run_server
from tests.integration.test_limits_global import _read_response

LIMIT = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(tmp_path_factory.mktemp("coding"), "--store", "memory", "--sim-rate", "0",
                    env={"HOTLOOP_MAX_BODY_BYTES": str(LIMIT)}) as s:
        yield s


def _post(srv: Server, path: str, body: bytes, coding: str | None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if coding is not None:
        headers["content-encoding"] = coding
    return httpx.post(srv.v1 + path, content=body, headers=headers, timeout=60)


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


def _request(text: str) -> dict[str, Any]:
    return {"model": "hotloop-sim", "input": text}


@pytest.mark.parametrize(
    "coding, encode",
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", _raw_deflate),  # what some clients send under that name
        ("gzip, identity", gzip.compress),
        ("deflate, gzip", lambda b: gzip.compress(zlib.compress(b))),
        ("gzip", lambda b: gzip.compress(b[:100]) + gzip.compress(b[100:])),  # two members
    ],
)
def test_a_compressed_body_is_answered_as_the_same_body_sent_plain(srv: Server, coding: str, encode: Any) -> None:
    text = "the loop keeps agents hot " * 3000  # 78 KB: decoded off the event loop too
    body = json.dumps(_request(text)).encode()
    plain = _post(srv, "/responses/input_tokens", body, None)
    packed = _post(srv, "/responses/input_tokens", encode(body), coding)
    assert plain.status_code == packed.status_code == 200, packed.text
    assert packed.json() == plain.json()
    created = _post(srv, "/responses", encode(json.dumps(_request("hi")).encode()), coding)
    assert created.status_code == 200 and created.json()["status"] == "completed", created.text


def test_a_body_that_inflates_past_what_is_decoded_inline_is_decoded_whole(srv: Server) -> None:
    """Past 1 MiB decoded, a body is decoded again in a thread: the same answer."""
    text = " ".join(f"w{i}" for i in range(400_000))  # 2.7 MB: past the inline MiB, under the 4 MiB limit
    body = json.dumps(_request(text)).encode()
    plain = _post(srv, "/responses/input_tokens", body, None)
    for coding, encode in (("gzip", gzip.compress), ("deflate, gzip", lambda b: gzip.compress(zlib.compress(b)))):
        packed = _post(srv, "/responses/input_tokens", encode(body), coding)
        assert plain.status_code == packed.status_code == 200, packed.text
        assert packed.json() == plain.json()


def test_a_body_that_inflates_past_the_limit_is_413_and_corrupt_data_400(srv: Server) -> None:
    bomb = gzip.compress(b'{"model": "hotloop-sim", "input": "' + b"a" * (LIMIT * 4) + b'"}')
    assert len(bomb) < LIMIT // 100
    r = _post(srv, "/responses", bomb, "gzip")
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    good = gzip.compress(json.dumps(_request("hi")).encode())
    for data in (b"not gzip at all", good[: len(good) // 2], good + b"trailing"):
        r = _post(srv, "/responses", data, "gzip")
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_encoding", error
    r = _post(srv, "/responses", zlib.compress(json.dumps(_request("hi")).encode()) + b"x", "deflate")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encoding"


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "gzip, gzip, gzip"])
def test_a_coding_the_server_cannot_decode_is_415_naming_those_it_can(srv: Server, coding: str) -> None:
    body = json.dumps(_request("hi")).encode()
    for c in reversed([c.strip() for c in coding.split(",")]):
        body = gzip.compress(body) if c == "gzip" else body  # (the others sent as they are)
    r = _post(srv, "/responses", body, coding)
    assert r.status_code == 415, r.text
    assert r.headers["accept-encoding"] == "gzip, deflate"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_content_encoding", error
    # the connection's next request is answered (the refused body was not read as one)
    assert httpx.get(srv.base + "/healthz", timeout=10).status_code == 200


def test_the_openai_sdk_can_send_gzip_bodies(srv: Server) -> None:
    """openai-python with an httpx client that compresses every request body it sends."""
    from openai import OpenAI

    def compress(request: httpx.Request) -> None:
        if request.content:
            packed = gzip.compress(request.content)
            request.headers["content-encoding"] = "gzip"
            request.headers["content-length"] = str(len(packed))
            request.stream = httpx.ByteStream(packed)
            request._content = packed

    client = OpenAI(api_key="x", base_url=srv.v1, max_retries=0,
                    http_client=httpx.Client(event_hooks={"request": [compress]}, timeout=30))
    r = client.responses.create(model="hotloop-sim", input="Say hello.")
    assert r.status == "completed" and r.output_text


def test_a_transfer_coding_other_than_chunked_is_501(srv: Server) -> None:
    """``Transfer-Encoding: gzip, chunked``: the parser undid the chunked framing and the gzip
    was read as the body (a 400 for malformed JSON). RFC 9112, 6.1: 501."""
    import socket

    data = gzip.compress(json.dumps(_request("hi")).encode())
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    try:
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: gzip, chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        status, headers, body = _read_response(s)
    finally:
        s.close()
    assert status == 501, body[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "unsupported_transfer_encoding" and error["type"] == "invalid_request_error"
    assert headers["x-should-retry"] == "false"  # (a 5xx: the SDKs would retry it)
