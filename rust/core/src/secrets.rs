//! Multi-pattern secret scanner: which well-known credential formats occur in a text, and where.
//!
//! The pattern table is data, not code: the scanner is built from a list of [`PatternSpec`]s
//! (hotloop keeps its one table in `python/hotloop/_pure.py` and hands it to both this scanner
//! and the pure-Python twin). A spec is
//!
//! * `kind`: the id reported for a match (`[a-z][a-z0-9_]*`, unique in the table);
//! * `pattern`: a regular expression in the subset shared by the `regex` crate and Python's
//!   `re` (no look-around, no back-references, no anchors or word boundaries, ASCII classes
//!   only); a named group `secret`, when present, is the reported span, otherwise the whole match;
//! * `edge`: ASCII characters that must not touch the span on either side (a key glued to more
//!   key-like characters is part of a longer token, not a key); empty for no check;
//! * `min_entropy`: the minimum Shannon entropy of the span, in bits per character (0: no check).
//!
//! Matching rules (the pure twin follows them exactly):
//!
//! 1. each kind's regex finds its matches left to right, non-overlapping, leftmost-first (the
//!    next search starts where the previous match ended, whether that match was kept or not);
//!    a match is kept only if its span is non-empty, passes the edge check and the entropy check;
//! 2. the kept matches of all kinds are merged by span start; at the same start the longer span
//!    wins, then the kind earlier in the table;
//! 3. a span is reported when it starts at or after the end of the last reported span, so the
//!    result is sorted and non-overlapping;
//! 4. at most `max_matches` spans are reported per text (the first ones).
//!
//! Which kinds run: below [`SET_BELOW`] bytes, a [`RegexSet`] over all patterns first says which
//! kinds can match at all, so a short text without secrets costs one pass. From there on, every
//! kind's regex searches on its own, with the literal prefilter the `regex` crate derives from
//! its pattern (most kinds start with a fixed prefix such as `ghp_` or `AKIA`), and a kind without
//! a match drops out after that one search. The set's pass is one lazy DFA over every pattern at
//! once, about 2.6 ns a byte, and a kind it reports is then searched again; the prefiltered
//! searches cost about 16 ns each to start, which only short texts notice. Both ways give the
//! same findings: the set only skips kinds that cannot match.
//! Offsets here are byte offsets; [`char_offsets`] converts them to code point offsets.

use std::fmt;

use regex::{CaptureLocations, Regex, RegexSet};

/// Default bound on the spans reported for one text.
pub const DEFAULT_MAX_MATCHES: usize = 10_000;

/// Texts shorter than this (in bytes) run only the kinds a [`RegexSet`] pass reports; texts
/// this long or longer run every kind's own search (see the module's documentation). Measured
/// on tool output (code, logs, JSON) with the project's table: at 2 KB the set is ahead on text without
/// secret-like matches (4.4 against 5.8 us) and behind when the keyword kinds match (12.3
/// against 9.1 us); at 200 KB the per-kind searches take 414 against 628 us on the same mixed
/// text, 277 against 367 us on JSON lines, and 310 against 323 us on prose.
pub const SET_BELOW: usize = 4096;

/// One row of the pattern table.
#[derive(Debug, Clone, PartialEq)]
pub struct PatternSpec {
    pub kind: String,
    pub pattern: String,
    pub edge: String,
    pub min_entropy: f64,
}

/// A rejected pattern table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatternError {
    /// Index of the offending row.
    pub index: usize,
    pub message: String,
}

impl fmt::Display for PatternError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "secret pattern {}: {}", self.index, self.message)
    }
}

impl std::error::Error for PatternError {}

/// The text given to [`SecretScanner::scan_wtf8`] was neither UTF-8 nor UTF-8 with surrogates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidText;

impl fmt::Display for InvalidText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("text is not UTF-8 (surrogates allowed)")
    }
}

impl std::error::Error for InvalidText {}

