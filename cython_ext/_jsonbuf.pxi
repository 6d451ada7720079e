# Included by frames.pyx (textually, not a module): a growable byte buffer that starts on the
# stack, and JSON writers for str and int with exactly the escaping that both
# json.dumps(ensure_ascii=False) and msgspec.json use: \" \\ \b \f \n \r \t, other
# characters below U+0020 as \u00XX (lowercase hex), everything else (DEL, U+2028, astral) as
# UTF-8. Lone surrogates are reported to the caller (return 1), which raises or falls back.
# Non-ASCII str is UTF-8 encoded by CPython's codec first, then scanned 8 bytes at a time.

from cpython.mem cimport PyMem_Malloc, PyMem_Realloc, PyMem_Free
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DATA, PyUnicode_GET_LENGTH, PyUnicode_AsUTF8String
from libc.string cimport memcpy

cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object o)

cdef struct JBuf:
    char* data
    Py_ssize_t len
    Py_ssize_t cap
    char* stack


cdef inline void jb_init(JBuf* b, char* stack, Py_ssize_t size) noexcept:
    b.data = stack
    b.stack = stack
    b.len = 0
    b.cap = size


cdef inline void jb_free(JBuf* b) noexcept:
    if b.data != b.stack:
        PyMem_Free(b.data)
    b.data = b.stack
    b.len = 0


cdef int jb_grow(JBuf* b, Py_ssize_t extra) except -1:
    cdef Py_ssize_t need = b.len + extra
    cdef Py_ssize_t cap = b.cap * 2
    cdef char* p
    if cap < need:
        cap = need
    if b.data == b.stack:
        p = <char*>PyMem_Malloc(cap)
        if p == NULL:
            raise MemoryError()
        memcpy(p, b.data, b.len)
    else:
        p = <char*>PyMem_Realloc(b.data, cap)
        if p == NULL:
            raise MemoryError()
    b.data = p
    b.cap = cap
    return 0


cdef inline int jb_reserve(JBuf* b, Py_ssize_t extra) except -1:
    if b.len + extra > b.cap:
        return jb_grow(b, extra)
    return 0


cdef inline int jb_write(JBuf* b, const char* s, Py_ssize_t n) except -1:
    if b.len + n > b.cap:
        jb_grow(b, n)
    memcpy(b.data + b.len, s, n)
    b.len += n
    return 0


cdef inline int jb_byte(JBuf* b, char c) except -1:
    if b.len + 1 > b.cap:
        jb_grow(b, 1)
    b.data[b.len] = c
    b.len += 1
    return 0


cdef inline bytes jb_bytes(JBuf* b):
    return PyBytes_FromStringAndSize(b.data, b.len)


cdef const char* _JB_HEX = b"0123456789abcdef"


cdef inline Py_ssize_t _jb_escape(char* out, unsigned int c) noexcept:
    """Write the escape of an ASCII char that needs one; return its length (room for 6 needed)."""
    out[0] = b'\\'
    if c == 34:
        out[1] = b'"'
    elif c == 92:
        out[1] = b'\\'
    elif c == 10:
        out[1] = b'n'
    elif c == 13:
        out[1] = b'r'
    elif c == 9:
        out[1] = b't'
    elif c == 8:
        out[1] = b'b'
    elif c == 12:
        out[1] = b'f'
    else:
        out[1] = b'u'
        out[2] = b'0'
        out[3] = b'0'
        out[4] = _JB_HEX[(c >> 4) & 15]
        out[5] = _JB_HEX[c & 15]
        return 6
    return 2


cdef inline bint _jb_needs_escape(unsigned int c) noexcept:
    return c < 0x20 or c == 34 or c == 92


cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* Nonzero when some byte of w is < 0x20, '"' or '\\' (may flag extra bytes only in a word
       that has a real match, which the caller then scans byte by byte). */
    static inline uint64_t hl_json_special8(const unsigned char *p) {
        uint64_t w, q, s;
        memcpy(&w, p, 8);
        q = w ^ 0x2222222222222222ULL;
        s = w ^ 0x5C5C5C5C5C5C5C5CULL;
        return (((w - 0x2020202020202020ULL) & ~w)
                | ((q - 0x0101010101010101ULL) & ~q)
                | ((s - 0x0101010101010101ULL) & ~s)) & 0x8080808080808080ULL;
    }
    """
    unsigned long long hl_json_special8(const unsigned char* p) noexcept nogil


cdef int jb_escaped_utf8(JBuf* b, const unsigned char* p, Py_ssize_t n) except -1:
    """Write UTF-8 bytes ``p[:n]`` as a quoted JSON string, escaping only ASCII specials."""
    cdef Py_ssize_t i = 0, j, start = 0
    jb_reserve(b, n + 2)
    b.data[b.len] = b'"'
    b.len += 1
    while i < n:
        if i + 8 <= n and hl_json_special8(p + i) == 0:
            i += 8
            continue
        j = i + 8 if i + 8 <= n else n
        while i < j:
            if _jb_needs_escape(p[i]):
                if i > start:
                    jb_write(b, <const char*>p + start, i - start)
                jb_reserve(b, 6)
                b.len += _jb_escape(b.data + b.len, p[i])
                start = i + 1
            i += 1
    jb_reserve(b, n - start + 1)
    memcpy(b.data + b.len, p + start, n - start)
    b.len += n - start
    b.data[b.len] = b'"'
    b.len += 1
    return 0


cdef int jb_str(JBuf* b, object s) except -1:
    """Write the str ``s`` as a quoted JSON string. Return 1 (nothing written) if ``s`` holds a
    lone surrogate, which UTF-8 cannot encode; 0 otherwise."""
    cdef bytes u
    if PyUnicode_IS_ASCII(s):
        return jb_escaped_utf8(b, <const unsigned char*>PyUnicode_DATA(s), PyUnicode_GET_LENGTH(s))
    try:
        u = PyUnicode_AsUTF8String(s)
    except UnicodeEncodeError:
        return 1
    return jb_escaped_utf8(b, <const unsigned char*>PyBytes_AS_STRING(u), PyBytes_GET_SIZE(u))


cdef int jb_longlong(JBuf* b, long long v) except -1:
    cdef char tmp[24]
    cdef int i = 24
    cdef unsigned long long u
    cdef bint neg = v < 0
    if neg:
        u = (<unsigned long long>0) - <unsigned long long>v
    else:
        u = <unsigned long long>v
    while True:
        i -= 1
        tmp[i] = <char>(48 + <int>(u % 10))
        u //= 10
        if u == 0:
            break
    if neg:
        i -= 1
        tmp[i] = b'-'
    return jb_write(b, tmp + i, 24 - i)
