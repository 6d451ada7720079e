"""The extension stubs are API (DESIGN principle 6): mypy.stubtest checks them against the
installed build, so a renamed parameter, a missing name or a stale default fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MODULES = ("hotloop._native", "hotloop._frames")


def test_stubtest_passes_on_the_installed_extensions(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HOTLOOP_PURE_PYTHON"}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", *MODULES],
        cwd=tmp_path,  # never pick up a source tree: check what is installed
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success" in proc.stdout
