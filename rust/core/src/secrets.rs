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
//!    a match is kept only if its span is non-empty, passes the edge check and the entropy check,
//!    and does not end with `EXAMPLE` or `EXAMPLEKEY` (the placeholder keys of vendor
//!    documentation, such as AWS's `AKIAIOSFODNN7EXAMPLE`, which models write and docs quote);
//! 2. the kept matches of all kinds are merged by span start; at the same start the longer span
//!    wins, then the kind earlier in the table;
//! 3. a span is reported when it starts at or after the end of the last reported span, so the
//!    result is sorted and non-overlapping;
//! 4. at most `max_matches` spans are reported per text (the first ones).
//!
//! Where each kind is searched: a kind whose every match starts with one of a few literal
//! prefixes (`ghp_`, `AKIA`, `-----BEGIN`, and `password`, `token`, ... spelled in any case; found
//! by the `regex-syntax` literal extractor, see [`prefixes`]) is tried only where one of them
//! occurs, anchored there. All the kinds' prefixes are found in one pass over the ASCII-lowercased
//! text (Teddy, the SIMD multi-literal search of the `aho-corasick` crate), and a kind none of
//! whose prefixes occurs is not searched at all. A kind without such prefixes searches the text on
//! its own. Both give the findings of an unanchored search of every kind (the property tests
//! check it): every match starts where one of its kind's prefixes occurs, and the anchored match
//! there is the leftmost-first one the unanchored search reports. On 2 KB of tool output this is
//! one pass of about 0.5 ns a byte where a `RegexSet` over all the patterns took 2-3 ns a byte
//! (its lazy DFA), plus a few anchored attempts.
//! Offsets here are byte offsets; [`char_offsets`] converts them to code point offsets.

use std::fmt;

use aho_corasick::{AhoCorasick, MatchKind};
use regex::{CaptureLocations, Regex};
use regex_syntax::hir::literal::{ExtractKind, Extractor};

/// Default bound on the spans reported for one text.
pub const DEFAULT_MAX_MATCHES: usize = 10_000;

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
    /// The pattern anchored at the start of the text (`\A(?:pattern)`), for a kind with
    /// [`prefixes`]: run on the text from a place where one of them occurs.
    anchored: Option<Regex>,
}

/// A compiled pattern table. Immutable once built; share it freely between threads.
pub struct SecretScanner {
    kinds: Vec<Kind>,
    /// Every kind's [`prefixes`], longest first, searched in the lowercased text.
    finder: Option<Finder>,
    /// For each prefix, the kinds of the prefixes that occur where it does: itself and the
    /// shorter prefixes it starts with (the finder reports the longest one at each place).
    prefix_kinds: Vec<Vec<usize>>,
    max_matches: usize,
}

/// Leftmost-first multi-string search: SIMD (Teddy) when the CPU and the prefixes allow it, an
/// Aho-Corasick automaton otherwise.
enum Finder {
    Packed(aho_corasick::packed::Searcher),
    Automaton(AhoCorasick),
}

impl Finder {
    fn new(needles: &[Vec<u8>], simd: bool) -> Result<Self, aho_corasick::BuildError> {
        let packed = simd
            .then(|| {
                aho_corasick::packed::Config::new()
                    .match_kind(aho_corasick::packed::MatchKind::LeftmostFirst)
                    .builder()
                    .extend(needles)
                    .build()
            })
            .flatten();
        Ok(match packed {
            Some(p) => Finder::Packed(p),
            None => Finder::Automaton(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostFirst)
                    .build(needles)?,
            ),
        })
    }

    /// The leftmost prefix at or after `from`: where, and which.
    fn find(&self, hay: &[u8], from: usize) -> Option<(usize, usize)> {
        let m = match self {
            Finder::Packed(p) => p.find_in(
                hay,
                aho_corasick::Span {
                    start: from,
                    end: hay.len(),
                },
            ),
            Finder::Automaton(a) => a.find(aho_corasick::Input::new(hay).span(from..hay.len())),
        }?;
        Some((m.start(), m.pattern().as_usize()))
    }
}

/// Places tried, in one [`SecretScanner::scan`], for one kind before it goes back to its
/// unanchored search: a text made of one kind's prefix (`token token token ...`) costs at most
/// this many anchored attempts more than the plain search.
const PREFIX_MISSES: u32 = 64;

