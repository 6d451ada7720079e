//! `hotloop._native`: pyo3 glue over `hotloop-core`. Glue only: argument conversion, error
//! mapping and object construction. Every call is coarse (one per item, turn or network chunk).
//! The stub `python/hotloop/_native.pyi` is the documented API; pure twins live in
//! `hotloop._pure`.

use hotloop_core::plain::{part_delta_event, PartIndex};
use hotloop_core::secrets::{char_offsets, redact, Finding};
use hotloop_core::{self as core, ChainError, FeedError, PatternSpec, Plain, SseError};
use pyo3::exceptions::{PyIndexError, PyOverflowError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySequence, PyString, PyTuple};

/// Inputs at least this long are hashed with the GIL released.
const DETACH_THRESHOLD: usize = 16 * 1024;

/// Keyed BLAKE2b item fingerprints (16-byte digests) under one secret key.
#[pyclass(module = "hotloop._native", name = "Fingerprinter", frozen)]
struct Fingerprinter {
    inner: core::Fingerprinter,
}

#[pymethods]
impl Fingerprinter {
    #[new]
    fn new(key: &[u8]) -> PyResult<Self> {
        let inner =
            core::Fingerprinter::new(key).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Fingerprinter { inner })
    }

    fn __call__<'py>(&self, py: Python<'py>, data: &[u8]) -> Bound<'py, PyBytes> {
        let fp = if data.len() >= DETACH_THRESHOLD {
            py.detach(|| self.inner.fingerprint(data))
        } else {
            self.inner.fingerprint(data)
        };
        PyBytes::new(py, &fp.to_le_bytes())
    }

    fn __repr__(&self) -> &'static str {
        "Fingerprinter(<key hidden>)"
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// A fingerprint from Python: exactly 16 bytes, read little-endian.
fn fp_of(obj: &Bound<'_, PyAny>) -> PyResult<u128> {
    let bytes = obj.cast::<PyBytes>().map_err(|_| {
        PyTypeError::new_err(format!(
            "a fingerprint must be bytes, not {}",
            type_name(obj)
        ))
    })?;
    let raw: [u8; core::FINGERPRINT_LEN] = bytes.as_bytes().try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "a fingerprint must be {} bytes, got {}",
            core::FINGERPRINT_LEN,
            bytes.as_bytes().len()
        ))
    })?;
    Ok(u128::from_le_bytes(raw))
}

/// A sequence of fingerprints (a str is refused, as by pyo3's `Vec` extraction).
fn fps_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u128>> {
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "expected a sequence of fingerprints, got str",
        ));
    }
    let seq = obj.cast::<PySequence>().map_err(|_| {
        PyTypeError::new_err(format!(
            "expected a sequence of fingerprints, got {}",
            type_name(obj)
        ))
    })?;
    let mut out = Vec::with_capacity(seq.len().unwrap_or(0));
    for item in seq.try_iter()? {
        out.push(fp_of(&item?)?);
    }
    Ok(out)
}

fn chain_err(e: ChainError) -> PyErr {
    let msg = e.to_string();
    match e {
        ChainError::CapacityExceeded { .. } => PyOverflowError::new_err(msg),
        ChainError::LengthMismatch { .. } => PyValueError::new_err(msg),
        ChainError::OutOfRange { .. } => PyIndexError::new_err(msg),
    }
}

fn non_negative(name: &str, n: i64) -> PyResult<usize> {
    usize::try_from(n).map_err(|_| PyValueError::new_err(format!("{name} must be >= 0, got {n}")))
}

/// An ordered chain of conversation items, each a (fingerprint, tokens) pair, with running
/// token sums and a capacity bound. Fingerprints are 16-byte `bytes` in Python, `u128` here.
#[pyclass(module = "hotloop._native", name = "ItemChain")]
struct ItemChain {
    inner: core::ItemChain,
}

#[pymethods]
impl ItemChain {
    #[new]
    #[pyo3(signature = (max_items = 100_000))]
    fn new(max_items: i64) -> PyResult<Self> {
        Ok(ItemChain {
            inner: core::ItemChain::new(non_negative("max_items", max_items)?),
        })
    }

    fn push(&mut self, fp: &Bound<'_, PyAny>, tokens: u32) -> PyResult<()> {
        self.inner.push(fp_of(fp)?, tokens).map_err(chain_err)
    }

