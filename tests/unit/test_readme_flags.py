"""The README's table of ``hotloop serve`` flags lists exactly the flags the command takes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from hotloop.cli import _parser

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_serve_flag_is_documented_and_every_documented_flag_exists() -> None:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    flags = {o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    section = README.read_text().split("## Running the server", 1)[1].split("\n### ", 1)[0]
    documented = set(re.findall(r"^\| `(--[a-z0-9-]+)`", section, re.M))
    assert len(flags) > 20
    assert sorted(flags - documented) == [] and sorted(documented - flags) == []