/// One reported span: the kind's index in the table and byte offsets into the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finding {
    pub kind: usize,
    pub start: usize,
    pub end: usize,
}

struct Kind {
    name: String,
    re: Regex,
    group: Option<usize>,
    edge: [bool; 128],
    min_entropy: f64,
}

/// A compiled pattern table. Immutable once built; share it freely between threads.
pub struct SecretScanner {
    set: RegexSet,
    kinds: Vec<Kind>,
    max_matches: usize,
}

fn valid_kind(kind: &str) -> bool {
    let mut bytes = kind.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z'))
        && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
}

impl SecretScanner {
    /// Compile a pattern table.
    pub fn new(specs: &[PatternSpec], max_matches: usize) -> Result<Self, PatternError> {
        let mut kinds: Vec<Kind> = Vec::with_capacity(specs.len());
        for (index, spec) in specs.iter().enumerate() {
            let err = |message: String| PatternError { index, message };
            if !valid_kind(&spec.kind) {
                return Err(err(format!("kind {:?} is not [a-z][a-z0-9_]*", spec.kind)));
            }
            if kinds.iter().any(|k| k.name == spec.kind) {
                return Err(err(format!("kind {:?} appears twice", spec.kind)));
            }
            if !spec.edge.is_ascii() {
                return Err(err("edge characters must be ASCII".to_owned()));
            }
            if !(spec.min_entropy.is_finite() && spec.min_entropy >= 0.0) {
                return Err(err(format!(
                    "min_entropy must be finite and >= 0, got {}",
                    spec.min_entropy
                )));
            }
            let re = Regex::new(&spec.pattern).map_err(|e| err(format!("bad pattern: {e}")))?;
            if re.is_match("") {
                return Err(err("pattern matches the empty string".to_owned()));
            }
            let group = re.capture_names().position(|n| n == Some("secret"));
            let mut edge = [false; 128];
            for b in spec.edge.bytes() {
                edge[usize::from(b)] = true;
            }
            kinds.push(Kind {
                name: spec.kind.clone(),
                re,
                group,
                edge,
                min_entropy: spec.min_entropy,
            });
        }
        let set =
            RegexSet::new(specs.iter().map(|s| s.pattern.as_str())).map_err(|e| PatternError {
                index: 0,
                message: format!("pattern set: {e}"),
            })?;
        Ok(SecretScanner {
            set,
            kinds,
            max_matches,
        })
    }

    /// The kind ids, in table order.
    pub fn kinds(&self) -> impl ExactSizeIterator<Item = &str> {
        self.kinds.iter().map(|k| k.name.as_str())
    }

    /// The id of kind `index`.
    pub fn kind(&self, index: usize) -> &str {
        &self.kinds[index].name
    }

    pub fn max_matches(&self) -> usize {
        self.max_matches
    }

    /// The spans in `text`, sorted and non-overlapping, byte offsets.
    pub fn scan(&self, text: &str) -> Vec<Finding> {
        self.scan_impl(text, text.as_bytes())
    }

    /// [`scan`](Self::scan) for UTF-8 that may hold surrogate code points (encoded as three
    /// bytes, as Python's `"surrogatepass"` error handler writes them). Surrogates behave as
    /// non-ASCII characters that no pattern names; the entropy check sees each as itself.
    /// Byte offsets refer to `bytes`. Also returns the text with each surrogate replaced by
    /// U+FFFD (same length in bytes and in code points), for [`char_offsets`].
    pub fn scan_wtf8(&self, bytes: &[u8]) -> Result<(Vec<Finding>, String), InvalidText> {
        let clean = replace_surrogates(bytes)?;
        let found = self.scan_impl(&clean, bytes);
        Ok((found, clean))
    }