    fn extend(&mut self, fps: &Bound<'_, PyAny>, tokens: Vec<u32>) -> PyResult<()> {
        self.inner.extend(&fps_of(fps)?, &tokens).map_err(chain_err)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "ItemChain(len={}, total_tokens={}, max_items={})",
            self.inner.len(),
            self.inner.total_tokens(),
            self.inner.max_items()
        )
    }

    #[getter]
    fn total_tokens(&self) -> u64 {
        self.inner.total_tokens()
    }

    #[getter]
    fn max_items(&self) -> usize {
        self.inner.max_items()
    }

    #[pyo3(signature = (fps, start = 0))]
    fn common_prefix(&self, fps: &Bound<'_, PyAny>, start: i64) -> PyResult<usize> {
        let fps = fps_of(fps)?;
        Ok(self
            .inner
            .common_prefix_from(non_negative("start", start)?, &fps))
    }

    fn tokens_upto(&self, n: i64) -> PyResult<u64> {
        self.inner
            .tokens_upto(non_negative("n", n)?)
            .map_err(chain_err)
    }

    fn truncate(&mut self, n: i64) -> PyResult<()> {
        self.inner.truncate(non_negative("n", n)?);
        Ok(())
    }

    fn copy(&self) -> Self {
        ItemChain {
            inner: self.inner.clone(),
        }
    }

    fn fingerprint_at<'py>(&self, py: Python<'py>, i: i64) -> PyResult<Bound<'py, PyBytes>> {
        let i = non_negative("i", i)?;
        match self.inner.fingerprints().get(i) {
            Some(fp) => Ok(PyBytes::new(py, &fp.to_le_bytes())),
            None => Err(PyIndexError::new_err(format!(
                "i={i} is out of range for a chain of {} items",
                self.inner.len()
            ))),
        }
    }

    fn fingerprints<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.inner
                .fingerprints()
                .iter()
                .map(|fp| PyBytes::new(py, &fp.to_le_bytes())),
        )
    }
}

/// Decode UTF-8 with CPython's own "replace" handler, so results equal the pure twin's
/// `bytes.decode("utf-8", "replace")` exactly.
fn decode_replace<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: the pointer and length describe a live slice; the C call returns a new reference
    // or NULL with an exception set, which from_owned_ptr_or_err turns into a PyErr.
    unsafe {
        let ptr = pyo3::ffi::PyUnicode_DecodeUTF8(
            bytes.as_ptr().cast(),
            bytes.len() as pyo3::ffi::Py_ssize_t,
            c"replace".as_ptr(),
        );
        Bound::from_owned_ptr_or_err(py, ptr)
    }
}

/// Incremental Server-Sent-Events decoder (WHATWG rules) for backend HTTP streams.
#[pyclass(module = "hotloop._native", name = "SseDecoder")]
struct SseDecoder {
    inner: core::SseDecoder,
}

#[pymethods]
impl SseDecoder {
    #[new]
    #[pyo3(signature = (max_buffer = 8_388_608))] // 8 MiB, core::DEFAULT_MAX_BUFFER
    fn new(max_buffer: i64) -> PyResult<Self> {
        Ok(SseDecoder {
            inner: core::SseDecoder::new(non_negative("max_buffer", max_buffer)?),
        })
    }

    #[getter]
    fn max_buffer(&self) -> usize {
        self.inner.max_buffer()
    }

