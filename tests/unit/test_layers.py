"""Layering rules from DESIGN.md, checked on the installed package's source."""

from __future__ import annotations

import ast
import re
from importlib import resources
from pathlib import Path

import hotloop

PKG = Path(hotloop.__file__).parent
FORBIDDEN_IN_PROTOCOL = {
    "asyncio", "socket", "selectors", "time", "threading", "concurrent", "sqlite3",
    "uvicorn", "uvloop", "httpx", "websockets", "cerebras",
    "hotloop.server", "hotloop.backends", "hotloop.state", "hotloop.pipeline",
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_protocol_is_sans_io() -> None:
    files = sorted((PKG / "protocol").glob("*.py"))
    assert len(files) >= 6
    for f in files:
        for name in imports_of(f):
            for bad in FORBIDDEN_IN_PROTOCOL:
                assert name != bad and not name.startswith(bad + "."), f"{f.name} imports {name}"


def test_wire_event_names_live_in_events_module_only() -> None:
    pattern = re.compile(r"""["']response\.[a-z_]+(\.[a-z_]+)*["']""")
    offenders = []
    for f in PKG.rglob("*.py"):
        if f.name == "events.py" and f.parent.name == "protocol":
            continue
        for lineno, line in enumerate(f.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{f.relative_to(PKG)}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_vocabulary_ships_with_package() -> None:
    data = resources.files("hotloop").joinpath("data/o200k_base.tiktoken.gz")
    assert data.is_file()


def test_the_vocabulary_is_the_shipped_files_tokens_and_ranks() -> None:
    """The start-up parse (ranks taken from line order) gives what reading each line's own rank
    gives, as tiktoken's ``load_tiktoken_bpe`` does."""
    import base64
    import gzip

    from hotloop import tokenizer

    raw = gzip.decompress(resources.files("hotloop").joinpath("data/o200k_base.tiktoken.gz").read_bytes())
    expected = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in raw.splitlines() if line)}
    assert len(expected) == 199998
    assert tokenizer._vocabulary() == expected