    fn scan_impl(&self, text: &str, original: &[u8]) -> Vec<Finding> {
        let mut out = Vec::new();
        if self.max_matches == 0 || text.is_empty() {
            return out;
        }
        let candidates: Vec<usize> = if text.len() < SET_BELOW {
            self.set.matches(text).into_iter().collect()
        } else {
            (0..self.kinds.len()).collect()
        };
        // In table order, which the tie rule below relies on.
        let mut cursors: Vec<Cursor> = Vec::with_capacity(candidates.len());
        for k in candidates {
            let kind = &self.kinds[k];
            let mut c = Cursor {
                kind: k,
                pos: 0,
                head: None,
                locs: kind.group.map(|_| kind.re.capture_locations()),
            };
            self.advance(&mut c, text, original);
            if c.head.is_some() {
                cursors.push(c);
            }
        }
        let mut last_end = 0;
        while out.len() < self.max_matches {
            let mut best: Option<(usize, usize, usize)> = None; // (cursor index, start, end)
            for (i, c) in cursors.iter_mut().enumerate() {
                while matches!(c.head, Some((s, _)) if s < last_end) {
                    self.advance(c, text, original);
                }
                if let Some((s, e)) = c.head {
                    let better = match best {
                        None => true,
                        Some((_, bs, be)) => s < bs || (s == bs && e - s > be - bs),
                    };
                    // Ties (same start, same length) keep the earlier cursor, which holds the
                    // earlier kind: cursors are in table order.
                    if better {
                        best = Some((i, s, e));
                    }
                }
            }
            let Some((i, s, e)) = best else { break };
            out.push(Finding {
                kind: cursors[i].kind,
                start: s,
                end: e,
            });
            last_end = e;
            self.advance(&mut cursors[i], text, original);
        }
        out
    }

    /// Move `c.head` to the kind's next kept match at or after `c.pos` (None when exhausted).
    fn advance(&self, c: &mut Cursor, text: &str, original: &[u8]) {
        let kind = &self.kinds[c.kind];
        let bytes = text.as_bytes();
        c.head = None;
        while c.pos <= text.len() {
            let (m_start, m_end, span) = match kind.group {
                Some(g) => {
                    let locs = c.locs.as_mut().expect("a kind with a secret group has locations");
                    match kind.re.captures_read_at(locs, text, c.pos) {
                        Some(m) => (m.start(), m.end(), locs.get(g)),
                        None => break,
                    }
                }
                None => match kind.re.find_at(text, c.pos) {
                    Some(m) => (m.start(), m.end(), Some((m.start(), m.end()))),
                    None => break,
                },
            };
            c.pos = if m_end > m_start {
                m_end
            } else {
                // Unreachable for accepted tables (no empty matches); step one character.
                m_end + text[m_end..].chars().next().map_or(1, char::len_utf8)
            };
            let Some((s, e)) = span else { continue };
            if s == e {
                continue;
            }
            let touches = |i: usize| bytes[i] < 128 && kind.edge[usize::from(bytes[i])];
            if (s > 0 && touches(s - 1) && !escaped(bytes, s - 1)) || (e < bytes.len() && touches(e)) {
                continue;
            }
            if kind.min_entropy > 0.0 && entropy_wtf8(&original[s..e]) < kind.min_entropy {
                continue;
            }
            c.head = Some((s, e));
            return;
        }
        c.pos = text.len() + 1;
    }
}

/// Whether `bytes[i]` ends an escape: one of `bfnrt` after an odd run of backslashes, or the
/// last hex digit of a `\uXXXX` escape. A token right after `\n` or `\u003e` in JSON-encoded
/// text (a tool output holding JSON) then starts at a boundary, as it would after the character
/// the escape stands for.
fn escaped(bytes: &[u8], i: usize) -> bool {
    let odd_backslashes_before = |j: usize| bytes[..j].iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1;
    if matches!(bytes[i], b'b' | b'f' | b'n' | b'r' | b't') && odd_backslashes_before(i) {
        return true;
    }
    i >= 5 && bytes[i - 4] == b'u' && bytes[i - 3..=i].iter().all(u8::is_ascii_hexdigit) && odd_backslashes_before(i - 4)
}

