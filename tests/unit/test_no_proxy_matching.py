"""Which backend origins the lean transport reaches directly under HTTPS_PROXY/HTTP_PROXY and
NO_PROXY: never one that the SDK transport (httpx, which the backend uses when a proxy applies)
would reach through the proxy."""

from __future__ import annotations

import httpx
import pytest

from hotloop.backends.chat.http1 import proxy_for

PROXY = "http://proxy.internal:3128"

# (NO_PROXY, backend URL, the lean transport connects directly)
CASES = [
    ("example.com", "https://example.com", True),
    ("example.com", "https://api.example.com", True),
    ("example.com", "https://badexample.com", False),
    ("EXAMPLE.COM", "https://example.com", True),
    ("example.com", "https://API.Example.com", True),
    (".example.com", "https://api.example.com", True),
    # a leading dot: subdomains only, as httpx reads it (urllib and curl take the domain too,
    # and the lean transport went direct where the sdk transport used the proxy)
    (".example.com", "https://example.com", False),
    ("*", "https://example.com", True),
    ("localhost,*", "https://example.com", True),  # "*" among others: httpx bypasses all too
    (" example.com , other.org", "https://example.com", True),
    ("*.example.com", "https://api.example.com", False),  # not a NO_PROXY form: the proxy applies
    ("10.1.2.3", "http://10.1.2.3:8000", True),
    ("10.0.0.0/8", "http://10.1.2.3", False),  # no CIDR ranges (neither httpx nor urllib)
    ("::1", "http://[::1]:8000", True),
    ("localhost", "http://localhost:8000", True),
    ("localhost", "http://api.localhost:8000", False),  # httpx: localhost itself only
    ("127.0.0.1", "http://localhost:8000", False),  # names are not resolved
    ("example.com:8443", "https://example.com:8443", False),  # ports: left to the sdk transport
]


@pytest.fixture
def proxied(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy", "REQUEST_METHOD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", PROXY)
    monkeypatch.setenv("HTTP_PROXY", PROXY)
    return monkeypatch


@pytest.mark.parametrize("no_proxy,url,direct", CASES)
def test_no_proxy_exempts_an_origin_as_the_sdk_transport_reads_it(
    proxied: pytest.MonkeyPatch, no_proxy: str, url: str, direct: bool
) -> None:
    proxied.setenv("NO_PROXY", no_proxy)
    assert (proxy_for(url) is None) is direct
    if direct:  # the sdk transport (httpx) reaches it directly too
        client = httpx.Client()
        try:
            assert client._transport_for_url(httpx.URL(url)) is client._transport
        finally:
            client.close()


def test_no_proxy_in_lower_case_and_without_a_proxy(proxied: pytest.MonkeyPatch) -> None:
    proxied.setenv("no_proxy", ".example.com")
    assert proxy_for("https://example.com") == PROXY
    assert proxy_for("https://api.example.com") is None
    proxied.delenv("HTTPS_PROXY")
    assert proxy_for("https://example.com") is None  # HTTP_PROXY is for http:// origins
    assert proxy_for("http://example.com") == PROXY
