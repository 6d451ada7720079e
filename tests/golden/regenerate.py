"""Rewrite the golden transcripts: ``python tests/golden/regenerate.py`` (with hotloop installed)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.golden.transcripts import CASES, path, render  # noqa: E402

if __name__ == "__main__":
    for name in CASES:
        for transport in ("sse", "ws"):
            p = path(name, transport)
            p.parent.mkdir(exist_ok=True)
            p.write_bytes(render(name, transport))
            print("wrote", p)