struct Cursor {
    kind: usize,
    pos: usize,
    head: Option<(usize, usize)>,
    /// Only for kinds whose pattern has a `secret` group (the others need no captures).
    locs: Option<CaptureLocations>,
}

/// Shannon entropy of the characters of `s`, in bits per character (0.0 for an empty string).
///
/// Computed as `log2(n) - (sum of c*log2(c) over the character counts c, in code point order)
/// / n`, the same floating-point operations in the same order as the pure twin.
pub fn shannon_entropy(s: &str) -> f64 {
    entropy_wtf8(s.as_bytes())
}

fn entropy_wtf8(bytes: &[u8]) -> f64 {
    if bytes.is_empty() {
        return 0.0;
    }
    let mut sum = 0.0f64;
    let n;
    if bytes.is_ascii() {
        let mut counts = [0u32; 128];
        for &b in bytes {
            counts[usize::from(b)] += 1;
        }
        for &c in counts.iter().filter(|&&c| c > 0) {
            let c = f64::from(c);
            sum += c * c.log2();
        }
        n = bytes.len();
    } else {
        let mut cps: Vec<u32> = Wtf8Chars { bytes, pos: 0 }.collect();
        cps.sort_unstable();
        n = cps.len();
        let mut i = 0;
        while i < cps.len() {
            let mut j = i + 1;
            while j < cps.len() && cps[j] == cps[i] {
                j += 1;
            }
            let c = (j - i) as f64;
            sum += c * c.log2();
            i = j;
        }
    }
    let n = n as f64;
    n.log2() - sum / n
}

/// Code points of UTF-8 that may contain surrogates (input already validated).
struct Wtf8Chars<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Iterator for Wtf8Chars<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        let b = &self.bytes[self.pos..];
        let first = *b.first()?;
        let (len, init) = match first {
            0x00..=0x7F => (1, u32::from(first)),
            0xC0..=0xDF => (2, u32::from(first & 0x1F)),
            0xE0..=0xEF => (3, u32::from(first & 0x0F)),
            _ => (4, u32::from(first & 0x07)),
        };
        let len = len.min(b.len());
        let cp = b[1..len]
            .iter()
            .fold(init, |acc, &x| (acc << 6) | u32::from(x & 0x3F));
        self.pos += len;
        Some(cp)
    }
}

/// `bytes` with every 3-byte surrogate sequence (ED A0..BF 80..BF) replaced by U+FFFD
/// (EF BF BD); `InvalidText` if anything else is not UTF-8.
fn replace_surrogates(bytes: &[u8]) -> Result<String, InvalidText> {
    let mut out = bytes.to_vec();
    let mut rest = 0;
    loop {
        match std::str::from_utf8(&out[rest..]) {
            Ok(_) => break,
            Err(e) => {
                let at = rest + e.valid_up_to();
                match out.get(at..at + 3) {
                    Some([0xED, 0xA0..=0xBF, 0x80..=0xBF]) => {
                        out[at..at + 3].copy_from_slice("\u{FFFD}".as_bytes());
                        rest = at + 3;
                    }
                    _ => return Err(InvalidText),
                }
            }
        }
    }
    String::from_utf8(out).map_err(|_| InvalidText)
}

/// Byte offsets of `findings` (sorted, non-overlapping) in `text` as code point offsets.
pub fn char_offsets(text: &str, findings: &[Finding]) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(findings.len());
    if findings.is_empty() {
        return out;
    }
    if text.is_ascii() {
        out.extend(findings.iter().map(|f| (f.start, f.end)));
        return out;
    }
    let (mut byte, mut chars) = (0usize, 0usize);
    for f in findings {
        chars += text[byte..f.start].chars().count();
        let start = chars;
        chars += text[f.start..f.end].chars().count();
        byte = f.end;
        out.push((start, chars));
    }
    out
}

