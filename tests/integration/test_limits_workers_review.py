"""Two ``--workers`` servers on one data directory (real processes): the second one's start and
stop must leave the first one's shared limits file alone, so a key's limit holds across both."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import run_server
from tests.integration.test_tenants import ADMIN_KEY, create_key


def test_a_second_server_on_the_data_directory_leaves_the_first_ones_limits(tmp_path: Path) -> None:
    data = tmp_path / "data"
    key = create_key(data, "capped", "--rpm", "4")  # one request back every 15 s: none within the test
    env = {"HOTLOOP_DATA_DIR": str(data), "HOTLOOP_API_KEY": ADMIN_KEY}
    auth = {"Authorization": f"Bearer {key}"}
    limits_file = data / "hotloop-limits.sqlite3"
    with run_server(tmp_path, "--workers", "2", "--sim-rate", "0", env=env) as first:
        for _ in range(2):
            assert httpx.get(first.base + "/hotloop/stats", headers=auth, timeout=10).status_code == 200
        with run_server(tmp_path, "--workers", "2", "--sim-rate", "0", env=env) as second:
            for _ in range(2):  # the key's 3rd and 4th requests: the second server did not empty the file
                r = httpx.get(second.base + "/hotloop/stats", headers=auth, timeout=10)
                assert r.status_code == 200, r.text
            r = httpx.get(second.base + "/hotloop/stats", headers=auth, timeout=10)
            assert r.status_code == 429, "the second server started with the key's whole limit again"
        assert limits_file.exists(), "the second server removed the first one's limits file on its way out"
        for _ in range(3):  # whichever worker: the 5th request and more are over the limit
            r = httpx.get(first.base + "/hotloop/stats", headers=auth, timeout=10)
            assert r.status_code == 429, r.text
    assert not limits_file.exists()  # the last server to stop removes it
