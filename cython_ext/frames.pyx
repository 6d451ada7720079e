# cython: language_level=3, boundscheck=False, wraparound=False, autotestdict=False
"""Per-token event encoders (``hotloop._frames``).

``encode_delta`` writes one streaming delta event as JSON, byte-identical to
``msgspec.json.encode`` of the dict the pure twin (``hotloop._pure.encode_delta``) builds;
``encode_sse`` frames a payload as one Server-Sent Event. Inputs outside the fast path
(non-exact types, ints outside int64, lone surrogates) are handed to the pure twin, so results
and exceptions are the twin's by construction.
"""

from cpython.long cimport PyLong_AsLongLongAndOverflow

include "_jsonbuf.pxi"

cdef object _pure_delta = None
cdef object _pure_sse = None


cdef object _twin_delta(event_type, sequence_number, item_id, output_index, content_index, delta,
                        logprobs):
    global _pure_delta
    if _pure_delta is None:
        from hotloop._pure import encode_delta
        _pure_delta = encode_delta
    return _pure_delta(event_type, sequence_number, item_id, output_index, content_index, delta,
                       logprobs)


cdef object _twin_sse(event_type, payload):
    global _pure_sse
    if _pure_sse is None:
        from hotloop._pure import encode_sse
        _pure_sse = encode_sse
    return _pure_sse(event_type, payload)


def encode_delta(event_type, sequence_number, item_id, output_index, content_index, delta,
                 logprobs):
    """The JSON bytes of one streaming delta event; see ``_frames.pyi``."""
    cdef char stack[512]
    cdef JBuf b
    cdef long long seq, oi, ci
    cdef int ov = 0
    if not (type(event_type) is str and type(item_id) is str and type(delta) is str
            and type(sequence_number) is int and type(output_index) is int
            and type(content_index) is int and (logprobs is True or logprobs is False)):
        return _twin_delta(event_type, sequence_number, item_id, output_index, content_index,
                           delta, logprobs)
    seq = PyLong_AsLongLongAndOverflow(sequence_number, &ov)
    if ov == 0:
        oi = PyLong_AsLongLongAndOverflow(output_index, &ov)
    if ov == 0:
        ci = PyLong_AsLongLongAndOverflow(content_index, &ov)
    if ov != 0:
        return _twin_delta(event_type, sequence_number, item_id, output_index, content_index,
                           delta, logprobs)
    jb_init(&b, stack, 512)
    try:
        jb_write(&b, b'{"type":', 8)
        if jb_str(&b, event_type):
            return _twin_delta(event_type, sequence_number, item_id, output_index,
                               content_index, delta, logprobs)
        jb_write(&b, b',"sequence_number":', 19)
        jb_longlong(&b, seq)
        jb_write(&b, b',"item_id":', 11)
        if jb_str(&b, item_id):
            return _twin_delta(event_type, sequence_number, item_id, output_index,
                               content_index, delta, logprobs)
        jb_write(&b, b',"output_index":', 16)
        jb_longlong(&b, oi)
        if ci >= 0:
            jb_write(&b, b',"content_index":', 17)
            jb_longlong(&b, ci)
        jb_write(&b, b',"delta":', 9)
        if jb_str(&b, delta):
            return _twin_delta(event_type, sequence_number, item_id, output_index,
                               content_index, delta, logprobs)
        if logprobs is True:
            jb_write(&b, b',"logprobs":[]}', 15)
        else:
            jb_byte(&b, b'}')
        return jb_bytes(&b)
    finally:
        jb_free(&b)


def encode_sse(event_type, payload):
    """``b"event: " + event_type + b"\\ndata: " + payload + b"\\n\\n"``; see ``_frames.pyi``."""
    cdef Py_ssize_t tl, n
    cdef char* p
    cdef bytes out
    if not (type(event_type) is str and type(payload) is bytes and PyUnicode_IS_ASCII(event_type)):
        return _twin_sse(event_type, payload)
    tl = PyUnicode_GET_LENGTH(event_type)
    n = PyBytes_GET_SIZE(payload)
    out = PyBytes_FromStringAndSize(NULL, tl + n + 16)
    p = PyBytes_AS_STRING(out)
    memcpy(p, b"event: ", 7)
    memcpy(p + 7, PyUnicode_DATA(event_type), tl)
    memcpy(p + 7 + tl, b"\ndata: ", 7)
    memcpy(p + 14 + tl, PyBytes_AS_STRING(payload), n)
    memcpy(p + 14 + tl + n, b"\n\n", 2)
    return out


from cpython.bytearray cimport PyByteArray_FromStringAndSize


def body_buffer(Py_ssize_t size):
    """A ``bytearray`` of ``size`` bytes whose contents are not set; see ``_frames.pyi``."""
    if size < 0:
        return _twin_body_buffer(size)
    return PyByteArray_FromStringAndSize(NULL, size)


cdef object _twin_body_buffer(size):
    from hotloop._pure import body_buffer
    return body_buffer(size)
