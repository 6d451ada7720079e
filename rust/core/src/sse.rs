//! Incremental Server-Sent-Events decoder (WHATWG HTML, "event stream interpretation").
//!
//! Feed it the raw bytes of a backend HTTP stream chunk by chunk; it reports each complete event
//! as `(event_type, data)`:
//!
//! * lines end in `\r\n`, `\n` or `\r`; a `\r` ending one chunk and a `\n` starting the next are
//!   one line ending;
//! * a line starting with `:` is a comment; `field:value` drops one leading space of the value;
//!   a line without `:` is a field with an empty value;
//! * `data` values are joined with `\n`; `event` sets the type (empty or unset: `"message"`);
//!   `id`, `retry` and unknown fields are ignored;
//! * a blank line dispatches the event if its data buffer is non-empty, and always resets the
//!   data and type buffers;
//! * input is UTF-8 (invalid sequences become U+FFFD); a BOM at the very start of the stream is
//!   dropped; an incomplete trailing event is held until more input arrives.
//!
//! Bounds: a line longer than `max_buffer` bytes (terminator excluded, whether complete or still
//! pending) or an event whose data buffer (values plus one `\n` per `data` line) exceeds
//! `max_buffer` bytes fails the decoder. A failed decoder refuses all further input.

use std::borrow::Cow;
use std::fmt;

use memchr::{memchr, memchr2};

/// Default bound on one pending line or one event's data, in bytes.
pub const DEFAULT_MAX_BUFFER: usize = 8 * 1024 * 1024;

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Why the decoder failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseError {
    /// A single line exceeded `max_buffer` bytes.
    LineTooLong { max_buffer: usize },
    /// One event's data exceeded `max_buffer` bytes.
    EventTooLarge { max_buffer: usize },
    /// The decoder failed earlier and refuses further input.
    Failed,
}

impl fmt::Display for SseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SseError::LineTooLong { max_buffer } => {
                write!(f, "SSE line exceeds max_buffer ({max_buffer} bytes)")
            }
            SseError::EventTooLarge { max_buffer } => {
                write!(f, "SSE event data exceeds max_buffer ({max_buffer} bytes)")
            }
            SseError::Failed => write!(f, "SSE decoder failed earlier and accepts no more input"),
        }
    }
}

impl std::error::Error for SseError {}

/// Error from [`SseDecoder::feed_with`]: the decoder's own, or the one the callback returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedError<E> {
    Sse(SseError),
    Emit(E),
}

impl<E> From<SseError> for FeedError<E> {
    fn from(e: SseError) -> Self {
        FeedError::Sse(e)
    }
}

/// One decoded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub event_type: String,
    pub data: String,
}

/// Decode UTF-8, replacing invalid sequences with U+FFFD (maximal-subpart substitution).
pub fn decode_lossy(bytes: &[u8]) -> Cow<'_, str> {
    String::from_utf8_lossy(bytes)
}

/// The incremental decoder. See the module documentation for the exact rules.
#[derive(Debug, Clone)]
pub struct SseDecoder {
    /// Bytes of the current, not yet terminated line.
    line: Vec<u8>,
    /// The event's data buffer: each `data` value followed by `\n`.
    data: Vec<u8>,
    /// The event type buffer.
    event_type: Vec<u8>,
    /// The previous chunk ended with `\r`: drop a `\n` starting the next chunk.
    skip_lf: bool,
    /// No line has been processed yet (a leading BOM is still to be dropped).
    at_start: bool,
    failed: bool,
    max_buffer: usize,
}

impl Default for SseDecoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_BUFFER)
    }
}

enum Step {
    Continue,
    Dispatch,
}

impl SseDecoder {
    pub fn new(max_buffer: usize) -> Self {
        SseDecoder {
            line: Vec::new(),
            data: Vec::new(),
            event_type: Vec::new(),
            skip_lf: false,
            at_start: true,
            failed: false,
            max_buffer,
        }
    }

    pub fn max_buffer(&self) -> usize {
        self.max_buffer
    }

    /// Bytes held for an incomplete line.
    pub fn pending_line_len(&self) -> usize {
        self.line.len()
    }