/// A text is crowded with prefixes, and every kind then searches it on its own, when more than
/// `CROWDED_BASE` plus one every `CROWDED_BYTES` bytes occur before some place in it (checked as
/// they are found, so a text made of them is told early). Text of any kind has far fewer: 2 KB of
/// code, logs or prose 0 to 30, one every 70 bytes or more. Each costs a restart of the search
/// and an anchored attempt, so a text made of prefixes (`token1=x1 token2=x2 ...`) would
/// otherwise cost several times the plain searches.
const CROWDED_BASE: usize = 64;

/// Texts up to this many bytes are lowercased on the stack (tool descriptions, short messages).
const SMALL_TEXT: usize = 512;
const CROWDED_BYTES: usize = 32;

/// The longest prefix kept (longer ones are cut to it): long enough to be rare in text, short
/// enough that a pattern's many spellings collapse into a few.
const PREFIX_LEN: usize = 8;

/// The most prefixes one kind has (more are cut shorter, see [`prefixes`]).
const PREFIXES_PER_KIND: usize = 12;

/// The most prefixes of a whole table the SIMD search (Teddy) takes; beyond them, kinds search
/// on their own, those with the longest prefixes first (see [`SecretScanner::new`]).
const SIMD_PREFIXES: usize = 64;

/// The prefixes of `pattern`: lowercase ASCII strings of three to [`PREFIX_LEN`] bytes, one of
/// which every match of the pattern starts with, ignoring ASCII case, none a prefix of another;
/// `None` when the pattern has no such list of at most [`PREFIXES_PER_KIND`], or has look-around.
/// Found by the `regex-syntax` literal extractor (the literals every match starts with), so
/// they hold for any pattern.
fn prefixes(pattern: &str) -> Option<Vec<Vec<u8>>> {
    let hir = regex_syntax::Parser::new().parse(pattern).ok()?;
    // An anchor or a word boundary would see the anchored search's slice, not the whole text
    if !hir.properties().look_set().is_empty() {
        return None;
    }
    let mut ex = Extractor::new();
    ex.kind(ExtractKind::Prefix).limit_total(10_000);
    let seq = ex.extract(&hir);
    let mut lower: Vec<Vec<u8>> = seq
        .literals()?
        .iter()
        .map(|l| l.as_bytes()[..l.len().min(PREFIX_LEN)].to_ascii_lowercase())
        .collect();
    if lower.is_empty() || lower.iter().any(|l| l.len() < 3 || !l.is_ascii()) {
        return None;
    }
    loop {
        lower.sort();
        lower.dedup();
        // sorted: a prefix that others start with comes right before them; they find nothing more
        let mut kept: Vec<Vec<u8>> = Vec::new();
        for l in lower {
            if !kept.last().is_some_and(|k| l.starts_with(k)) {
                kept.push(l);
            }
        }
        // Many spellings (`xapp-1-`, `xapp-2-`, ...): cut them shorter until they are few
        let longest = kept.iter().map(Vec::len).max().unwrap_or(0);
        if kept.len() <= PREFIXES_PER_KIND || longest <= 3 {
            return (kept.len() <= PREFIXES_PER_KIND).then_some(kept);
        }
        lower = kept
            .into_iter()
            .map(|mut l| {
                l.truncate(longest - 1);
                l
            })
            .collect();
    }
}

fn valid_kind(kind: &str) -> bool {
    let mut bytes = kind.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z'))
        && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
}

impl SecretScanner {
    /// Compile a pattern table.
    pub fn new(specs: &[PatternSpec], max_matches: usize) -> Result<Self, PatternError> {
        Self::build(specs, max_matches, true)
    }

