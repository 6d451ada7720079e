"""The ``--workers`` supervisor's socket bookkeeping, without forking: a stop's signal handler
closes every socket between any two steps of the supervisor's loop."""

from __future__ import annotations

import socket
import time

from hotloop.config import Config
from hotloop.server.workers import Supervisor, _bind


def test_a_stop_closing_the_sockets_mid_close_idle_does_not_crash_the_supervisor() -> None:
    """Slot 1 waits for its replacement while slot 0 listens. A SIGTERM's handler (``stop``)
    closed every socket after ``_close_idle`` had taken them from the list: asking a closed
    socket whether it listens raised EBADF, and the supervisor died with a traceback instead of
    stopping its workers."""
    first = _bind("127.0.0.1", 0)
    first.listen(8)
    port = first.getsockname()[1]
    second = _bind("127.0.0.1", port)
    sup = Supervisor(Config(workers=2), [first, second])
    sup.due[1] = time.monotonic() + 60
    first.close()  # as stop() does, while the loop still holds them
    second.close()
    sup._close_idle()  # nothing listens any more: nothing to do, and no error
    assert first.fileno() == -1 and second.fileno() == -1


def test_close_idle_closes_a_waiting_slot_s_socket_while_another_listens() -> None:
    first = _bind("127.0.0.1", 0)
    first.listen(8)
    port = first.getsockname()[1]
    second = _bind("127.0.0.1", port)
    second.listen(8)
    sup = Supervisor(Config(workers=2), [first, second])
    sup.due[1] = time.monotonic() + 60
    try:
        sup._close_idle()
        assert sup.socks[1] is None and second.fileno() == -1
        assert sup.socks[0] is first and first.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    finally:
        first.close()