/// `text` with each finding's span replaced by `[REDACTED:<kind>]`. Works on UTF-8 and on
/// UTF-8 with surrogates alike (spans start and end on character boundaries).
pub fn redact(scanner: &SecretScanner, text: &[u8], findings: &[Finding]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + 24 * findings.len());
    let mut at = 0;
    for f in findings {
        out.extend_from_slice(&text[at..f.start]);
        out.extend_from_slice(b"[REDACTED:");
        out.extend_from_slice(scanner.kind(f.kind).as_bytes());
        out.push(b']');
        at = f.end;
    }
    out.extend_from_slice(&text[at..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: &str, pattern: &str, edge: &str, min_entropy: f64) -> PatternSpec {
        PatternSpec {
            kind: kind.to_owned(),
            pattern: pattern.to_owned(),
            edge: edge.to_owned(),
            min_entropy,
        }
    }

    const ALNUM: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

    fn table() -> Vec<PatternSpec> {
        vec![
            spec("long_tok", "tok_[a-z]{4,}", ALNUM, 0.0),
            spec("short_tok", "tok_[a-z]{4}", "", 0.0),
            spec("assign", "key=(?P<secret>[A-Za-z0-9]{8,})", "", 2.5),
        ]
    }

    fn scan(text: &str) -> Vec<(&'static str, usize, usize)> {
        let s = SecretScanner::new(&table(), DEFAULT_MAX_MATCHES).unwrap();
        let names = ["long_tok", "short_tok", "assign"];
        s.scan(text)
            .iter()
            .map(|f| (names[f.kind], f.start, f.end))
            .collect()
    }

    #[test]
    fn longest_at_same_start_then_table_order() {
        assert_eq!(scan("x tok_abcdef y"), vec![("long_tok", 2, 12)]);
        // same span for both kinds: the earlier kind wins
        assert_eq!(scan(" tok_abcd "), vec![("long_tok", 1, 9)]);
    }

    #[test]
    fn edge_check_rejects_glued_tokens() {
        // long_tok is glued to a digit: rejected; short_tok has no edge check
        assert_eq!(scan("tok_abcd9"), vec![("short_tok", 0, 8)]);
        assert_eq!(scan("9tok_abcd"), vec![("short_tok", 1, 9)]);
    }

    #[test]
    fn an_escape_letter_is_a_boundary() {
        // `\n` then the token: the escape's letter does not glue it to a longer word
        assert_eq!(scan("a\\ntok_abcd b"), vec![("long_tok", 3, 11)]);
        assert_eq!(scan("\\ttok_abcd"), vec![("long_tok", 2, 10)]);
        // an escaped backslash then a plain `n`: glued (only short_tok, which has no edge check)
        assert_eq!(scan("\\\\ntok_abcd"), vec![("short_tok", 3, 11)]);
        // a letter that ends no escape stays glued
        assert_eq!(scan("\\xtok_abcd"), vec![("short_tok", 2, 10)]);
        // a unicode escape's last hex digit is a boundary too; hex digits alone are not
        assert_eq!(scan("\\u003etok_abcd"), vec![("long_tok", 6, 14)]);
        assert_eq!(scan("u003etok_abcd"), vec![("short_tok", 5, 13)]);
    }

    #[test]
    fn secret_group_and_entropy() {
        assert_eq!(scan("key=Ab3dE5gH9"), vec![("assign", 4, 13)]);
        assert_eq!(scan("key=aaaaaaaaaaaa"), vec![]);
    }

    #[test]
    fn sorted_non_overlapping_and_capped() {
        let text = "tok_abcd key=Xy7Qw2Er9 tok_zzzzzz";
        assert_eq!(
            scan(text),
            vec![("long_tok", 0, 8), ("assign", 13, 22), ("long_tok", 23, 33)]
        );
        let s = SecretScanner::new(&table(), 2).unwrap();
        assert_eq!(s.scan(text).len(), 2);
        let s = SecretScanner::new(&table(), 0).unwrap();
        assert!(s.scan(text).is_empty());
    }

    #[test]
    fn long_texts_skip_the_set_and_find_the_same() {
        let s = SecretScanner::new(&table(), DEFAULT_MAX_MATCHES).unwrap();
        let text = "tok_abcd key=Xy7Qw2Er9 9tok_zzzz key=aaaaaaaaaaaa tok_zzzzzz";
        let short = s.scan(text);
        assert_eq!(short.len(), 4);
        let pad = " ".repeat(SET_BELOW);
        let long = s.scan(&format!("{pad}{text}"));
        let shifted: Vec<Finding> = short
            .iter()
            .map(|f| Finding { kind: f.kind, start: f.start + SET_BELOW, end: f.end + SET_BELOW })
            .collect();
        assert_eq!(long, shifted);
        // a kind with no match in a long text drops out: nothing found, nothing kept
        assert!(s.scan(&pad).is_empty());
    }

    #[test]
    fn char_offsets_count_code_points() {
        let s = SecretScanner::new(&table(), DEFAULT_MAX_MATCHES).unwrap();
        let text = "\u{e9}\u{4e2d}\u{1f600} tok_abcd \u{e9} tok_wxyz";
        let found = s.scan(text);
        assert_eq!(char_offsets(text, &found), vec![(4, 12), (15, 23)]);
    }

    #[test]
    fn surrogates_scan_like_other_non_ascii() {
        let s = SecretScanner::new(&table(), DEFAULT_MAX_MATCHES).unwrap();
        // "\u{d800} tok_abcd" in Python's surrogatepass encoding
        let mut bytes = vec![0xED, 0xA0, 0x80];
        bytes.extend_from_slice(b" tok_abcd");
        let (found, clean) = s.scan_wtf8(&bytes).unwrap();
        assert_eq!(clean, "\u{FFFD} tok_abcd");
        assert_eq!(char_offsets(&clean, &found), vec![(2, 10)]);
        assert_eq!(redact(&s, &bytes, &found)[..3], [0xED, 0xA0, 0x80]);
        assert_eq!(s.scan_wtf8(&[0xFF]), Err(InvalidText));
    }

    #[test]
    fn redaction() {
        let s = SecretScanner::new(&table(), DEFAULT_MAX_MATCHES).unwrap();
        let text = "a tok_abcd b key=Xy7Qw2Er9";
        let out = redact(&s, text.as_bytes(), &s.scan(text));
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "a [REDACTED:long_tok] b key=[REDACTED:assign]"
        );
    }

    #[test]
    fn entropy() {
        assert_eq!(shannon_entropy(""), 0.0);
        assert_eq!(shannon_entropy("aaaa"), 0.0);
        assert_eq!(shannon_entropy("ab"), 1.0);
        assert_eq!(shannon_entropy("abcd"), 2.0);
        // 16 characters: four pairs and eight singles, exactly 3.5 bits
        assert_eq!(shannon_entropy("aabbccddefghijkl"), 3.5);
        assert_eq!(shannon_entropy("\u{e9}\u{e9}xy"), 1.5);
    }

    #[test]
    fn bad_tables_are_refused() {
        let bad = |t: Vec<PatternSpec>| SecretScanner::new(&t, 10).err().map(|e| e.index);
        assert_eq!(bad(vec![spec("Bad", "x", "", 0.0)]), Some(0));
        assert_eq!(
            bad(vec![spec("a", "x", "", 0.0), spec("a", "y", "", 0.0)]),
            Some(1)
        );
        assert_eq!(bad(vec![spec("a", "(", "", 0.0)]), Some(0));
        assert_eq!(bad(vec![spec("a", "x*", "", 0.0)]), Some(0));
        assert_eq!(bad(vec![spec("a", "x", "\u{e9}", 0.0)]), Some(0));
        assert_eq!(bad(vec![spec("a", "x", "", f64::NAN)]), Some(0));
        assert_eq!(bad(vec![spec("a", "x", "", -1.0)]), Some(0));
    }
}
