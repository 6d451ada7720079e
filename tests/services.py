"""Real services the scale-out tests start on free loopback ports: ``redis-server`` and ``nginx``.

A missing binary fails the test with a clear message under CI (``CI=true``: ``.ci/run`` installs
both Debian packages) and skips it elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import free_port

START_TIMEOUT = 10.0


def require(binary: str, package: str, module: bool = False) -> str:
    """The path of ``binary``; fails under CI, skips elsewhere, when it is not installed
    (``module``: called while a test module is collected, for all of its tests)."""
    found = shutil.which(binary) or next(
        (p for d in ("/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin") if os.access(p := f"{d}/{binary}", os.X_OK)),
        None,
    )
    if found:
        return found
    msg = f"{binary} is not installed (Debian package {package!r}; .ci/run installs it)"
    if os.environ.get("CI"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg, allow_module_level=module)


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited early:\n{log.read_text(errors='replace')}")
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.02)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


class Redis:
    """A ``redis-server`` on a free port (no persistence); :meth:`stop` and :meth:`start` again
    on the same port (an outage)."""

    def __init__(self, tmp: Path, persist: bool = False) -> None:
        self.binary = require("redis-server", "redis-server")
        self.port = free_port()
        self.tmp = tmp / f"redis-{self.port}"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.persist = persist  # an append-only file (fsync always): a restart keeps the data
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.tmp / "redis.log"

    def start(self) -> None:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.tmp)]
        cmd += ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        wait_port(self.port, self.proc, "redis-server", self.log)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
        self.proc = None


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[Redis]:
    r = Redis(tmp)
    r.start()
    try:
        yield r
    finally:
        r.stop()
