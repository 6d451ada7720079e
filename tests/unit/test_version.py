"""One version everywhere: ``python/hotloop/__init__.py`` is the source, and the installed
metadata, ``hotloop --version`` and (when ``HOTLOOP_WHEEL`` names one) a built wheel agree with it.

The package metadata takes its version from ``hotloop.__version__`` (``dynamic`` in
``pyproject.toml``), so these fail when an install is stale or the wiring breaks.
"""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import hotloop

SOURCE_INIT = pathlib.Path(__file__).resolve().parents[2] / "python" / "hotloop" / "__init__.py"
# PEP 440, public versions only (no local "+..." part in a release).
PEP440 = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")


def _source_version() -> str:
    tree = ast.parse(SOURCE_INIT.read_text(encoding="utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise AssertionError(f"{SOURCE_INIT} has no literal __version__ = '...'")


def test_version_is_a_pep440_literal_in_the_source() -> None:
    assert PEP440.match(_source_version()), _source_version()


def test_installed_package_matches_the_source() -> None:
    assert hotloop.__version__ == _source_version()
    assert importlib.metadata.version("hotloop") == hotloop.__version__


def test_cli_version_matches_the_metadata() -> None:
    want = f"hotloop {importlib.metadata.version('hotloop')}"
    out = subprocess.run(
        [sys.executable, "-m", "hotloop", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == want
    script = shutil.which("hotloop", path=os.path.dirname(sys.executable))
    assert script is not None, "the hotloop console script is not installed beside python"
    out = subprocess.run([script, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == want


@pytest.mark.skipif(not os.environ.get("HOTLOOP_WHEEL"), reason="HOTLOOP_WHEEL names no wheel")
def test_wheel_metadata_matches_the_cli() -> None:
    wheel = pathlib.Path(os.environ["HOTLOOP_WHEEL"])
    name, version = wheel.name.split("-")[:2]
    assert name == "hotloop"
    with zipfile.ZipFile(wheel) as zf:
        meta_name = f"hotloop-{version}.dist-info/METADATA"
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode("utf-8"))
    assert meta["Version"] == version
    out = subprocess.run(
        [sys.executable, "-m", "hotloop", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"hotloop {version}"
