"""The one place that picks native or pure-Python implementations.

Import accelerated names from here, never from ``hotloop._native``, ``hotloop._frames`` or
``hotloop._pure`` directly::

    from hotloop._accel import Fingerprinter, ItemChain, SseDecoder, encode_delta
    from hotloop._accel import SecretScanner, SECRET_PATTERNS, TokenCounter

``HOTLOOP_PURE_PYTHON=1`` (also ``true``/``yes``/``on``) forces the pure twins. Otherwise the
compiled extensions are imported; if one fails to import, its names fall back to the twins and
the failure is recorded: ``NATIVE`` is False, ``BACKEND_NAMES`` says which module each name came
from and ``IMPORT_ERRORS`` says why, so tests (and ``HOTLOOP_REQUIRE_NATIVE=1`` in CI) can
refuse a silently broken build. The twins give identical results, only slower. ``PURE_WHEEL``:
no compiled module is installed at all (the pure-Python wheel), which the log says in those words.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING, Any

from hotloop import _pure

__all__ = [
    "BACKEND_NAMES",
    "DeltaLane",
    "IMPORT_ERRORS",
    "NATIVE",
    "PLAIN_ARGUMENTS",
    "PLAIN_NOTHING",
    "PLAIN_REASONING",
    "PLAIN_TEXT",
    "PURE_REQUESTED",
    "PURE_WHEEL",
    "SECRET_PATTERNS",
    "Fingerprinter",
    "ItemChain",
    "SecretScanner",
    "SseDecoder",
    "TokenCounter",
    "body_buffer",
    "encode_delta",
    "encode_sse",
    "plain_delta",
]

PURE_ENV = "HOTLOOP_PURE_PYTHON"


def pure_requested(environ: Any = None) -> bool:
    """True when the environment asks for the pure-Python twins."""
    value = (os.environ if environ is None else environ).get(PURE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


PURE_REQUESTED: bool = pure_requested()

# module providing each name -> the names it provides
_PROVIDERS: dict[str, tuple[str, ...]] = {
    "hotloop._native": (
        "Fingerprinter", "ItemChain", "SseDecoder", "SecretScanner", "DeltaLane", "plain_delta", "TokenCounter",
    ),
    "hotloop._frames": ("encode_delta", "encode_sse", "body_buffer"),
}


def _resolve() -> tuple[dict[str, Any], dict[str, str], dict[str, str], set[str]]:
    impls: dict[str, Any] = {}
    names: dict[str, str] = {}
    errors: dict[str, str] = {}
    absent: set[str] = set()  # not installed at all (the pure-Python wheel ships none), not broken
    for module_name, provided in _PROVIDERS.items():
        module: Any = _pure
        source = "hotloop._pure"
        if not PURE_REQUESTED:
            try:
                module = importlib.import_module(module_name)
                source = module_name
            except ImportError as exc:
                errors[module_name] = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, ModuleNotFoundError) and exc.name == module_name:
                    absent.add(module_name)
        for name in provided:
            impls[name] = getattr(module, name)
            names[name] = source
    return impls, names, errors, absent


_IMPLS, _NAMES, _ERRORS, _ABSENT = _resolve()

#: which module each accelerated name resolved to ("hotloop._native", ..., or "hotloop._pure")
BACKEND_NAMES: dict[str, str] = _NAMES
#: extension modules that failed to import (empty when all loaded or when pure was requested)
IMPORT_ERRORS: dict[str, str] = _ERRORS
#: True when every accelerated name is native
NATIVE: bool = all(src != "hotloop._pure" for src in _NAMES.values())

#: True when no compiled module is installed (the pure-Python wheel, ``py3-none-any``)
PURE_WHEEL: bool = _ABSENT == set(_PROVIDERS)

if PURE_WHEEL:
    logging.getLogger("hotloop").warning(
        "hotloop is installed without its compiled modules (the pure-Python wheel, which pip picks "
        "where no wheel for this CPython and platform exists): the pure-Python twins run instead, "
        "with the same results, using more CPU per turn and per streamed token"
    )
elif _ERRORS:
    logging.getLogger("hotloop").warning(
        "hotloop native extensions unavailable, using pure-Python twins: %s",
        "; ".join(f"{m}: {e}" for m, e in sorted(_ERRORS.items())),
    )

if TYPE_CHECKING:
    from hotloop._frames import body_buffer as body_buffer
    from hotloop._frames import encode_delta as encode_delta
    from hotloop._frames import encode_sse as encode_sse
    from hotloop._native import Fingerprinter as Fingerprinter
    from hotloop._native import ItemChain as ItemChain
    from hotloop._native import SecretScanner as SecretScanner
    from hotloop._native import DeltaLane as DeltaLane
    from hotloop._native import SseDecoder as SseDecoder
    from hotloop._native import TokenCounter as TokenCounter
    from hotloop._native import plain_delta as plain_delta
else:
    Fingerprinter = _IMPLS["Fingerprinter"]
    ItemChain = _IMPLS["ItemChain"]
    SseDecoder = _IMPLS["SseDecoder"]
    SecretScanner = _IMPLS["SecretScanner"]
    encode_delta = _IMPLS["encode_delta"]
    encode_sse = _IMPLS["encode_sse"]
    body_buffer = _IMPLS["body_buffer"]
    DeltaLane = _IMPLS["DeltaLane"]
    plain_delta = _IMPLS["plain_delta"]
    TokenCounter = _IMPLS["TokenCounter"]

#: the one secret pattern table; both ``SecretScanner`` implementations are built from it
SECRET_PATTERNS = _pure.SECRET_PATTERNS
#: redaction of given spans (not twins: plain Python under both implementations)
splice, redact_spans = _pure.splice, _pure.redact_spans
#: the kinds of plain delta (``plain_delta``, ``DeltaLane``), the same in both implementations
PLAIN_NOTHING, PLAIN_TEXT, PLAIN_REASONING, PLAIN_ARGUMENTS = (
    _pure.PLAIN_NOTHING, _pure.PLAIN_TEXT, _pure.PLAIN_REASONING, _pure.PLAIN_ARGUMENTS,
)


def implementations() -> dict[str, dict[str, Any]]:
    """Both implementations of every accelerated name: ``{"native": {...}, "pure": {...}}``.

    For tests and benchmarks that compare the two. The native modules are imported here and now,
    so a missing or broken build raises ``ImportError`` instead of falling back silently.
    """
    native: dict[str, Any] = {}
    for module_name, provided in _PROVIDERS.items():
        module = importlib.import_module(module_name)
        for name in provided:
            native[name] = getattr(module, name)
    return {"native": native, "pure": {name: getattr(_pure, name) for name in native}}

