"""The installed package type-checks (mypy), so annotations stay true as the code changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_mypy_on_installed_package(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--no-incremental", "-p", "hotloop"],
        cwd=tmp_path,  # check what is installed, not a source tree
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