    /// Feed a chunk, collecting the complete events as owned strings.
    pub fn feed(&mut self, chunk: &[u8]) -> Result<Vec<Event>, SseError> {
        let mut out = Vec::new();
        self.feed_with(chunk, |ty, data| {
            out.push(Event {
                event_type: decode_lossy(ty).into_owned(),
                data: decode_lossy(data).into_owned(),
            });
            Ok::<(), std::convert::Infallible>(())
        })
        .map_err(|e| match e {
            FeedError::Sse(e) => e,
            FeedError::Emit(never) => match never {},
        })?;
        Ok(out)
    }

    /// Feed a chunk, calling `emit(event_type, data)` (raw UTF-8 bytes, possibly invalid) for each
    /// complete event in order. On any error the decoder is failed.
    pub fn feed_with<E, F>(&mut self, chunk: &[u8], mut emit: F) -> Result<(), FeedError<E>>
    where
        F: FnMut(&[u8], &[u8]) -> Result<(), E>,
    {
        if self.failed {
            return Err(SseError::Failed.into());
        }
        let result = self.feed_inner(chunk, &mut emit);
        if result.is_err() {
            self.fail();
        }
        result
    }

    fn fail(&mut self) {
        self.failed = true;
        self.line = Vec::new();
        self.data = Vec::new();
        self.event_type = Vec::new();
    }

    fn feed_inner<E, F>(&mut self, chunk: &[u8], emit: &mut F) -> Result<(), FeedError<E>>
    where
        F: FnMut(&[u8], &[u8]) -> Result<(), E>,
    {
        let mut input = chunk;
        if self.skip_lf && !input.is_empty() {
            self.skip_lf = false;
            if input[0] == b'\n' {
                input = &input[1..];
            }
        }
        while let Some(i) = memchr2(b'\n', b'\r', input) {
            let mut next = i + 1;
            if input[i] == b'\r' {
                if next == input.len() {
                    self.skip_lf = true;
                } else if input[next] == b'\n' {
                    next += 1;
                }
            }
            let step = if self.line.is_empty() {
                self.process_line(&input[..i])?
            } else {
                if self.line.len() + i > self.max_buffer {
                    return Err(SseError::LineTooLong {
                        max_buffer: self.max_buffer,
                    }
                    .into());
                }
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(&input[..i]);
                let step = self.process_line(&line);
                line.clear();
                self.line = line;
                step?
            };
            if let Step::Dispatch = step {
                self.dispatch(emit)?;
            }
            input = &input[next..];
        }
        if !input.is_empty() {
            if self.line.len() + input.len() > self.max_buffer {
                return Err(SseError::LineTooLong {
                    max_buffer: self.max_buffer,
                }
                .into());
            }
            self.line.extend_from_slice(input);
        }
        Ok(())
    }

