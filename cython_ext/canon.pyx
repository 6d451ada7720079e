# cython: language_level=3, boundscheck=False, wraparound=False, autotestdict=False
"""Canonical JSON for fingerprinting conversation items (``hotloop._canon``).

``canonical_json(obj)`` equals, byte for byte,
``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
allow_nan=False).encode("utf-8")``, with nesting bounded at ``MAX_DEPTH`` containers. The pure
twin is ``hotloop._pure.canonical_json``; see ``_canon.pyi`` for the full contract.
"""

from libc.math cimport isfinite
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.dict cimport PyDict_Keys, PyDict_Items

include "_jsonbuf.pxi"

cdef enum:
    _MAX_DEPTH = 256

MAX_DEPTH = _MAX_DEPTH


cdef int _raise_surrogate(object s) except -1:
    # The str holds a lone surrogate: let the codec raise its own UnicodeEncodeError.
    s.encode("utf-8")
    raise UnicodeEncodeError("utf-8", s, 0, len(s), "surrogates not allowed")


cdef int _float(JBuf* b, object o) except -1:
    cdef double d = PyFloat_AS_DOUBLE(o)
    if not isfinite(d):
        raise ValueError("Out of range float values are not JSON compliant: " + float.__repr__(o))
    return jb_double(b, d)


cdef int _key(JBuf* b, object k) except -1:
    # Same coercion order as json's C encoder: str, float, True/False/None, int.
    if isinstance(k, str):
        if jb_str(b, k):
            _raise_surrogate(k)
    elif isinstance(k, float):
        jb_byte(b, b'"')
        _float(b, k)
        jb_byte(b, b'"')
    elif k is True:
        jb_write(b, b'"true"', 6)
    elif k is False:
        jb_write(b, b'"false"', 7)
    elif k is None:
        jb_write(b, b'"null"', 6)
    elif isinstance(k, int):
        jb_byte(b, b'"')
        jb_int(b, k)
        jb_byte(b, b'"')
    else:
        raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")
    return 0


cdef int _too_deep() except -1:
    raise ValueError(f"canonical_json: nesting deeper than {_MAX_DEPTH} containers")


cdef int _value(JBuf* b, object o, int depth) except -1:
    cdef bint first
    cdef list keys
    cdef list items
    if o is None:
        jb_write(b, b"null", 4)
    elif o is True:
        jb_write(b, b"true", 4)
    elif o is False:
        jb_write(b, b"false", 5)
    elif isinstance(o, str):
        if jb_str(b, o):
            _raise_surrogate(o)
    elif isinstance(o, int):
        jb_int(b, o)
    elif isinstance(o, float):
        _float(b, o)
    elif isinstance(o, (list, tuple)):
        if depth >= _MAX_DEPTH:
            _too_deep()
        jb_byte(b, b'[')
        first = True
        if type(o) is list:
            for x in <list>o:
                if not first:
                    jb_byte(b, b',')
                first = False
                _value(b, x, depth + 1)
        elif type(o) is tuple:
            for x in <tuple>o:
                if not first:
                    jb_byte(b, b',')
                first = False
                _value(b, x, depth + 1)
        else:
            for x in o:
                if not first:
                    jb_byte(b, b',')
                first = False
                _value(b, x, depth + 1)
        jb_byte(b, b']')
    elif isinstance(o, dict):
        if depth >= _MAX_DEPTH:
            _too_deep()
        jb_byte(b, b'{')
        first = True
        if type(o) is dict:
            keys = PyDict_Keys(o)
            for k in keys:
                if type(k) is not str:
                    break
            else:
                # All keys are exact str: sorting keys orders exactly like sorting items.
                keys.sort()
                for k in keys:
                    if not first:
                        jb_byte(b, b',')
                    first = False
                    if jb_str(b, k):
                        _raise_surrogate(k)
                    jb_byte(b, b':')
                    _value(b, (<dict>o)[k], depth + 1)
                jb_byte(b, b'}')
                return 0
            items = PyDict_Items(o)
        else:
            items = list(o.items())
        # json sorts the (key, value) items before coercing keys; so do we.
        items.sort()
        for k, v in items:
            if not first:
                jb_byte(b, b',')
            first = False
            _key(b, k)
            jb_byte(b, b':')
            _value(b, v, depth + 1)
        jb_byte(b, b'}')
    else:
        raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")
    return 0


def canonical_json(obj):
    """Deterministic compact JSON (UTF-8 bytes) of a JSON-able value; see ``_canon.pyi``."""
    cdef char stack[1024]
    cdef JBuf b
    jb_init(&b, stack, 1024)
    try:
        _value(&b, obj, 0)
        return jb_bytes(&b)
    finally:
        jb_free(&b)