    fn feed<'py>(&mut self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        let message = intern!(py, "message");
        let result = self.inner.feed_with(data, |ty, payload| -> PyResult<()> {
            out.append(event_tuple(py, message, ty, payload)?)
        });
        match result {
            Ok(()) => Ok(out),
            Err(e) => Err(feed_error(e)),
        }
    }

    /// ``feed`` that takes the leading plain deltas of ``lane``'s item (see the stub).
    fn feed_lane<'py>(
        &mut self,
        py: Python<'py>,
        data: &[u8],
        mut lane: PyRefMut<'py, DeltaLane>,
        index: i64,
        args: Option<Bound<'py, PyList>>,
    ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
        let frames = PyList::empty(py);
        let rest = PyList::empty(py);
        let message = intern!(py, "message");
        let lane = &mut *lane;
        let event_type = lane.event_type.bind(py);
        let mut taking = matches!(lane.kind, PLAIN_TEXT | PLAIN_REASONING | PLAIN_ARGUMENTS);
        let mut pieces: Vec<Bound<'py, PyString>> = Vec::new();
        let mut buf: Vec<u8> = Vec::with_capacity(256);
        let result = self.inner.feed_with(data, |ty, payload| -> PyResult<()> {
            if taking && ty != b"message" {
                taking = false; // the events after it keep their order behind it
            }
            if taking {
                let piece = std::str::from_utf8(payload)
                    .ok()
                    .and_then(core::plain_delta);
                let text = match piece {
                    Some(Plain::Nothing) => return Ok(()),
                    Some(Plain::Text(t)) if lane.kind == PLAIN_TEXT => Some(t),
                    Some(Plain::Reasoning(t)) if lane.kind == PLAIN_REASONING => Some(t),
                    Some(Plain::Arguments {
                        index: i,
                        arguments,
                    }) if lane.kind == PLAIN_ARGUMENTS && i == index => Some(arguments),
                    _ => None,
                };
                match text {
                    Some(t) if t.is_empty() => return Ok(()),
                    Some(t) => {
                        buf.clear();
                        part_delta_event(
                            &mut buf,
                            &lane.event_type_str,
                            lane.seq.wrapping_add(pieces.len() as i64), // (refused below if it wrapped)
                            &lane.item_id,
                            lane.output_index,
                            lane.part,
                            lane.content_index,
                            &t,
                            lane.logprobs,
                        );
                        pieces.push(PyString::new(py, &t));
                        return frames.append((event_type, PyBytes::new(py, &buf)));
                    }
                    None => taking = false,
                }
            }
            rest.append(event_tuple(py, message, ty, payload)?)
        });
        if let Err(e) = result {
            return Err(feed_error(e));
        }
        // the next sequence number must fit, as the pure twin requires: refused before the
        // lane changes (a wrapped number in a frame is never returned)
        let n = pieces.len() as i64;
        let (Some(next_seq), Some(next_taken)) = (lane.seq.checked_add(n), lane.taken.checked_add(n)) else {
            return Err(PyOverflowError::new_err(
                "the lane's sequence number overflows a signed 64-bit integer",
            ));
        };
        let parts = lane.parts.bind(py);
        for piece in &pieces {
            parts.append(piece)?;
            if let Some(args) = &args {
                args.append(piece)?;
            }
        }
        lane.seq = next_seq;
        lane.taken = next_taken;
        Ok((frames, rest))
    }
}

/// ``(type, data)`` of one event, both decoded as UTF-8 with replacement.
fn event_tuple<'py>(
    py: Python<'py>,
    message: &Bound<'py, PyString>,
    ty: &[u8],
    payload: &[u8],
) -> PyResult<Bound<'py, PyTuple>> {
    let ty_obj: Bound<'py, PyAny> = if ty == b"message" {
        message.clone().into_any()
    } else {
        decode_replace(py, ty)?
    };
    PyTuple::new(py, [ty_obj, decode_replace(py, payload)?])
}

fn feed_error(e: FeedError<PyErr>) -> PyErr {
    match e {
        FeedError::Emit(e) => e,
        FeedError::Sse(
            e @ (SseError::LineTooLong { .. } | SseError::EventTooLarge { .. } | SseError::Failed),
        ) => PyValueError::new_err(e.to_string()),
    }
}

// The kinds of plain delta (hotloop._native.pyi: PLAIN_*).
const PLAIN_NOTHING: i64 = 0;
const PLAIN_TEXT: i64 = 1;
const PLAIN_REASONING: i64 = 2;
const PLAIN_ARGUMENTS: i64 = 3;

/// One event's plain delta as ``(kind, index, text)``, or None (see the stub).
#[pyfunction]
fn plain_delta(data: &str) -> Option<(i64, i64, String)> {
    Some(match core::plain_delta(data)? {
        Plain::Nothing => (PLAIN_NOTHING, 0, String::new()),
        Plain::Text(t) => (PLAIN_TEXT, 0, t),
        Plain::Reasoning(t) => (PLAIN_REASONING, 0, t),
        Plain::Arguments { index, arguments } => (PLAIN_ARGUMENTS, index, arguments),
    })
}

/// The output item whose plain deltas ``SseDecoder.feed_lane`` turns into events (see the stub).
#[pyclass(module = "hotloop._native", name = "DeltaLane")]
struct DeltaLane {
    #[pyo3(get)]
    kind: i64,
    #[pyo3(get)]
    call: i64,
    #[pyo3(get)]
    event_type: Py<PyString>,
    event_type_str: String,
    #[pyo3(get)]
    item_id: String,
    #[pyo3(get)]
    output_index: i64,
    #[pyo3(get)]
    content_index: i64,
    #[pyo3(get)]
    logprobs: bool,
    /// Whether the events write ``content_index`` as ``summary_index`` (see the stub).
    #[pyo3(get)]
    summary: bool,
    part: PartIndex,
    #[pyo3(get)]
    parts: Py<PyList>,
    #[pyo3(get, set)]
    seq: i64,
    #[pyo3(get, set)]
    taken: i64,
    #[pyo3(get, set)]
    emit: Option<Py<PyAny>>,
}

