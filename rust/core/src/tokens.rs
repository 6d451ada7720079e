//! Exact o200k_base token counts without a regex engine: a hand-written pre-tokenizer for the
//! o200k pattern and tiktoken's byte-pair merge.
//!
//! [`TokenCounter::count`] equals `len(tiktoken_encoding.encode_ordinary(text))` for the
//! encoding `hotloop.tokenizer` builds (pattern `O200K_PAT`, the vocabulary given here). tiktoken
//! splits text into pieces with that pattern (fancy-regex `find_iter`: backtracking,
//! leftmost-first alternation, greedy quantifiers) and byte-pair-merges each piece. Its regex
//! engine dominates the cost: ~37 MB/s on English words, ~9 MB/s on source code, where the
//! whitespace alternative `\s+(?!\S)` runs in fancy-regex's backtracking VM. [`Pretokenizer`]
//! finds the same pieces with a few table look-ups a character.
//!
//! The pattern, one alternative a line (`|` between them):
//!
//! ```text
//! 1  [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//! 2  [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//! 3  \p{N}{1,3}
//! 4   ?[^\s\p{L}\p{N}]+[\r\n/]*
//! 5  \s*[\r\n]+
//! 6  \s+(?!\S)
//! 7  \s+
//! ```
//!
//! Naming the classes P = `[^\r\n\p{L}\p{N}]`, U = `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`,
//! W = `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`, Q = `[^\s\p{L}\p{N}]` and C the contraction group, a search
//! at position `i` finds the first alternative that matches there, and within it the first match
//! a backtracking engine finds. Worked out per alternative:
//!
//! * 1 and 2 try the optional prefix P first: with a P character at `i` the body is tried at
//!   `i + 1`, then (the `?` backtracking) at `i`, alternative 1 in both places before 2 in
//!   either. P is any character but `\r`, `\n`, letters and numbers, so one space, tab, U+00A0,
//!   U+2028 or punctuation character joins the word after it (" foo", "\tfoo", "_foo").
//!   Combining marks (\p{M}) are in P, U and W alike, so a mark at `i` can be the prefix or the
//!   first letter: "\u{301}ABC" gives "\u{301}" (alternative 1 without the prefix) and then
//!   "ABC", not "\u{301}ABC" (alternative 2 with the prefix).
//! * Body 1, `U*W+C?`: U* takes the longest run of U. If the character after the run is in W (so
//!   it is \p{Ll}), W+ takes the longest run of W from there. Otherwise U* gives back characters
//!   until W+ can start: at the last W character of the run (\p{Lm}, \p{Lo} or \p{M}), and W+ is
//!   then just that character, since what follows it is not W. No such character: no match.
//! * Body 2, `U+W*C?`: the longest run of U (at least one), then the longest run of W.
//! * C? is tried where the letters end: `'` and the first of `s t re ve m ll d` whose letters
//!   all match under simple case folding, as `(?i)` does: `s` is also U+017F (long s), and the
//!   fold sets come from `regex-syntax` rather than from ASCII case.
//! * 3: one to three \p{N}.
//! * 4: with a space at `i` and a Q character after it, the run of Q from `i + 1`; otherwise the
//!   run of Q from `i`; then the longest run of `\r`, `\n` and `/`.
//! * 5: the whitespace run from `i`, if it holds a `\r` or `\n`, up to and including the last
//!   of them (`\s*` gives back characters until `[\r\n]+` can start, at the last one, and
//!   `[\r\n]+` stops there since the last one is not followed by another).
//! * 6: the whitespace run from `i` if it reaches the end of the text; otherwise the run but its
//!   last character, if that leaves at least one: the last character of the run is followed by
//!   a non-space, so `(?!\S)` fails there and holds one character earlier.
//! * 7: the whitespace run (a single space before a non-space is its own piece when neither 1, 2
//!   nor 4 took it as a prefix).
//!
//! Every character starts some match (letters and marks 1 or 2, \p{N} 3, whitespace 5-7,
//! everything else 4), so the pieces cover the text; a character starting none would be skipped,
//! as `find_iter` does.
//!
//! The character classes are the `regex-syntax` Unicode tables the regex crates use, parsed from
//! the pattern's own class syntax when the pre-tokenizer is built, and kept as one byte of flags
//! per code point: a 128-entry table for ASCII and a two-level table for the rest.
//!
//! Each piece that is a vocabulary entry is one token; any other is split by tiktoken's
//! `_byte_pair_merge` (merge the adjacent pair whose concatenation has the lowest rank, the
//! leftmost one among equals, until no adjacent pair is in the vocabulary) and counts as its parts.
//! Long pieces (a megabyte of `!` is one piece) use a heap instead of rescanning all parts after
//! each merge, with the same order of merges.

use std::fmt;

use regex_syntax::hir::{Class, HirKind};
use rustc_hash::FxHashMap;

/// A token's rank (its id) in the vocabulary.
pub type Rank = u32;

