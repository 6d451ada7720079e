"""The compiled extensions are really loaded (a broken build must fail here, not hide).

CI sets ``HOTLOOP_REQUIRE_NATIVE=1``: then ``_accel.NATIVE`` must be True. Without it the native
modules must still import; the only way to skip is ``HOTLOOP_PURE_PYTHON=1``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import subprocess
import sys
import zipfile

import pytest

from hotloop import _accel

NATIVE_MODULES = ("hotloop._native", "hotloop._frames")
REQUIRE_NATIVE = os.environ.get("HOTLOOP_REQUIRE_NATIVE", "") == "1"
# the wheel under test (.ci/run): the pure-Python one holds no compiled module
WHEEL = os.environ.get("HOTLOOP_WHEEL", "")
PURE_WHEEL = WHEEL.endswith("-py3-none-any.whl")

skip_if_pure = pytest.mark.skipif(
    (_accel.PURE_REQUESTED and not REQUIRE_NATIVE) or PURE_WHEEL,
    reason="HOTLOOP_PURE_PYTHON=1 forces the pure twins, or the pure-Python wheel is under test",
)


@skip_if_pure
@pytest.mark.parametrize("name", NATIVE_MODULES)
def test_native_module_imports_from_a_compiled_extension(name: str) -> None:
    module = importlib.import_module(name)
    path = module.__file__
    assert path is not None
    assert path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), path


@skip_if_pure
def test_accel_resolved_every_name_natively() -> None:
    if _accel.PURE_REQUESTED:
        pytest.fail("HOTLOOP_REQUIRE_NATIVE=1 and HOTLOOP_PURE_PYTHON=1 contradict each other")
    assert _accel.IMPORT_ERRORS == {}
    assert _accel.NATIVE is True
    expected = {
        "Fingerprinter": "hotloop._native",
        "ItemChain": "hotloop._native",
        "SseDecoder": "hotloop._native",
        "TokenCounter": "hotloop._native",
        "SecretScanner": "hotloop._native",
        "DeltaLane": "hotloop._native",
        "plain_delta": "hotloop._native",
        "encode_delta": "hotloop._frames",
        "encode_sse": "hotloop._frames",
        "body_buffer": "hotloop._frames",
    }
    assert expected == _accel.BACKEND_NAMES
    for name, module_name in expected.items():
        assert getattr(_accel, name) is getattr(importlib.import_module(module_name), name)


def test_pure_switch_parsing() -> None:
    assert _accel.pure_requested({"HOTLOOP_PURE_PYTHON": "1"})
    assert _accel.pure_requested({"HOTLOOP_PURE_PYTHON": "true"})
    assert not _accel.pure_requested({"HOTLOOP_PURE_PYTHON": "0"})
    assert not _accel.pure_requested({})


@skip_if_pure
def test_a_failed_native_import_is_recorded_not_hidden() -> None:
    """If an extension cannot be imported, _accel falls back to the twins but says so."""
    script = (
        "import sys, json\n"
        "sys.modules['hotloop._frames'] = None  # makes `import hotloop._frames` raise ImportError\n"
        "from hotloop import _accel as a\n"
        "print(json.dumps([a.NATIVE, a.BACKEND_NAMES, sorted(a.IMPORT_ERRORS),\n"
        "                  a.encode_sse('t', b'{}').decode()]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HOTLOOP_PURE_PYTHON"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
        check=False, cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    native, names, errors, sse = json.loads(proc.stdout)
    assert native is False
    assert errors == ["hotloop._frames"]
    assert names["encode_sse"] == "hotloop._pure"
    assert names["Fingerprinter"] == "hotloop._native"
    assert sse == "event: t\ndata: {}\n\n"
    assert "native extensions unavailable" in proc.stderr


def test_without_any_compiled_module_it_runs_as_the_pure_wheel() -> None:
    """Neither compiled module installed (the pure-Python wheel): every name is a twin, and the
    log says why in words a user can act on, not as an import error."""
    script = (
        "import sys, json, importlib.abc\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name in ('hotloop._native', 'hotloop._frames'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        "from hotloop import _accel as a\n"
        "print(json.dumps([a.NATIVE, a.PURE_WHEEL, sorted(set(a.BACKEND_NAMES.values())), sorted(a.IMPORT_ERRORS)]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HOTLOOP_PURE_PYTHON"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [False, True, ["hotloop._pure"], ["hotloop._frames", "hotloop._native"]]
    assert "without its compiled modules (the pure-Python wheel" in proc.stderr
    assert "native extensions unavailable" not in proc.stderr
    assert not _accel.PURE_WHEEL or PURE_WHEEL  # (a build with its modules is never taken for it)


@pytest.mark.skipif(not PURE_WHEEL, reason="HOTLOOP_WHEEL names no pure-Python wheel")
def test_the_pure_wheel_holds_no_compiled_module_and_runs_the_twins() -> None:
    with zipfile.ZipFile(WHEEL) as zf:
        names = zf.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        wheel_file = zf.read(meta).decode()
    assert not [n for n in names if n.endswith((".so", ".pyd", ".c", ".pyx", ".pxi"))], names
    assert "Root-Is-Purelib: true" in wheel_file and "Tag: py3-none-any" in wheel_file.splitlines(), wheel_file
    assert "hotloop/_pure.py" in names and "hotloop/data/o200k_base.tiktoken.gz" in names
    assert _accel.PURE_WHEEL and not _accel.NATIVE
    assert set(_accel.BACKEND_NAMES.values()) == {"hotloop._pure"}