#[pymethods]
impl DeltaLane {
    #[new]
    #[pyo3(signature = (
        kind, call, event_type, item_id, output_index, content_index, logprobs, parts, *, summary = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        kind: i64,
        call: i64,
        event_type: Bound<'_, PyString>,
        item_id: String,
        output_index: i64,
        content_index: i64,
        logprobs: bool,
        parts: Bound<'_, PyList>,
        summary: bool,
    ) -> PyResult<Self> {
        let event_type_str = event_type.to_str()?.to_owned();
        Ok(DeltaLane {
            kind,
            call,
            event_type: event_type.unbind(),
            event_type_str,
            item_id,
            output_index,
            content_index,
            logprobs,
            summary,
            part: if summary {
                PartIndex::Summary
            } else {
                PartIndex::Content
            },
            parts: parts.unbind(),
            seq: 0,
            taken: 0,
            emit: None,
        })
    }

    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.parts)?;
        if let Some(emit) = &self.emit {
            visit.call(emit)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.emit = None;
    }
}

/// Texts at least this long (UTF-8 bytes) are scanned with the GIL released.
const SCAN_DETACH_THRESHOLD: usize = 4 * 1024;

/// Finds well-known credential formats in text, from a pattern table compiled once.
#[pyclass(module = "hotloop._native", name = "SecretScanner", frozen)]
struct SecretScanner {
    inner: core::SecretScanner,
    kinds: Vec<Py<PyString>>,
}

/// What one scan found, with the text it was found in when that is not the caller's `&str`.
struct Scanned {
    findings: Vec<Finding>,
    offsets: Vec<(usize, usize)>,
    /// UTF-8 with surrogates (Python's "surrogatepass" encoding), for texts holding lone
    /// surrogates; None when the text is plain UTF-8.
    wtf8: Option<Vec<u8>>,
}

impl SecretScanner {
    fn run(&self, py: Python<'_>, text: &Bound<'_, PyString>) -> PyResult<Scanned> {
        let inner = &self.inner;
        if let Ok(s) = text.to_str() {
            let work = || {
                let findings = inner.scan(s);
                let offsets = char_offsets(s, &findings);
                Scanned {
                    findings,
                    offsets,
                    wtf8: None,
                }
            };
            let scanned = if s.len() >= SCAN_DETACH_THRESHOLD {
                py.detach(work)
            } else {
                work()
            };
            return Ok(scanned);
        }
        // Lone surrogates: scan the "surrogatepass" bytes (each surrogate counts as one
        // non-ASCII character, as in the pure twin).
        let encoded = text.call_method1(intern!(py, "encode"), ("utf-8", "surrogatepass"))?;
        let bytes = encoded.cast::<PyBytes>()?.as_bytes().to_vec();
        let work = move || -> Result<Scanned, core::secrets::InvalidText> {
            let (findings, clean) = inner.scan_wtf8(&bytes)?;
            let offsets = char_offsets(&clean, &findings);
            Ok(Scanned {
                findings,
                offsets,
                wtf8: Some(bytes),
            })
        };
        let result = if text.len()? >= SCAN_DETACH_THRESHOLD {
            py.detach(work)
        } else {
            work()
        };
        result.map_err(|e| PyValueError::new_err(e.to_string()))
    }

    fn spans<'py>(&self, py: Python<'py>, scanned: &Scanned) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            scanned
                .findings
                .iter()
                .zip(&scanned.offsets)
                .map(|(f, &(start, end))| (self.kinds[f.kind].clone_ref(py), start, end)),
        )
    }
}

#[pymethods]
impl SecretScanner {
    #[new]
    #[pyo3(signature = (patterns, max_matches = 10_000))] // core::DEFAULT_MAX_MATCHES
    fn new(
        py: Python<'_>,
        patterns: Vec<(String, String, String, f64)>,
        max_matches: i64,
    ) -> PyResult<Self> {
        let max_matches = non_negative("max_matches", max_matches)?;
        let specs: Vec<PatternSpec> = patterns
            .into_iter()
            .map(|(kind, pattern, edge, min_entropy)| PatternSpec {
                kind,
                pattern,
                edge,
                min_entropy,
            })
            .collect();
        let inner = core::SecretScanner::new(&specs, max_matches)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let kinds = inner
            .kinds()
            .map(|k| PyString::intern(py, k).unbind())
            .collect();
        Ok(SecretScanner { inner, kinds })
    }