    /// [`new`](Self::new), with the SIMD search of prefixes or (`simd` false) the automaton.
    fn build(specs: &[PatternSpec], max_matches: usize, simd: bool) -> Result<Self, PatternError> {
        let mut kinds: Vec<Kind> = Vec::with_capacity(specs.len());
        let mut found: Vec<(usize, Vec<Vec<u8>>)> = Vec::new(); // kinds with prefixes, and theirs
        let mut needles: Vec<(Vec<u8>, Vec<usize>)> = Vec::new(); // each prefix and its kinds
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
                anchored: None,
            });
            if let Some(words) = prefixes(&spec.pattern) {
                let anchored = Regex::new(&format!("\\A(?:{})", spec.pattern))
                    .map_err(|e| err(format!("bad pattern: {e}")))?;
                kinds[index].anchored = Some(anchored);
                found.push((index, words));
            }
        }
        // Within what the SIMD search takes: the kinds whose shortest prefix is longest search on
        // their own instead (the `regex` crate's own prefilter does well on a long literal)
        while found
            .iter()
            .flat_map(|(_, w)| w)
            .collect::<std::collections::HashSet<_>>()
            .len()
            > SIMD_PREFIXES
        {
            let (i, _) = found
                .iter()
                .enumerate()
                .max_by_key(|(_, (_, w))| (w.iter().map(Vec::len).min(), w.len()))
                .expect("more prefixes than SIMD_PREFIXES: some kind has one");
            let (index, _) = found.remove(i);
            kinds[index].anchored = None;
        }
        for (index, words) in found {
            for w in words {
                match needles.iter().position(|(n, _)| *n == w) {
                    Some(i) => needles[i].1.push(index),
                    None => needles.push((w, vec![index])),
                }
            }
        }
        // Longest first: at a place where several occur (each a prefix of the longer ones), the
        // finder reports the longest, and the kinds of all of them come with it.
        needles.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        let prefix_kinds: Vec<Vec<usize>> = needles
            .iter()
            .map(|(n, _)| {
                let mut ks: Vec<usize> = needles
                    .iter()
                    .filter(|(m, _)| n.starts_with(m))
                    .flat_map(|(_, k)| k.iter().copied())
                    .collect();
                ks.sort_unstable();
                ks.dedup();
                ks
            })
            .collect();
        let words: Vec<Vec<u8>> = needles.into_iter().map(|(n, _)| n).collect();
        let finder = if words.is_empty() {
            None
        } else {
            Some(Finder::new(&words, simd).map_err(|e| PatternError {
                index: 0,
                message: format!("prefixes: {e}"),
            })?)
        };
        Ok(SecretScanner {
            kinds,
            finder,
            prefix_kinds,
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
        // Where each kind's prefixes occur, in order (a kind with prefixes and none here cannot match)
        // (allocated at the first prefix found: a clean short text allocates nothing here)
        let mut starts: Vec<Vec<usize>> = Vec::new();
        // A text crowded with prefixes (`token token token ...`): every kind searches on its own
        let mut crowded = false;
        if let Some(finder) = &self.finder {
            let mut small = [0u8; SMALL_TEXT];
            let large: Vec<u8>;
            let lower: &[u8] = if text.len() <= SMALL_TEXT {
                let buf = &mut small[..text.len()];
                buf.copy_from_slice(text.as_bytes());
                buf.make_ascii_lowercase();
                buf
            } else {
                large = text.as_bytes().to_ascii_lowercase();
                &large
            };
            let (mut from, mut found) = (0, 0);
            while let Some((s, p)) = finder.find(lower, from) {
                found += 1;
                if found > CROWDED_BASE + s / CROWDED_BYTES {
                    crowded = true;
                    break;
                }
                if starts.is_empty() {
                    starts = vec![Vec::new(); self.kinds.len()];
                }
                for &k in &self.prefix_kinds[p] {
                    starts[k].push(s);
                }
                from = s + 1;
            }
        }
        // In table order, which the tie rule below relies on.
        let mut cursors: Vec<Cursor> = Vec::new();
        for (k, kind) in self.kinds.iter().enumerate() {
            let cands = starts.get_mut(k).map(std::mem::take).unwrap_or_default();
            if kind.anchored.is_some() && cands.is_empty() && !crowded {
                continue; // none of its prefixes occurs: it cannot match
            }
            let mut c = Cursor {
                kind: k,
                pos: 0,
                head: None,
                locs: kind.group.map(|_| kind.re.capture_locations()),
                anchored_locs: match (&kind.anchored, kind.group) {
                    (Some(re), Some(_)) => Some(re.capture_locations()),
                    _ => None,
                },
                cands,
                next: 0,
                misses: if crowded { PREFIX_MISSES } else { 0 },
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
            if let Some(anchored) = kind.anchored.as_ref().filter(|_| c.misses < PREFIX_MISSES) {
                match from_prefixes(kind, anchored, c, text) {
                    Anchored::Match(m_start, m_end, span) => {
                        if self.keep(c, kind, text, original, bytes, m_start, m_end, span) {
                            return;
                        }
                        continue;
                    }
                    Anchored::Exhausted => break,
                    Anchored::TooMany => {} // the plain search from c.pos, below
                }
            }
            let (m_start, m_end, span) = match kind.group {
                Some(g) => {
                    let locs = c
                        .locs
                        .as_mut()
                        .expect("a kind with a secret group has locations");
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
            if self.keep(c, kind, text, original, bytes, m_start, m_end, span) {
                return;
            }
        }
        c.pos = text.len() + 1;
    }

    /// Move past the match `m_start..m_end` and, when its span passes the checks, make it the
    /// cursor's head (true).
    #[allow(clippy::too_many_arguments)]
    fn keep(
        &self,
        c: &mut Cursor,
        kind: &Kind,
        text: &str,
        original: &[u8],
        bytes: &[u8],
        m_start: usize,
        m_end: usize,
        span: Option<(usize, usize)>,
    ) -> bool {
        c.pos = if m_end > m_start {
            m_end
        } else {
            // Unreachable for accepted tables (no empty matches); step one character.
            m_end + text[m_end..].chars().next().map_or(1, char::len_utf8)
        };
        let Some((s, e)) = span else { return false };
        if s == e {
            return false;
        }
        let touches = |i: usize| bytes[i] < 128 && kind.edge[usize::from(bytes[i])];
        if (s > 0 && touches(s - 1) && !escaped(bytes, s - 1)) || (e < bytes.len() && touches(e)) {
            return false;
        }
        if kind.min_entropy > 0.0 && entropy_wtf8(&original[s..e]) < kind.min_entropy {
            return false;
        }
        if is_placeholder(&original[s..e]) {
            return false;
        }
        c.head = Some((s, e));
        true
    }
}

/// Whether `bytes[i]` ends an escape: one of `bfnrt` after an odd run of backslashes, or the
/// last hex digit of a `\uXXXX` escape. A token right after `\n` or `\u003e` in JSON-encoded
/// text (a tool output holding JSON) then starts at a boundary, as it would after the character
/// the escape stands for.
fn escaped(bytes: &[u8], i: usize) -> bool {
    let odd_backslashes_before =
        |j: usize| bytes[..j].iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1;
    if matches!(bytes[i], b'b' | b'f' | b'n' | b'r' | b't') && odd_backslashes_before(i) {
        return true;
    }
    i >= 5
        && bytes[i - 4] == b'u'
        && bytes[i - 3..=i].iter().all(u8::is_ascii_hexdigit)
        && odd_backslashes_before(i - 4)
}

struct Cursor {
    kind: usize,
    pos: usize,
    head: Option<(usize, usize)>,
    /// Only for kinds whose pattern has a `secret` group (the others need no captures).
    locs: Option<CaptureLocations>,
    /// The same for the anchored pattern.
    anchored_locs: Option<CaptureLocations>,
    /// Where the kind's prefixes occur in the text, in order, and the next one to try.
    cands: Vec<usize>,
    next: usize,
    /// Places where the anchored pattern did not match (see [`PREFIX_MISSES`]).
    misses: u32,
}

/// What [`from_prefixes`] found.
enum Anchored {
    /// The kind's next match at or after the cursor's position: start, end, reported span.
    Match(usize, usize, Option<(usize, usize)>),
    /// None: no place left where a match starts.
    Exhausted,
    /// The cursor used up its [`PREFIX_MISSES`]: search on without its prefixes.
    TooMany,
}

/// The kind's leftmost match at or after `c.pos`. Every match starts where one of the kind's
/// prefixes occurs, so the first such place where the anchored pattern matches is where the
/// unanchored search would find it, and the anchored pattern's match there is the one it would
/// report (leftmost-first at a given start).
fn from_prefixes(kind: &Kind, anchored: &Regex, c: &mut Cursor, text: &str) -> Anchored {
    while let Some(&s) = c.cands.get(c.next) {
        c.next += 1;
        if s < c.pos {
            continue;
        }
        // a prefix is ASCII, so it starts on a character boundary
        let rest = &text[s..];
        let found = match c.anchored_locs.as_mut() {
            Some(locs) => anchored.captures_read(locs, rest).map(|m| {
                (
                    s + m.start(),
                    s + m.end(),
                    kind.group
                        .and_then(|g| locs.get(g))
                        .map(|(a, b)| (s + a, s + b)),
                )
            }),
            None => anchored.find(rest).map(|m| {
                (
                    s + m.start(),
                    s + m.end(),
                    Some((s + m.start(), s + m.end())),
                )
            }),
        };
        if let Some((ms, me, span)) = found {
            return Anchored::Match(ms, me, span);
        }
        c.misses += 1;
        if c.misses >= PREFIX_MISSES {
            return Anchored::TooMany;
        }
    }
    Anchored::Exhausted
}

/// Whether a span is a documentation placeholder (rule 1): it ends with `EXAMPLE` or `EXAMPLEKEY`.
fn is_placeholder(span: &[u8]) -> bool {
    span.ends_with(b"EXAMPLE") || span.ends_with(b"EXAMPLEKEY")
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
    fn documentation_placeholders_are_not_kept() {
        assert_eq!(scan("key=Ab3dE5gH9EXAMPLE"), vec![]);
        assert_eq!(scan("key=Ab3dE5gH9EXAMPLEKEY"), vec![]);
        // only at the end, and only in capitals
        assert_eq!(scan("key=EXAMPLEAb3dE5gH9"), vec![("assign", 4, 20)]);
        assert_eq!(scan("key=Ab3dE5gH9example"), vec![("assign", 4, 20)]);
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
    fn a_shifted_text_finds_the_same_shifted() {
        let s = SecretScanner::new(&table(), DEFAULT_MAX_MATCHES).unwrap();
        let text = "tok_abcd key=Xy7Qw2Er9 9tok_zzzz key=aaaaaaaaaaaa tok_zzzzzz";
        let short = s.scan(text);
        assert_eq!(short.len(), 4);
        let pad = " ".repeat(5000);
        let long = s.scan(&format!("{pad}{text}"));
        let shifted: Vec<Finding> = short
            .iter()
            .map(|f| Finding {
                kind: f.kind,
                start: f.start + 5000,
                end: f.end + 5000,
            })
            .collect();
        assert_eq!(long, shifted);
        assert!(s.scan(&pad).is_empty());
    }

    // Kinds spelled in any case, as in the project's table, and one with a plain prefix.
    fn keyword_table() -> Vec<PatternSpec> {
        vec![
            spec("pem", "-----BEGIN[ A-Z]{0,20}PRIVATE KEY-----", "", 0.0),
            spec(
                "generic",
                "(?:[Pp][Aa][Ss][Ss][Ww][Oo][Rr][Dd]|[Pp][Aa][Ss][Ss][Ww][Dd]|[Ss][Ee][Cc][Rr][Ee][Tt]|[Tt][Oo][Kk][Ee][Nn]|[Aa][Pp][Ii][_-]?[Kk][Ee][Yy]|[Aa][Cc][Cc][Ee][Ss][Ss][_-]?[Kk][Ee][Yy])(?:[_.-][A-Za-z0-9_.-]{0,30})?[\"']?[ \\t]{0,8}(?:=>|:=|=|:)[ \\t]{0,8}[\"']?(?P<secret>[A-Za-z0-9+/=_~!@#%^&*?-]{12,})",
                "",
                3.0,
            ),
            spec(
                "auth",
                "[Aa][Uu][Tt][Hh][Oo][Rr][Ii][Zz][Aa][Tt][Ii][Oo][Nn][ \\t]{0,8}[:=][ \\t]{0,8}(?:[Bb]earer|[Tt]oken)[ \\t]{1,8}(?P<secret>[A-Za-z0-9_~+/=.-]{16,})",
                "",
                3.0,
            ),
            spec("secret_word", "[Ss][Ee][Cc][Rr][Ee][Tt][A-Za-z]{0,6}", ALNUM, 0.0),
        ]
    }

    /// Every kind searched on its own, unanchored: the reference the prefixes must agree with.
    fn without_prefixes(mut s: SecretScanner) -> SecretScanner {
        for k in &mut s.kinds {
            k.anchored = None;
        }
        s
    }

    #[test]
    fn prefixes_come_from_the_pattern() {
        let words = |p: &str| {
            prefixes(p).map(|w| {
                w.iter()
                    .map(|k| String::from_utf8(k.clone()).unwrap())
                    .collect::<Vec<_>>()
            })
        };
        // lowercase, cut to PREFIX_LEN bytes, none a prefix of another
        assert_eq!(
            words("[Tt][Oo][Kk][Ee][Nn]=x"),
            Some(vec!["token=x".to_owned()])
        );
        assert_eq!(
            words("(?:[Pp][Aa][Ss][Ss][Ww][Oo][Rr][Dd]|[Pp][Aa][Ss][Ss]|[Aa][Pp][Ii][_-]?[Kk][Ee][Yy])[A-Za-z0-9]"),
            Some(vec!["api-key".to_owned(), "api_key".to_owned(), "apikey".to_owned(), "pass".to_owned()])
        );
        assert_eq!(words("ghp_[A-Za-z0-9]{36}"), Some(vec!["ghp_".to_owned()]));
        assert_eq!(
            words("-----BEGIN[ A-Z]{0,20}KEY"),
            Some(vec!["-----beg".to_owned()])
        );
        // many spellings are cut shorter until they are few
        assert_eq!(
            words("(?:xapp|xoxa|xoxb)-[0-9]-[a-z]+"),
            Some(vec![
                "xapp-".to_owned(),
                "xoxa-".to_owned(),
                "xoxb-".to_owned()
            ])
        );
        // no literal start, or one too short, or too many: none
        assert_eq!(words("[A-Za-z0-9]{40}"), None);
        // look-around (outside what a table may use): none, so the slice never changes a match
        assert_eq!(words("^ghp_[a-z]{4}"), None);
        assert_eq!(words("\\bghp_[a-z]{4}"), None);
        assert_eq!(words("[Aa][Bb]"), None);
        assert_eq!(words("(?:[a-p][0-9])[0-9]x"), None);
        let s = SecretScanner::new(&keyword_table(), DEFAULT_MAX_MATCHES).unwrap();
        assert!(s.kinds.iter().all(|k| k.anchored.is_some()));
        assert!(matches!(
            s.finder,
            Some(Finder::Packed(_)) | Some(Finder::Automaton(_))
        ));
    }

    #[test]
    fn prefixes_find_what_the_plain_search_finds() {
        let fast = SecretScanner::new(&keyword_table(), DEFAULT_MAX_MATCHES).unwrap();
        let plain =
            without_prefixes(SecretScanner::new(&keyword_table(), DEFAULT_MAX_MATCHES).unwrap());
        let cases = [
            "PASSWORD='kDnNfribxUdl7dXTPyLs'",
            "x pAsSwOrD: Xk29fjQm4LpW8zNc and token=aaaaaaaaaaaaaaaa then Token = Qm4LpW8zNcXk29fj",
            // prefixes that overlap: \"access\" then \"secret\" starting inside it
            "accessecret=Zx81Lm29Qa7Wp3Ks accesSecretive",
            // a prefix not followed by a match, then one that is; a rejected span (low entropy)
            "token token: tokens api_key=\"ab\" apiKey = 'J8d7Kq2mZ0xV5bNw' secret=zzzzzzzzzzzzzzzz",
            "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.abc authorization=token 0123456789abcdefXYZ",
            // non-ASCII around prefixes (byte offsets stay those of the text)
            "é TOKEN=\u{1F600}ab Tökén password=Ab3dE5gH9jK1mN ü",
            "-----BEGIN RSA PRIVATE KEY----- secretsauce SECRETIVE",
        ];
        for text in cases {
            assert_eq!(fast.scan(text), plain.scan(text), "{text:?}");
        }
        // every kind finds something above, so the comparison is not vacuous
        let kinds: std::collections::BTreeSet<usize> = cases
            .iter()
            .flat_map(|t| fast.scan(t))
            .map(|f| f.kind)
            .collect();
        assert_eq!(kinds.into_iter().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        // pseudo-random texts from prefix fragments in mixed case, short and long
        let parts = [
            "pass",
            "PASSWORD",
            "Passwd",
            "word",
            "=",
            ": ",
            "'",
            "\"",
            " ",
            "\n",
            "token",
            "TOKEN",
            "Secret",
            "api",
            "_key",
            "-KEY",
            "access",
            "Xk29fjQm4LpW8zNc",
            "aaaaaaaaaaaaaaaa",
            "Authorization:",
            " Bearer ",
            "0123456789abcdefXYZ",
            "é",
            "secretive",
            "ApI-KeY",
        ];
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut found = 0;
        for round in 0..400 {
            let mut text = String::new();
            let target = if round % 4 == 0 { 5000 } else { 200 };
            while text.len() < target {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                text.push_str(parts[(state % parts.len() as u64) as usize]);
            }
            let got = fast.scan(&text);
            assert_eq!(got, plain.scan(&text), "{text:?}");
            found += got.len();
        }
        assert!(found > 100, "{found}");
    }

    #[test]
    fn past_the_simd_search_kinds_search_on_their_own_or_the_automaton_finds_them() {
        // 70 kinds of one prefix each, two of them longer: those two search on their own
        let mut specs: Vec<PatternSpec> = (0..70)
            .map(|i| {
                spec(
                    &format!("k{i}"),
                    &format!("[Kk]{i:02}_[a-z]{{4}}"),
                    ALNUM,
                    0.0,
                )
            })
            .collect();
        specs[5] = spec("k5", "[Kk]05_long_[a-z]{4}", ALNUM, 0.0);
        specs[9] = spec("k9", "[Kk]09_longer_[a-z]{4}", ALNUM, 0.0);
        let fast = SecretScanner::new(&specs, DEFAULT_MAX_MATCHES).unwrap();
        let own: Vec<usize> = (0..70)
            .filter(|&k| fast.kinds[k].anchored.is_none())
            .collect();
        assert_eq!(own.len(), 6, "{own:?}");
        assert!(own.contains(&5) && own.contains(&9));
        let automaton = SecretScanner::build(&specs, DEFAULT_MAX_MATCHES, false).unwrap();
        assert!(matches!(automaton.finder, Some(Finder::Automaton(_))));
        assert!(automaton.kinds.iter().any(|k| k.anchored.is_some()));
        let plain = without_prefixes(SecretScanner::new(&specs, DEFAULT_MAX_MATCHES).unwrap());
        let text = "x K07_abcd k69_wxyz 12_abcd k12_ab K3_abcd k00_zzzz9 k00_zzzz k05_long_abcd K09_LONGER_abcd k09_longer_abcd";
        let got = fast.scan(text);
        assert_eq!(got.len(), 5);
        assert_eq!(got, plain.scan(text));
        assert_eq!(automaton.scan(text), got);
        let table = keyword_table();
        let auto_kw = SecretScanner::build(&table, DEFAULT_MAX_MATCHES, false).unwrap();
        let simd_kw = SecretScanner::new(&table, DEFAULT_MAX_MATCHES).unwrap();
        for t in [
            "PASSWORD='kDnNfribxUdl7dXTPyLs' accessecret=Zx81Lm29Qa7Wp3Ks",
            "token token: Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.abc",
        ] {
            assert_eq!(auto_kw.scan(t), simd_kw.scan(t), "{t:?}");
        }
    }

    #[test]
    fn a_text_crowded_with_prefixes_is_searched_plainly() {
        let fast = SecretScanner::new(&keyword_table(), DEFAULT_MAX_MATCHES).unwrap();
        let plain =
            without_prefixes(SecretScanner::new(&keyword_table(), DEFAULT_MAX_MATCHES).unwrap());
        for n in [10, 200, 2000] {
            let text = format!(
                "{}Token: Qm4LpW8zNcXk29fj {}",
                "tokens ".repeat(n),
                "pass ".repeat(n)
            );
            let got = fast.scan(&text);
            assert_eq!(got.len(), 1, "{n}");
            assert_eq!(got, plain.scan(&text), "{n}");
        }
    }

    #[test]
    fn a_text_of_prefixes_falls_back_to_the_plain_search() {
        let fast = SecretScanner::new(&keyword_table(), DEFAULT_MAX_MATCHES).unwrap();
        let plain =
            without_prefixes(SecretScanner::new(&keyword_table(), DEFAULT_MAX_MATCHES).unwrap());
        // more places without a match than PREFIX_MISSES, then matches
        let text = format!(
            "{}token = Qm4LpW8zNcXk29fj password: Xk29fjQm4LpW8zNc",
            "token ".repeat(200)
        );
        let got = fast.scan(&text);
        assert_eq!(got.len(), 2);
        assert_eq!(got, plain.scan(&text));
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