// One bit per character class of the pattern.
const U: u8 = 1 << 0; // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
const W: u8 = 1 << 1; // [\p{Ll}\p{Lm}\p{Lo}\p{M}]
const P: u8 = 1 << 2; // [^\r\n\p{L}\p{N}]
const Q: u8 = 1 << 3; // [^\s\p{L}\p{N}]
const N: u8 = 1 << 4; // \p{N}
const S: u8 = 1 << 5; // \s
const NL: u8 = 1 << 6; // [\r\n]
const TAIL: u8 = 1 << 7; // [\r\n/]

/// The classes, spelled as in the pattern.
const CLASSES: [(u8, &str); 8] = [
    (U, r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"),
    (W, r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"),
    (P, r"[^\r\n\p{L}\p{N}]"),
    (Q, r"[^\s\p{L}\p{N}]"),
    (N, r"\p{N}"),
    (S, r"\s"),
    (NL, r"[\r\n]"),
    (TAIL, r"[\r\n/]"),
];

/// The contractions after the apostrophe, in the pattern's order.
const CONTRACTIONS: [&str; 7] = ["s", "t", "re", "ve", "m", "ll", "d"];

const BLOCK_BITS: u32 = 7;
const BLOCK: usize = 1 << BLOCK_BITS;
const CODE_POINTS: usize = 0x11_0000;

/// Class flags of every code point.
#[derive(Clone)]
struct Classes {
    ascii: [u8; 128],
    /// Per block of 128 code points, the block's offset in `blocks` (blocks repeat a lot:
    /// unassigned planes, CJK ideographs).
    index: Vec<u32>,
    blocks: Vec<u8>,
}

fn unicode_class(pattern: &str) -> Vec<(char, char)> {
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse(pattern)
        .unwrap_or_else(|e| panic!("{pattern}: {e}"));
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => class
            .ranges()
            .iter()
            .map(|r| (r.start(), r.end()))
            .collect(),
        HirKind::Literal(lit) => {
            let c = std::str::from_utf8(&lit.0)
                .ok()
                .and_then(|s| s.chars().next())
                .unwrap_or_else(|| panic!("{pattern}: not one character"));
            vec![(c, c)]
        }
        other => panic!("{pattern}: not a character class: {other:?}"),
    }
}

impl Classes {
    fn new() -> Classes {
        let mut flat = vec![0u8; CODE_POINTS];
        for (bit, pattern) in CLASSES {
            for (lo, hi) in unicode_class(pattern) {
                for f in &mut flat[lo as usize..=hi as usize] {
                    *f |= bit;
                }
            }
        }
        let mut ascii = [0u8; 128];
        ascii.copy_from_slice(&flat[..128]);
        let mut seen: FxHashMap<&[u8], u32> = FxHashMap::default();
        let mut index = Vec::with_capacity(CODE_POINTS / BLOCK);
        let mut blocks = Vec::new();
        for block in flat.chunks(BLOCK) {
            let at = *seen.entry(block).or_insert_with(|| {
                blocks.extend_from_slice(block);
                (blocks.len() - BLOCK) as u32
            });
            index.push(at);
        }
        Classes {
            ascii,
            index,
            blocks,
        }
    }

    #[inline]
    fn of(&self, cp: u32) -> u8 {
        let block = self.index[(cp >> BLOCK_BITS) as usize] as usize;
        self.blocks[block + (cp as usize & (BLOCK - 1))]
    }
}

/// The code point at `b[i]` and its length; `b` is valid UTF-8 and `i` a character boundary.
#[inline(always)]
fn decode(b: &[u8], i: usize) -> (u32, usize) {
    let b0 = b[i] as u32;
    if b0 < 0x80 {
        (b0, 1)
    } else if b0 < 0xE0 {
        (((b0 & 0x1F) << 6) | (b[i + 1] as u32 & 0x3F), 2)
    } else if b0 < 0xF0 {
        (
            ((b0 & 0x0F) << 12) | ((b[i + 1] as u32 & 0x3F) << 6) | (b[i + 2] as u32 & 0x3F),
            3,
        )
    } else {
        (
            ((b0 & 0x07) << 18)
                | ((b[i + 1] as u32 & 0x3F) << 12)
                | ((b[i + 2] as u32 & 0x3F) << 6)
                | (b[i + 3] as u32 & 0x3F),
            4,
        )
    }
}

/// Splits text into the pieces the o200k pattern finds (see the module documentation).
#[derive(Clone)]
pub struct Pretokenizer {
    classes: Classes,
    /// Per contraction, per letter, the characters `(?i)` matches for it.
    contractions: Vec<Vec<Vec<char>>>,
}

impl Default for Pretokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Pretokenizer {
    pub fn new() -> Pretokenizer {
        let contractions = CONTRACTIONS
            .iter()
            .map(|word| {
                word.chars()
                    .map(|letter| {
                        unicode_class(&format!("(?i:{letter})"))
                            .into_iter()
                            .flat_map(|(lo, hi)| lo..=hi)
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Pretokenizer {
            classes: Classes::new(),
            contractions,
        }
    }

    /// The class flags of the character at `b[i]`, and its length.
    #[inline(always)]
    fn at(&self, b: &[u8], i: usize) -> (u8, usize) {
        let b0 = b[i];
        if b0 < 0x80 {
            (self.classes.ascii[b0 as usize], 1)
        } else {
            let (cp, len) = decode(b, i);
            (self.classes.of(cp), len)
        }
    }

    /// The end of the longest run of characters in `class` from `i`.
    #[inline(always)]
    fn run(&self, b: &[u8], mut i: usize, class: u8) -> usize {
        while i < b.len() {
            let (c, len) = self.at(b, i);
            if c & class == 0 {
                break;
            }
            i += len;
        }
        i
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)?` at `i`: where it ends.
    #[inline]
    fn contraction(&self, b: &[u8], i: usize) -> usize {
        if b.get(i) != Some(&b'\'') {
            return i;
        }
        'word: for word in &self.contractions {
            let mut k = i + 1;
            for letters in word {
                if k >= b.len() {
                    continue 'word;
                }
                let (cp, len) = decode(b, k);
                if !letters.iter().any(|&c| c as u32 == cp) {
                    continue 'word;
                }
                k += len;
            }
            return k;
        }
        i
    }

    /// Alternative 1 after its prefix, `U*W+C?`, at `j`.
    #[inline]
    fn lower(&self, b: &[u8], j: usize) -> Option<usize> {
        let mut k = j;
        let mut last_w = None;
        while k < b.len() {
            let (c, len) = self.at(b, k);
            if c & U == 0 {
                if c & W != 0 {
                    let e = self.run(b, k + len, W);
                    return Some(self.contraction(b, e));
                }
                break;
            }
            k += len;
            if c & W != 0 {
                last_w = Some(k);
            }
        }
        last_w.map(|e| self.contraction(b, e))
    }

    /// Alternative 2 after its prefix, `U+W*C?`, at `j`.
    #[inline]
    fn upper(&self, b: &[u8], j: usize) -> Option<usize> {
        let k = self.run(b, j, U);
        if k == j {
            return None;
        }
        let e = self.run(b, k, W);
        Some(self.contraction(b, e))
    }

    /// The end of the match starting at `i` (a character boundary before the end), or None when
    /// no alternative matches there.
    #[inline]
    fn piece_end(&self, b: &[u8], i: usize) -> Option<usize> {
        let n = b.len();
        let (c, len) = self.at(b, i);
        let j = i + len;
        // 1 and 2: the prefix taken, then not; 1 before 2.
        if c & P != 0 && j < n {
            if let Some(e) = self.lower(b, j) {
                return Some(e);
            }
        }
        if c & (U | W) != 0 {
            if let Some(e) = self.lower(b, i) {
                return Some(e);
            }
        }
        if c & P != 0 && j < n {
            if let Some(e) = self.upper(b, j) {
                return Some(e);
            }
        }
        if c & U != 0 {
            if let Some(e) = self.upper(b, i) {
                return Some(e);
            }
        }
        // 3
        if c & N != 0 {
            let mut e = j;
            for _ in 0..2 {
                if e >= n {
                    break;
                }
                let (c, len) = self.at(b, e);
                if c & N == 0 {
                    break;
                }
                e += len;
            }
            return Some(e);
        }
        // 4
        let q = if b[i] == b' ' && j < n && self.at(b, j).0 & Q != 0 {
            Some(j)
        } else if c & Q != 0 {
            Some(i)
        } else {
            None
        };
        if let Some(q) = q {
            let e = self.run(b, q, Q);
            return Some(self.run(b, e, TAIL));
        }
        // 5, 6 and 7
        if c & S != 0 {
            let mut e = j;
            let mut last = i;
            let mut newline = if c & NL != 0 { Some(j) } else { None };
            while e < n {
                let (c, len) = self.at(b, e);
                if c & S == 0 {
                    break;
                }
                last = e;
                e += len;
                if c & NL != 0 {
                    newline = Some(e);
                }
            }
            return Some(match newline {
                Some(p) => p,
                None if e == n => e,
                None if last > i => last,
                None => e,
            });
        }
        None
    }

    /// The pieces of `text`, in order: `f(start, end)` with byte offsets.
    #[inline]
    pub fn for_each_piece(&self, text: &str, mut f: impl FnMut(usize, usize)) {
        let b = text.as_bytes();
        let mut i = 0;
        while i < b.len() {
            match self.piece_end(b, i) {
                Some(e) => {
                    f(i, e);
                    i = e;
                }
                None => i += decode(b, i).1,
            }
        }
    }

    /// The pieces of `text`, in order.
    pub fn pieces<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut out = Vec::new();
        self.for_each_piece(text, |s, e| out.push(&text[s..e]));
        out
    }
}

/// Pieces at least this long are merged with a heap. Below it the scan over all parts after
/// each merge (tiktoken's way) is faster: few parts, one cache line or two.
pub const HEAP_MERGE_MIN: usize = 128;

/// Token bytes up to this long are kept packed in a `u128` (the bytes, then the length in the
/// last byte): a look-up hashes and compares two words, with no pointer to follow and no
/// `memcmp`. Nearly every token and every pair the merge looks up is this short.
const PACKED: usize = 15;

/// `bytes` (at most `PACKED` of them) and their length in the last byte, read with a few loads
/// instead of a copy of variable length.
#[inline(always)]
fn pack(bytes: &[u8]) -> u128 {
    let n = bytes.len();
    debug_assert!(n <= PACKED);
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let half = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as u64;
    let (lo, hi) = if n >= 8 {
        // the last eight bytes, shifted down past the ones `lo` already holds
        (
            word(0),
            word(n - 8).checked_shr((16 - n as u32) * 8).unwrap_or(0),
        )
    } else if n >= 4 {
        (half(0) | half(n - 4) << ((n - 4) * 8), 0)
    } else if n > 0 {
        let b = |i: usize| (bytes[i] as u64) << (i * 8);
        (b(0) | b(n / 2) | b(n - 1), 0)
    } else {
        (0, 0)
    };
    ((hi | (n as u64) << 56) as u128) << 64 | lo as u128
}

/// A vocabulary that cannot be tiktoken's: a single byte without a token (tiktoken cannot
/// encode a piece holding it), or two tokens with one rank (tiktoken refuses the vocabulary).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VocabularyError {
    MissingByte(u8),
    DuplicateRank(Rank),
}

impl fmt::Display for VocabularyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VocabularyError::MissingByte(b) => write!(
                f,
                "the vocabulary has no token for the single byte {b:#04x}"
            ),
            VocabularyError::DuplicateRank(r) => {
                write!(f, "the vocabulary has more than one token of rank {r}")
            }
        }
    }
}

impl std::error::Error for VocabularyError {}

/// Counts o200k tokens exactly (see the module documentation).
#[derive(Clone)]
pub struct TokenCounter {
    packed: FxHashMap<u128, Rank>,
    long: FxHashMap<Box<[u8]>, Rank>,
    pretokenizer: Pretokenizer,
}

impl TokenCounter {
    /// A counter over the vocabulary `ranks` (tiktoken's mergeable ranks: token bytes and rank).
    /// A later duplicate of a key replaces the earlier one, as in a Python dict.
    pub fn new<I>(ranks: I) -> Result<TokenCounter, VocabularyError>
    where
        I: IntoIterator<Item = (Vec<u8>, Rank)>,
    {
        let ranks = ranks.into_iter();
        let mut packed: FxHashMap<u128, Rank> =
            FxHashMap::with_capacity_and_hasher(ranks.size_hint().0, Default::default());
        let mut long: FxHashMap<Box<[u8]>, Rank> = FxHashMap::default();
        for (bytes, rank) in ranks {
            if bytes.len() <= PACKED {
                packed.insert(pack(&bytes), rank);
            } else {
                long.insert(bytes.into_boxed_slice(), rank);
            }
        }
        let counter = TokenCounter {
            packed,
            long,
            pretokenizer: Pretokenizer::new(),
        };
        if let Some(b) = (0..=255u8).find(|b| counter.get(&[*b]).is_none()) {
            return Err(VocabularyError::MissingByte(b));
        }
        let mut seen: Vec<Rank> = counter
            .packed
            .values()
            .chain(counter.long.values())
            .copied()
            .collect();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(VocabularyError::DuplicateRank(w[0]));
        }
        Ok(counter)
    }

    pub fn pretokenizer(&self) -> &Pretokenizer {
        &self.pretokenizer
    }

    /// Vocabulary entries.
    pub fn len(&self) -> usize {
        self.packed.len() + self.long.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len(encode_ordinary(text))`.
    pub fn count(&self, text: &str) -> usize {
        let b = text.as_bytes();
        let mut total = 0;
        self.pretokenizer
            .for_each_piece(text, |s, e| total += self.piece_tokens(&b[s..e]));
        total
    }

    #[inline(always)]
    fn get(&self, bytes: &[u8]) -> Option<Rank> {
        if bytes.len() <= PACKED {
            self.packed.get(&pack(bytes)).copied()
        } else {
            self.long.get(bytes).copied()
        }
    }

    #[inline(always)]
    fn rank(&self, bytes: &[u8]) -> Rank {
        self.get(bytes).unwrap_or(Rank::MAX)
    }

    /// The tokens of one piece.
    #[inline]
    pub fn piece_tokens(&self, piece: &[u8]) -> usize {
        if piece.len() == 1 || self.get(piece).is_some() {
            1
        } else if piece.len() < HEAP_MERGE_MIN {
            self.merge_scan(piece)
        } else {
            self.merge_heap(piece)
        }
    }

    /// tiktoken's `_byte_pair_merge`, counting the parts (quadratic: for short pieces).
    /// `parts[k]` is the start of part `k` and the rank of the pair it begins (`Rank::MAX`: not in
    /// the vocabulary), ending in two sentinels, the last byte's and the end's.
    pub fn merge_scan(&self, piece: &[u8]) -> usize {
        let n = piece.len();
        if n < 2 {
            return n;
        }
        assert!(n < u32::MAX as usize);
        let mut stack = [(0u32, Rank::MAX); HEAP_MERGE_MIN + 1];
        let mut spilled;
        let parts: &mut [(u32, Rank)] = if n < HEAP_MERGE_MIN {
            &mut stack[..n + 1]
        } else {
            spilled = vec![(0u32, Rank::MAX); n + 1];
            &mut spilled
        };
        let mut min = (Rank::MAX, usize::MAX);
        for i in 0..n - 1 {
            let rank = self.rank(&piece[i..i + 2]);
            if rank < min.0 {
                min = (rank, i);
            }
            parts[i] = (i as u32, rank);
        }
        parts[n - 1] = ((n - 1) as u32, Rank::MAX);
        parts[n] = (n as u32, Rank::MAX);
        let mut len = n + 1;
        // The rank of part `i` joined with part `i + 1`, read before part `i + 1` is removed
        // (hence `i + 3`: the end of what will be the next part).
        let pair = |parts: &[(u32, Rank)], len: usize, i: usize| {
            if i + 3 < len {
                self.rank(&piece[parts[i].0 as usize..parts[i + 3].0 as usize])
            } else {
                Rank::MAX
            }
        };
        while min.0 != Rank::MAX {
            let i = min.1;
            if i > 0 {
                parts[i - 1].1 = pair(parts, len, i - 1);
            }
            parts[i].1 = pair(parts, len, i);
            parts.copy_within(i + 2..len, i + 1);
            len -= 1;
            min = (Rank::MAX, usize::MAX);
            for (k, &(_, rank)) in parts[..len - 1].iter().enumerate() {
                if rank < min.0 {
                    min = (rank, k);
                }
            }
        }
        len - 1
    }

    /// The same merges in O(n log n): parts are a linked list over their start offsets and the
    /// candidate pairs a min-heap of (rank, start), which pops the leftmost of the lowest rank as
    /// the scan picks it. An entry whose pair has changed since it was pushed is skipped.
    pub fn merge_heap(&self, piece: &[u8]) -> usize {
        if piece.len() <= u32::MAX as usize {
            self.merge_heap_with::<u64>(piece)
        } else {
            self.merge_heap_with::<u128>(piece)
        }
    }

    fn merge_heap_with<K: HeapKey>(&self, piece: &[u8]) -> usize {
        let n = piece.len();
        if n < 2 {
            return n;
        }
        // next[s]: start of the part after the part starting at s (n for the last part);
        // prev[s]: start of the part before it; rank[s]: rank of the pair it begins (MAX also
        // once s is no longer a part's start).
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|s| s.wrapping_sub(1)).collect();
        let mut rank = vec![Rank::MAX; n];
        let mut entries = Vec::with_capacity(n);
        for s in 0..n - 1 {
            let r = self.rank(&piece[s..s + 2]);
            rank[s] = r;
            if r != Rank::MAX {
                entries.push(K::new(r, s));
            }
        }
        let mut heap = MinHeap::from(entries);
        let mut parts = n;
        while let Some(key) = heap.pop() {
            let (r, s) = (key.rank(), key.start());
            if rank[s] != r {
                continue;
            }
            let t = next[s];
            let u = next[t];
            rank[t] = Rank::MAX;
            next[s] = u;
            if u < n {
                prev[u] = s;
            }
            parts -= 1;
            rank[s] = if u < n {
                self.rank(&piece[s..next[u]])
            } else {
                Rank::MAX
            };
            if rank[s] != Rank::MAX {
                heap.push(K::new(rank[s], s));
            }
            if s > 0 {
                let p = prev[s];
                rank[p] = self.rank(&piece[p..u]);
                if rank[p] != Rank::MAX {
                    heap.push(K::new(rank[p], p));
                }
            }
        }
        parts
    }
}

/// A (rank, start) pair packed into one integer that orders as the pair does.
trait HeapKey: Copy + Ord {
    fn new(rank: Rank, start: usize) -> Self;
    fn rank(self) -> Rank;
    fn start(self) -> usize;
}

impl HeapKey for u64 {
    #[inline(always)]
    fn new(rank: Rank, start: usize) -> u64 {
        (rank as u64) << 32 | start as u64
    }
    #[inline(always)]
    fn rank(self) -> Rank {
        (self >> 32) as Rank
    }
    #[inline(always)]
    fn start(self) -> usize {
        self as u32 as usize
    }
}

impl HeapKey for u128 {
    #[inline(always)]
    fn new(rank: Rank, start: usize) -> u128 {
        (rank as u128) << 64 | start as u128
    }
    #[inline(always)]
    fn rank(self) -> Rank {
        (self >> 64) as Rank
    }
    #[inline(always)]
    fn start(self) -> usize {
        self as u64 as usize
    }
}

/// A 4-ary min-heap: half the depth of a binary heap, and the four children of a node share a
/// cache line, which matters at a million entries.
struct MinHeap<K> {
    v: Vec<K>,
}

impl<K: Copy + Ord> MinHeap<K> {
    fn from(v: Vec<K>) -> MinHeap<K> {
        let mut heap = MinHeap { v };
        for i in (0..heap.v.len().div_ceil(4)).rev() {
            let x = heap.v[i];
            heap.sift_down(i, x);
        }
        heap
    }

    #[inline]
    fn push(&mut self, x: K) {
        let mut i = self.v.len();
        self.v.push(x);
        while i > 0 {
            let p = (i - 1) / 4;
            if self.v[p] <= x {
                break;
            }
            self.v[i] = self.v[p];
            i = p;
        }
        self.v[i] = x;
    }

    #[inline]
    fn pop(&mut self) -> Option<K> {
        let last = self.v.pop()?;
        if self.v.is_empty() {
            return Some(last);
        }
        let top = self.v[0];
        self.sift_down(0, last);
        Some(top)
    }

    /// Put `x` at `i` and move it down to its place.
    #[inline]
    fn sift_down(&mut self, mut i: usize, x: K) {
        let len = self.v.len();
        loop {
            let first = 4 * i + 1;
            if first >= len {
                break;
            }
            let mut m = first;
            for c in first + 1..(first + 4).min(len) {
                if self.v[c] < self.v[m] {
                    m = c;
                }
            }
            if self.v[m] >= x {
                break;
            }
            self.v[i] = self.v[m];
            i = m;
        }
        self.v[i] = x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pre() -> &'static Pretokenizer {
        use std::sync::OnceLock;
        static PRE: OnceLock<Pretokenizer> = OnceLock::new();
        PRE.get_or_init(Pretokenizer::new)
    }

    fn split(text: &str) -> Vec<&str> {
        pre().pieces(text)
    }

    /// The 256 single bytes (ranks 0-255) and `merges` ranked from 256 on, in order.
    fn vocab(merges: &[&[u8]]) -> Vec<(Vec<u8>, Rank)> {
        let mut v: Vec<(Vec<u8>, Rank)> = (0..=255u8).map(|b| (vec![b], b as Rank)).collect();
        for (k, m) in merges.iter().enumerate() {
            v.push((m.to_vec(), 256 + k as Rank));
        }
        v
    }

    fn counter(merges: &[&[u8]]) -> TokenCounter {
        TokenCounter::new(vocab(merges)).unwrap()
    }

    #[test]
    fn classes_come_from_the_unicode_tables() {
        let c = &pre().classes;
        let of = |ch: char| {
            if (ch as u32) < 128 {
                c.ascii[ch as usize]
            } else {
                c.of(ch as u32)
            }
        };
        assert_eq!(of('a'), W);
        assert_eq!(of('A'), U);
        assert_eq!(of('ǅ'), U); // Lt
        assert_eq!(of('ʰ'), U | W); // Lm
        assert_eq!(of('中'), U | W); // Lo
        assert_eq!(of('\u{301}'), U | W | P | Q); // a mark: in both letter classes, and not \p{L}
        assert_eq!(of('7'), N);
        assert_eq!(of('²'), N); // No
        assert_eq!(of(' '), S | P);
        assert_eq!(of('\u{a0}'), S | P);
        assert_eq!(of('\u{2028}'), S | P);
        assert_eq!(of('\u{3000}'), S | P);
        assert_eq!(of('\n'), S | NL | TAIL);
        assert_eq!(of('\r'), S | NL | TAIL);
        assert_eq!(of('/'), P | Q | TAIL);
        assert_eq!(of('!'), P | Q);
        assert_eq!(of('😀'), P | Q);
        assert_eq!(of('\u{10FFFF}'), P | Q); // unassigned
        assert!(c.blocks.len() < 1 << 20, "{} bytes", c.blocks.len());
    }

    #[test]
    fn contraction_folds_come_from_simple_case_folding() {
        let s = &pre().contractions[0][0];
        assert!(s.contains(&'s') && s.contains(&'S') && s.contains(&'\u{17F}'));
        for word in &pre().contractions[1..] {
            for letters in word {
                assert_eq!(letters.len(), 2, "{letters:?}");
            }
        }
    }

    #[test]
    fn words_and_prefixes() {
        assert_eq!(split("hello world"), ["hello", " world"]);
        assert_eq!(split("Hello World"), ["Hello", " World"]);
        assert_eq!(split("HeLLo"), ["He", "LLo"]);
        assert_eq!(split("HELLO world"), ["HELLO", " world"]);
        assert_eq!(split("\tfoo"), ["\tfoo"]);
        assert_eq!(split("\u{a0}foo"), ["\u{a0}foo"]);
        assert_eq!(split("\u{2028}foo"), ["\u{2028}foo"]);
        assert_eq!(split("\nfoo"), ["\n", "foo"]);
        assert_eq!(split("_foo"), ["_foo"]);
        assert_eq!(split("!!foo"), ["!!", "foo"]);
        assert_eq!(split("ǅemal"), ["ǅemal"]);
        assert_eq!(split("ʰʰA"), ["ʰʰ", "A"]);
        assert_eq!(split("中文A"), ["中文", "A"]);
        assert_eq!(split("AB中CD"), ["AB中", "CD"]);
        assert_eq!(split("Ǆ"), ["Ǆ"]);
    }

    #[test]
    fn combining_marks() {
        assert_eq!(split("a\u{301}b"), ["a\u{301}b"]);
        assert_eq!(split("A\u{301}"), ["A\u{301}"]);
        assert_eq!(split("\u{301}"), ["\u{301}"]);
        assert_eq!(split("\u{301}abc"), ["\u{301}abc"]);
        // the mark as the prefix leaves "ABC" with no W: alternative 1 takes the mark alone
        assert_eq!(split("\u{301}ABC"), ["\u{301}", "ABC"]);
        assert_eq!(split("AB\u{301}CD"), ["AB\u{301}", "CD"]);
        assert_eq!(split(" \u{301}"), [" \u{301}"]);
        assert_eq!(split("!\u{301}"), ["!\u{301}"]);
        assert_eq!(split("!!\u{301}"), ["!!\u{301}"]);
        assert_eq!(split("\u{301}'s"), ["\u{301}'s"]);
        assert_eq!(split("\u{301}\u{301}"), ["\u{301}\u{301}"]);
        assert_eq!(split("1\u{301}"), ["1", "\u{301}"]);
    }

    #[test]
    fn contractions() {
        assert_eq!(split("don't"), ["don't"]);
        assert_eq!(split("DON'T"), ["DON'T"]);
        assert_eq!(split("it's"), ["it's"]);
        assert_eq!(split("IT'S"), ["IT'S"]);
        assert_eq!(split("it'ſ"), ["it'ſ"]);
        assert_eq!(split("we'Re"), ["we'Re"]);
        assert_eq!(split("we'rE x"), ["we'rE", " x"]);
        assert_eq!(split("I'LL"), ["I'LL"]);
        assert_eq!(split("you'Ve"), ["you'Ve"]);
        assert_eq!(split("I'm"), ["I'm"]);
        assert_eq!(split("he'D"), ["he'D"]);
        assert_eq!(split("it'x"), ["it", "'x"]);
        assert_eq!(split("it'"), ["it", "'"]);
        assert_eq!(split("we'r"), ["we", "'r"]);
        assert_eq!(split("it'sx"), ["it's", "x"]);
        assert_eq!(split("'s"), ["'s"]);
        assert_eq!(split("a''s"), ["a", "''", "s"]);
    }

    #[test]
    fn numbers() {
        assert_eq!(split("1"), ["1"]);
        assert_eq!(split("1234567"), ["123", "456", "7"]);
        assert_eq!(split("x12"), ["x", "12"]);
        assert_eq!(split(" 12"), [" ", "12"]);
        assert_eq!(split("²³⁴⁵"), ["²³⁴", "⁵"]);
        assert_eq!(split("Ⅻ1"), ["Ⅻ1"]);
    }

    #[test]
    fn punctuation() {
        assert_eq!(split("a.b"), ["a", ".b"]);
        assert_eq!(split("a..b"), ["a", "..", "b"]);
        assert_eq!(split(" !!"), [" !!"]);
        assert_eq!(split("\t!!"), ["\t", "!!"]);
        assert_eq!(split("!!\r\n/x"), ["!!\r\n/", "x"]);
        assert_eq!(split("!!\n\n//\r\n y"), ["!!\n\n//\r\n", " y"]);
        assert_eq!(split("}\n}"), ["}\n", "}"]);
        assert_eq!(split("😀😀"), ["😀😀"]);
        assert_eq!(split(" 😀"), [" 😀"]);
    }

    #[test]
    fn whitespace() {
        assert_eq!(split("a  b"), ["a", " ", " b"]);
        assert_eq!(split("a   b"), ["a", "  ", " b"]);
        assert_eq!(split("a \tb"), ["a", " ", "\tb"]);
        assert_eq!(split("a  "), ["a", "  "]);
        assert_eq!(split("a \n b"), ["a", " \n", " b"]);
        assert_eq!(split("a\n\n  b"), ["a", "\n\n", " ", " b"]);
        assert_eq!(split("\r\n\r\n"), ["\r\n\r\n"]);
        assert_eq!(split(" \n \n  "), [" \n \n", "  "]);
        // two spaces before a non-space: the first (6), then the second alone (7)
        assert_eq!(split("x \u{a0}1"), ["x", " ", "\u{a0}", "1"]);
        assert_eq!(split("x \u{3000}1"), ["x", " ", "\u{3000}", "1"]);
        assert_eq!(split("x\t1"), ["x", "\t", "1"]);
        assert_eq!(split("\u{2028}\u{2028}1"), ["\u{2028}", "\u{2028}", "1"]);
        assert_eq!(split("  1"), [" ", " ", "1"]);
        assert_eq!(split(" "), [" "]);
        assert_eq!(split(""), Vec::<&str>::new());
    }

    #[test]
    fn packing_keeps_every_byte_and_the_length() {
        let bytes: Vec<u8> = (1..=PACKED as u8).map(|b| b * 17).collect();
        for n in 0..=PACKED {
            let mut want = [0u8; 16];
            want[..n].copy_from_slice(&bytes[..n]);
            want[15] = n as u8;
            assert_eq!(pack(&bytes[..n]), u128::from_le_bytes(want), "{n}");
        }
        assert_ne!(pack(b"a"), pack(b"a\0"));
    }

    #[test]
    fn refuses_what_tiktoken_cannot_use() {
        let mut v = vocab(&[]);
        v.retain(|(b, _)| b != &[0x80]);
        assert_eq!(
            TokenCounter::new(v).err(),
            Some(VocabularyError::MissingByte(0x80))
        );
        let mut v = vocab(&[b"ab"]);
        v.push((b"xyz".to_vec(), 7));
        assert_eq!(
            TokenCounter::new(v).err(),
            Some(VocabularyError::DuplicateRank(7))
        );
        // a later value for the same bytes replaces the earlier one, as in a dict
        let mut v = vocab(&[]);
        v.push((b"ab".to_vec(), 7));
        v.push((b"ab".to_vec(), 300));
        assert_eq!(TokenCounter::new(v).unwrap().count("ab"), 1);
    }

    #[test]
    fn merges_follow_the_lowest_rank_leftmost() {
        let c = counter(&[b"ab", b"bc", b"abc", b"cd"]);
        assert_eq!(c.merge_scan(b"abc"), 1); // ab, then abc
        assert_eq!(c.merge_scan(b"abcd"), 2); // ab, abc; "abcd" unknown
        assert_eq!(c.merge_scan(b"bcd"), 2); // bc, then "bcd" unknown, cd cannot form
        assert_eq!(c.merge_scan(b"xyz"), 3);
        // pair ranks tie: the leftmost merges first
        let c = counter(&[b"aa", b"aaa"]);
        assert_eq!(c.merge_scan(b"aaa"), 1); // aa|a -> aaa
        assert_eq!(c.merge_scan(b"aaaa"), 2); // aa|a|a, then a|a: aa|aa
                                              // a concatenation counts by its bytes, whatever pair formed it
        let c = counter(&[b"bc", b"ab", b"abc"]);
        assert_eq!(c.merge_scan(b"abc"), 1); // bc first: a|bc, and "abc" = a+bc is a token
        let c = counter(&[b"bc", b"ab"]);
        assert_eq!(c.merge_scan(b"abc"), 2);
    }

    #[test]
    fn whole_pieces_are_one_token() {
        let c = counter(&[b"zyx"]);
        assert_eq!(c.piece_tokens(b"zyx"), 1); // no pair "zy" or "yx" needed
        assert_eq!(c.count("zyx"), 1);
        assert_eq!(c.count(""), 0);
        assert_eq!(c.count("zyx zyx"), 1 + 4);
    }

    #[test]
    fn heap_and_scan_merge_alike() {
        // a small alphabet and many merges: long chains of merges with ties
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = move |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for round in 0..60 {
            let mut merges: Vec<Vec<u8>> = Vec::new();
            for _ in 0..(20 + rnd(200)) {
                let len = 2 + rnd(5) as usize;
                merges.push((0..len).map(|_| b'a' + rnd(3) as u8).collect());
            }
            let refs: Vec<&[u8]> = merges.iter().map(|m| m.as_slice()).collect();
            let c = counter(&refs);
            for _ in 0..40 {
                let len = 2 + rnd(if round % 2 == 0 { 40 } else { 400 }) as usize;
                let piece: Vec<u8> = (0..len).map(|_| b'a' + rnd(3) as u8).collect();
                assert_eq!(c.merge_scan(&piece), c.merge_heap(&piece), "{piece:?}");
            }
        }
    }

    #[test]
    fn long_pieces_stay_fast() {
        let c = counter(&[b"!!", b"!!!!", b"!!!!!!!!"]);
        let text = "!".repeat(1 << 20);
        assert_eq!(split(&text).len(), 1);
        assert_eq!(c.count(&text), (1 << 20) / 8);
        assert_eq!(c.merge_heap(&text.as_bytes()[..999]), 124 + 1 + 1 + 1);
        assert_eq!(c.merge_scan(&text.as_bytes()[..999]), 124 + 3);
    }
}