    fn process_line(&mut self, mut line: &[u8]) -> Result<Step, SseError> {
        if line.len() > self.max_buffer {
            return Err(SseError::LineTooLong {
                max_buffer: self.max_buffer,
            });
        }
        if self.at_start {
            self.at_start = false;
            if line.starts_with(BOM) {
                line = &line[BOM.len()..];
            }
        }
        if line.is_empty() {
            return Ok(Step::Dispatch);
        }
        if line[0] == b':' {
            return Ok(Step::Continue);
        }
        let (field, value) = match memchr(b':', line) {
            Some(c) => {
                let v = &line[c + 1..];
                (&line[..c], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &line[line.len()..]),
        };
        match field {
            b"data" => {
                if self.data.len() + value.len() + 1 > self.max_buffer {
                    return Err(SseError::EventTooLarge {
                        max_buffer: self.max_buffer,
                    });
                }
                self.data.extend_from_slice(value);
                self.data.push(b'\n');
            }
            b"event" => {
                self.event_type.clear();
                self.event_type.extend_from_slice(value);
            }
            _ => {}
        }
        Ok(Step::Continue)
    }

    fn dispatch<E, F>(&mut self, emit: &mut F) -> Result<(), FeedError<E>>
    where
        F: FnMut(&[u8], &[u8]) -> Result<(), E>,
    {
        if !self.data.is_empty() {
            let data = &self.data[..self.data.len() - 1];
            let ty: &[u8] = if self.event_type.is_empty() {
                b"message"
            } else {
                &self.event_type
            };
            emit(ty, data).map_err(FeedError::Emit)?;
        }
        self.data.clear();
        self.event_type.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(t: &str, d: &str) -> Event {
        Event {
            event_type: t.to_string(),
            data: d.to_string(),
        }
    }

    fn all_at_once(input: &[u8]) -> Vec<Event> {
        SseDecoder::default().feed(input).unwrap()
    }

    fn byte_by_byte(input: &[u8]) -> Vec<Event> {
        let mut d = SseDecoder::default();
        let mut out = Vec::new();
        for b in input {
            out.extend(d.feed(std::slice::from_ref(b)).unwrap());
        }
        out
    }

    fn check(input: &[u8], want: &[Event]) {
        assert_eq!(
            all_at_once(input),
            want,
            "all at once: {:?}",
            String::from_utf8_lossy(input)
        );
        assert_eq!(
            byte_by_byte(input),
            want,
            "byte by byte: {:?}",
            String::from_utf8_lossy(input)
        );
        for split in 0..=input.len() {
            let mut d = SseDecoder::default();
            let mut got = d.feed(&input[..split]).unwrap();
            got.extend(d.feed(&input[split..]).unwrap());
            assert_eq!(got, want, "split at {split}");
        }
    }

    #[test]
    fn basic_events() {
        check(b"data: hello\n\n", &[ev("message", "hello")]);
        check(
            b"event: delta\ndata: {\"a\":1}\n\n",
            &[ev("delta", "{\"a\":1}")],
        );
        check(b"data:no-space\n\n", &[ev("message", "no-space")]);
        check(b"data:  two spaces\n\n", &[ev("message", " two spaces")]);
        check(b"data: a\ndata: b\ndata\n\n", &[ev("message", "a\nb\n")]);
        check(
            b"data: x\n\ndata: y\n\n",
            &[ev("message", "x"), ev("message", "y")],
        );
    }

    #[test]
    fn line_endings() {
        let want = [ev("t", "a\nb")];
        check(b"event: t\r\ndata: a\r\ndata: b\r\n\r\n", &want);
        check(b"event: t\rdata: a\rdata: b\r\r", &want);
        check(b"event: t\ndata: a\rdata: b\r\n\n", &want);
        // "\r\r\n" is a \r line ending followed by an empty line ending in \r\n.
        check(b"data: a\r\r\n", &[ev("message", "a")]);
        // "\n\r" is two line endings.
        check(b"data: a\n\r", &[ev("message", "a")]);
    }

    #[test]
    fn cr_at_chunk_end_then_lf() {
        let mut d = SseDecoder::default();
        assert_eq!(d.feed(b"data: a\r").unwrap(), vec![]);
        assert_eq!(d.feed(b"").unwrap(), vec![]);
        // This \n completes the \r\n of the previous line, it is not a blank line.
        assert_eq!(d.feed(b"\n").unwrap(), vec![]);
        assert_eq!(d.feed(b"\r").unwrap(), vec![ev("message", "a")]);
    }

    #[test]
    fn comments_and_ignored_fields() {
        check(
            b": keep-alive\nid: 7\nretry: 100\nfoo: bar\ndata: x\n:c\n\n",
            &[ev("message", "x")],
        );
        check(b": only a comment\n\n", &[]);
    }

    #[test]
    fn empty_data_buffer_dispatches_nothing_and_resets_type() {
        check(b"event: a\n\ndata: x\n\n", &[ev("message", "x")]);
        check(b"event: a\nid: 1\n\n\n\ndata: x\n\n", &[ev("message", "x")]);
        // An empty data value still makes the buffer non-empty.
        check(b"data:\n\n", &[ev("message", "")]);
        check(b"data\n\n", &[ev("message", "")]);
    }

    #[test]
    fn event_type_rules() {
        check(b"event\ndata: x\n\n", &[ev("message", "x")]);
        check(b"event:\ndata: x\n\n", &[ev("message", "x")]);
        check(b"event: a\nevent: b\ndata: x\n\n", &[ev("b", "x")]);
        check(b"event: a:b\ndata: c:d\n\n", &[ev("a:b", "c:d")]);
        check(b"Data: x\n\n", &[]);
    }

    #[test]
    fn incomplete_trailing_event_is_held() {
        let mut d = SseDecoder::default();
        assert_eq!(d.feed(b"data: a\n").unwrap(), vec![]);
        assert_eq!(d.feed(b"data: b").unwrap(), vec![]);
        assert_eq!(d.pending_line_len(), 7);
        assert_eq!(d.feed(b"\n\n").unwrap(), vec![ev("message", "a\nb")]);
        assert_eq!(d.pending_line_len(), 0);
    }

    #[test]
    fn utf8_and_bom() {
        check(
            "\u{feff}data: h\u{e9}llo \u{1F600}\n\n".as_bytes(),
            &[ev("message", "h\u{e9}llo \u{1F600}")],
        );
        check(b"\xEF\xBB\xBF\n", &[]);
        check(b"\xEF\xBB\xBFdata: x\n\n", &[ev("message", "x")]);
        // Only the first BOM of the stream is dropped.
        check(b"\xEF\xBB\xBF\xEF\xBB\xBFdata: x\n\n", &[]);
        check(b"data: x\n\n\xEF\xBB\xBFdata: y\n\n", &[ev("message", "x")]);
        check(
            b"data: a\xFFb\xF0\x9F\x98\n\n",
            &[ev("message", "a\u{FFFD}b\u{FFFD}")],
        );
        check(b"event: \xC3\n data: x\n\n", &[]);
        check(b"event: \xC3\ndata: x\n\n", &[ev("\u{FFFD}", "x")]);
    }

    #[test]
    fn bounds() {
        let mut d = SseDecoder::new(8);
        assert_eq!(d.feed(b"data: 12").unwrap(), vec![]);
        assert_eq!(d.feed(b"3"), Err(SseError::LineTooLong { max_buffer: 8 }));
        assert_eq!(d.feed(b"\n\n"), Err(SseError::Failed));

        let mut d = SseDecoder::new(8);
        assert_eq!(d.feed(b"data: 12\n\n").unwrap(), vec![ev("message", "12")]);
        assert_eq!(
            d.feed(b"data: 123\n"),
            Err(SseError::LineTooLong { max_buffer: 8 })
        );

        let mut d = SseDecoder::new(8);
        assert_eq!(
            d.feed(b"data: 1234\n").unwrap_err(),
            SseError::LineTooLong { max_buffer: 8 }
        );

        // Each line fits, the joined data does not: 4 values of 1 byte + 4 newlines = 8 is fine.
        let mut d = SseDecoder::new(8);
        assert_eq!(
            d.feed(b"data:1\ndata:2\ndata:3\ndata:4\n\n").unwrap(),
            vec![ev("message", "1\n2\n3\n4")]
        );
        assert_eq!(
            d.feed(b"data:1\ndata:2\ndata:3\ndata:4\ndata:5\n"),
            Err(SseError::EventTooLarge { max_buffer: 8 })
        );
    }

    #[test]
    fn emit_error_fails_the_decoder() {
        let mut d = SseDecoder::default();
        let r = d.feed_with(b"data: a\n\n", |_, _| Err("nope"));
        assert_eq!(r, Err(FeedError::Emit("nope")));
        assert_eq!(d.feed(b"data: b\n\n"), Err(SseError::Failed));
    }

    #[test]
    fn pseudo_random_chunkings_agree() {
        let stream: &[u8] = b"\xEF\xBB\xBFevent: a\r\ndata: 1\r\n\r\n: c\rdata: 2\rdata:3\r\rid: 9\n\nevent: z\ndata: \xE2\x82\xAC\xE2\n\n\r\n";
        let want = all_at_once(stream);
        assert_eq!(
            want,
            vec![
                ev("a", "1"),
                ev("message", "2\n3"),
                ev("z", "\u{20AC}\u{FFFD}")
            ]
        );
        let mut seed: u64 = 0x9E3779B97F4A7C15;
        for _ in 0..500 {
            let mut d = SseDecoder::default();
            let mut got = Vec::new();
            let mut rest = stream;
            while !rest.is_empty() {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let n = (seed % 6) as usize;
                let n = n.min(rest.len());
                got.extend(d.feed(&rest[..n]).unwrap());
                rest = &rest[n..];
            }
            assert_eq!(got, want);
        }
    }
}
