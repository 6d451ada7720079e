"""the ``hotloop:deleted`` subscription keeping the process-wide caches of replicas coherent.

README ("Workers on one host"): "With ``--store redis`` every process is told at once (the
``hotloop:deleted`` channel)"; shared.SharedPersistence._listen forgets the whole cache when its
subscription was interrupted. Here B's TCP flows to Redis are silently dropped (a NAT or load
balancer idle timeout, a partition without RST, a VM migration): Redis keeps B's subscriber on
the channel, B's subscriber reads its dead socket forever (no socket timeout, no health check:
``pubsub.listen()`` blocks without a bound), and a response deleted through A stays served by B
from its process-wide cache for as long as it stays there (up to its 30-day TTL).

"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import Server, free_port, run_server
from tests.integration.test_scaleout import poll
from tests.services import redis_server

pytestmark = pytest.mark.timeout(120)

WAIT = 10.0
DETECT = 30.0  # a generous bound for noticing a dead subscription (a fix's heartbeat is ~5 s)


class BlackholeProxy:
    """A TCP proxy to ``127.0.0.1:upstream``; :meth:`blackhole` silently drops every flow open
    now (both directions: nothing forwarded, no FIN, no RST) while new connections work."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.port = free_port()
        self._srv = socket.create_server(("127.0.0.1", self.port))
        self._srv.settimeout(0.2)
        self._flows: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._srv.accept()
            except OSError:
                continue
            u = socket.create_connection(("127.0.0.1", self.upstream), timeout=2)
            u.settimeout(None)
            c.settimeout(None)
            flow = {"socks": (c, u), "dead": False}
            with self._lock:
                self._flows.append(flow)
            for src, dst in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(flow, src, dst), daemon=True).start()

    def _pump(self, flow: dict[str, Any], src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not flow["dead"]:
                    dst.sendall(data)
        except OSError:
            pass
        if not flow["dead"]:
            for s in flow["socks"]:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def blackhole(self) -> None:
        with self._lock:
            for flow in self._flows:
                flow["dead"] = True

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        with self._lock:
            for flow in self._flows:
                for s in flow["socks"]:
                    with contextlib.suppress(OSError):
                        s.close()


@contextlib.contextmanager
def proxy_to(port: int) -> Iterator[BlackholeProxy]:
    p = BlackholeProxy(port)
    try:
        yield p
    finally:
        p.close()


def replica(tmp: Path, url: str) -> contextlib.AbstractContextManager[Server]:
    return run_server(tmp, "--store", "redis", "--redis-url", url, "--sim-rate", "0")


def create(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", **body}, timeout=30)


def subscribers(url: str) -> int:
    import redis as redis_py

    c = redis_py.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=1)
    try:
        return int(dict(c.pubsub_numsub("hotloop:deleted"))[b"hotloop:deleted"])
    finally:
        c.close()


def test_delete_on_a_is_seen_by_b_whose_redis_flow_was_silently_dropped(tmp_path: Path) -> None:
    with redis_server(tmp_path) as redis, proxy_to(redis.port) as proxy:
        with replica(tmp_path, redis.url) as a, replica(tmp_path, proxy.url) as b:
            poll(lambda: subscribers(redis.url) == 2, "both subscribers", WAIT)
            r1 = create(a, {"input": "Remember 7.", "store": True})
            assert r1.status_code == 200, r1.text
            rid = r1.json()["id"]
            # B holds the response in its process-wide cache
            assert create(b, {"input": "more", "previous_response_id": rid, "store": False}).status_code == 200
            assert httpx.get(f"{b.v1}/responses/{rid}", timeout=10).status_code == 200

            proxy.blackhole()  # B's flows to Redis die silently; B's new connections work
            # B's own Redis clients recover (its store answers again through new connections)
            poll(lambda: httpx.get(f"{b.v1}/responses/resp_nope", timeout=20).status_code == 404,
                 "B's store to answer again", wait=DETECT)

            assert httpx.delete(f"{a.v1}/responses/{rid}", timeout=10).status_code == 200
            assert httpx.get(f"{a.v1}/responses/{rid}", timeout=10).status_code == 404

            # within a bound, B stops serving what was deleted (it cannot know what it missed:
            # it must notice that its subscription is dead, resubscribe and forget its cache)
            deadline = time.monotonic() + DETECT
            while True:
                got = httpx.get(f"{b.v1}/responses/{rid}", timeout=20)
                if got.status_code == 404:
                    break
                assert time.monotonic() < deadline, (
                    f"B still serves the response deleted through A {DETECT:.0f} s later ({got.status_code}): "
                    "its subscription to hotloop:deleted is dead and nothing notices"
                )
                time.sleep(0.5)
            cont = create(b, {"input": "x", "previous_response_id": rid})
            assert cont.status_code == 400, cont.text
