"""The operational endpoints and the key CLI, from the point of view of one key against another:
real server processes, real HTTP and WebSocket handshakes, the real CLI."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, run_server
from tests.integration.test_tenants import ADMIN_KEY, create_key, hotloop

TIMEOUT = 30


class Keyed:
    def __init__(self, server: Server, data: Path, keys: dict[str, str]) -> None:
        self.server = server
        self.data = data
        self.keys = keys

    def get(self, path: str, key: str | None = None, headers: list[tuple[str, str]] | None = None) -> httpx.Response:
        hdrs = list(headers or [])
        if key is not None:
            hdrs.append(("Authorization", f"Bearer {self.keys[key]}"))
        return httpx.get(self.server.base + path, headers=hdrs, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    tmp = tmp_path_factory.mktemp("ops")
    data = tmp / "data"
    keys = {name: create_key(data, name) for name in ("alice", "bob")}
    keys["admin"] = ADMIN_KEY
    env = {"HOTLOOP_DATA_DIR": str(data), "HOTLOOP_API_KEY": ADMIN_KEY}
    with run_server(tmp, "--sim-rate", "0", "--metrics-per-key", env=env) as srv:
        yield Keyed(srv, data, keys)


def _refused(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in r.text and "/python/" not in r.text
    return body["error"]  # type: ignore[no-any-return]


def test_per_key_metrics_are_not_served_to_another_key(keyed: Keyed) -> None:
    """--metrics-per-key labels the per-response series with every key's name and counts its
    tokens: the usage of every key, which /hotloop/usage shows to the admin key alone. A tenant's
    key read all of it from /metrics (and the names of the other keys)."""
    r = httpx.post(
        keyed.server.v1 + "/responses", json={"model": "hotloop-sim", "input": "alice's work"},
        headers={"Authorization": f"Bearer {keyed.keys['alice']}"}, timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    as_bob = keyed.get("/metrics", "bob")
    assert 'tenant="alice"' not in as_bob.text
    err = _refused(as_bob, 403)
    assert err["type"] == "invalid_request_error" and "admin" in err["message"]
    admin = keyed.get("/metrics", "admin")
    assert admin.status_code == 200 and 'tenant="alice"' in admin.text
    # what a tenant's key may still read: its own usage, and the stats (counters, no content)
    assert {row["key"] for row in keyed.get("/hotloop/usage", "bob").json()["data"]} <= {"bob"}
    assert keyed.get("/hotloop/stats", "bob").status_code == 200


def test_two_authorization_headers_are_refused(keyed: Keyed) -> None:
    """Authorization is a singleton field (RFC 9110): with two, the first one was taken, so what
    a front proxy checks (often the last) and what hotloop used could be different keys."""
    good, bad = f"Bearer {keyed.keys['alice']}", "Bearer not-a-key"
    for pair in ([good, bad], [bad, good], [good, good]):
        hdrs = [("Authorization", v) for v in pair]
        err = _refused(keyed.get("/hotloop/usage", headers=hdrs), 401)
        assert err["code"] == "invalid_api_key" and "one Authorization header" in err["message"]
        with pytest.raises(InvalidStatus) as ei:
            with ws_connect(keyed.server.ws + "/responses", open_timeout=10, additional_headers=hdrs):
                pass
        assert ei.value.response.status_code == 401


def test_header_forms(keyed: Keyed) -> None:
    """What holds: the scheme in any case and extra spaces are accepted; a key elsewhere than in
    ``Authorization: Bearer`` (``api-key``, the query string, another scheme) is not."""
    alice = keyed.keys["alice"]
    for value in (f"bearer {alice}", f"BEARER   {alice}"):
        assert keyed.get("/hotloop/usage", headers=[("authorization", value)]).status_code == 200, value
    for hdrs, query in (
        ([("api-key", alice)], ""), ([], f"?api_key={alice}"), ([], f"?key={alice}"),
        ([("Authorization", f"Basic {alice}")], ""), ([("Authorization", alice)], ""),
    ):
        assert _refused(keyed.get("/hotloop/usage" + query, headers=hdrs), 401)["code"] == "invalid_api_key"


def test_metrics_public_without_metrics_is_no_server_error(tmp_path: Path) -> None:
    """``--metrics-public --no-metrics``: GET /metrics skipped authentication for a route that
    does not exist, and the route code then failed on the missing caller (a 500 and a logged
    traceback). It is an unknown route like any other: a key is needed, then 404."""
    env = {"HOTLOOP_API_KEY": ADMIN_KEY}
    with run_server(tmp_path, "--sim-rate", "0", "--no-metrics", "--metrics-public", env=env) as srv:
        r = httpx.get(srv.base + "/metrics", timeout=TIMEOUT)
        assert _refused(r, 401)["code"] == "invalid_api_key"
        r = httpx.get(srv.base + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=TIMEOUT)
        _refused(r, 404)
        assert "Traceback" not in srv.logs()


@pytest.mark.parametrize("args", [("usage",), ("usage", "--key", "alice"), ("keys", "list"), ("keys", "revoke", "alice")])
def test_read_only_cli_commands_do_not_create_a_store(tmp_path: Path, args: tuple[str, ...]) -> None:
    """``hotloop usage`` and ``keys list|revoke`` on a data dir that holds no store (a typo, the
    wrong HOTLOOP_DATA_DIR) created an empty one there (and a fingerprint key) and answered as if
    nothing had ever been recorded."""
    data = tmp_path / "nowhere" / "data"
    p = hotloop(data, *args)
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert "no store" in p.stderr and str(data) in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "nowhere").exists()


def test_the_store_the_key_cli_creates_is_private(tmp_path: Path) -> None:
    """``hotloop keys create`` on a fresh data dir (the documented first step) created the
    directory 0755 and the SQLite file 0644 (umask 022): every local user could read the key
    table, and later every tenant's stored responses, which the server writes to the same file.
    The fingerprint key beside it is 0600 already."""
    data = tmp_path / "fresh"
    create_key(data, "first")
    for path in (data, data / "hotloop.sqlite3", *data.glob("hotloop.sqlite3-*")):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, (path.name, oct(mode))
    assert "first" in hotloop(data, "keys", "list").stdout  # and it works as before


def test_the_store_the_server_creates_is_private(tmp_path: Path) -> None:
    """The same when ``hotloop serve`` is what first makes the data dir and its store."""
    data = tmp_path / "served"
    with run_server(tmp_path, "--sim-rate", "0", env={"HOTLOOP_DATA_DIR": str(data)}) as srv:
        r = httpx.post(srv.v1 + "/responses", json={"model": "m", "input": "hi", "store": True}, timeout=30)
        assert r.status_code == 200
    paths = [data, data / "hotloop.sqlite3", *data.glob("hotloop.sqlite3-*")]
    assert len(paths) >= 2 and (data / "hotloop.sqlite3").exists()
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, (path.name, oct(path.stat().st_mode))