    #[getter]
    fn kinds<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.kinds.iter().map(|k| k.clone_ref(py)))
    }

    #[getter]
    fn max_matches(&self) -> usize {
        self.inner.max_matches()
    }

    fn scan<'py>(
        &self,
        py: Python<'py>,
        text: &Bound<'py, PyString>,
    ) -> PyResult<Bound<'py, PyList>> {
        let scanned = self.run(py, text)?;
        self.spans(py, &scanned)
    }

    fn redact<'py>(
        &self,
        py: Python<'py>,
        text: &Bound<'py, PyString>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyList>)> {
        let scanned = self.run(py, text)?;
        let spans = self.spans(py, &scanned)?;
        if scanned.findings.is_empty() {
            return Ok((text.clone().into_any(), spans));
        }
        let out = match &scanned.wtf8 {
            None => {
                let s = text.to_str()?;
                let bytes = redact(&self.inner, s.as_bytes(), &scanned.findings);
                let s =
                    String::from_utf8(bytes).map_err(|e| PyValueError::new_err(e.to_string()))?;
                PyString::new(py, &s).into_any()
            }
            Some(wtf8) => {
                let bytes = redact(&self.inner, wtf8, &scanned.findings);
                PyBytes::new(py, &bytes)
                    .call_method1(intern!(py, "decode"), ("utf-8", "surrogatepass"))?
            }
        };
        Ok((out, spans))
    }
}

/// Texts at least this long (UTF-8 bytes) are counted with the GIL released, so the tokenizer
/// thread counts a large input on another core while the event loop streams (tiktoken released
/// it for every text). A shorter text takes 1-50 us to count: not worth handing the GIL over.
const COUNT_DETACH_THRESHOLD: usize = 4 * 1024;

/// Exact o200k_base token counts (``len(encode_ordinary(text))``), held in Rust.
#[pyclass(module = "hotloop._native", name = "TokenCounter", frozen)]
struct TokenCounter {
    inner: core::TokenCounter,
}

#[pymethods]
impl TokenCounter {
    #[new]
    fn new(py: Python<'_>, ranks: &Bound<'_, PyDict>) -> PyResult<Self> {
        let mut entries: Vec<(Vec<u8>, core::Rank)> = Vec::with_capacity(ranks.len());
        for (key, rank) in ranks.iter() {
            let bytes = key.cast::<PyBytes>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "a vocabulary key must be bytes, not {}",
                    type_name(&key)
                ))
            })?;
            entries.push((bytes.as_bytes().to_vec(), rank.extract()?));
        }
        let inner = py
            .detach(|| core::TokenCounter::new(entries))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(TokenCounter { inner })
    }

    fn count(&self, py: Python<'_>, text: &Bound<'_, PyString>) -> PyResult<usize> {
        let inner = &self.inner;
        let count_str = |s: &str| {
            if s.len() >= COUNT_DETACH_THRESHOLD {
                py.detach(|| inner.count(s))
            } else {
                inner.count(s)
            }
        };
        if let Ok(s) = text.to_str() {
            return Ok(count_str(s));
        }
        // Lone surrogates: tiktoken's encode_ordinary fails to convert the text and retries with
        // it round-tripped through UTF-16 ("surrogatepass" in, "replace" out), which joins a
        // high and a low surrogate into one character and makes each lone one U+FFFD. The same.
        let fixed = text
            .call_method1(intern!(py, "encode"), ("utf-16", "surrogatepass"))?
            .call_method1(intern!(py, "decode"), ("utf-16", "replace"))?;
        Ok(count_str(fixed.cast::<PyString>()?.to_str()?))
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Fingerprinter>()?;
    m.add_class::<ItemChain>()?;
    m.add_class::<SseDecoder>()?;
    m.add_class::<SecretScanner>()?;
    m.add_class::<DeltaLane>()?;
    m.add_class::<TokenCounter>()?;
    m.add_function(wrap_pyfunction!(plain_delta, m)?)?;
    m.add("PLAIN_NOTHING", PLAIN_NOTHING)?;
    m.add("PLAIN_TEXT", PLAIN_TEXT)?;
    m.add("PLAIN_REASONING", PLAIN_REASONING)?;
    m.add("PLAIN_ARGUMENTS", PLAIN_ARGUMENTS)?;
    Ok(())
}
