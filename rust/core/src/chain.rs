//! An ordered chain of conversation items with running token sums.
//!
//! Each item is a `(fingerprint, tokens)` pair (a 128-bit fingerprint, see [`crate::fingerprint`]). The chain answers, in O(1) or O(matched), the two
//! questions a turn asks: how many leading items of a new request are already known
//! ([`ItemChain::common_prefix`]) and how many tokens they hold ([`ItemChain::tokens_upto`]).

use std::fmt;

/// Default capacity bound of a chain (items).
pub const DEFAULT_MAX_ITEMS: usize = 100_000;

/// Why a chain operation was refused. A refused operation leaves the chain unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainError {
    /// The operation would grow the chain beyond `max_items`.
    CapacityExceeded { max_items: usize },
    /// `extend` got fingerprint and token slices of different lengths.
    LengthMismatch { fps: usize, tokens: usize },
    /// `tokens_upto(n)` with `n > len`.
    OutOfRange { n: usize, len: usize },
}

impl fmt::Display for ChainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChainError::CapacityExceeded { max_items } => {
                write!(f, "ItemChain is full (max_items={max_items})")
            }
            ChainError::LengthMismatch { fps, tokens } => write!(
                f,
                "fps and tokens must have equal lengths (got {fps} and {tokens})"
            ),
            ChainError::OutOfRange { n, len } => {
                write!(f, "n={n} is out of range for a chain of {len} items")
            }
        }
    }
}

impl std::error::Error for ChainError {}

/// The chain: fingerprints plus cumulative token counts (`cum[i]` = tokens of items `0..=i`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemChain {
    fps: Vec<u128>,
    cum: Vec<u64>,
    max_items: usize,
}

impl Default for ItemChain {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_ITEMS)
    }
}

impl ItemChain {
    /// An empty chain that refuses to hold more than `max_items` items.
    pub fn new(max_items: usize) -> Self {
        ItemChain {
            fps: Vec::new(),
            cum: Vec::new(),
            max_items,
        }
    }

    pub fn max_items(&self) -> usize {
        self.max_items
    }

    pub fn len(&self) -> usize {
        self.fps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fps.is_empty()
    }

    /// Sum of the tokens of all items.
    pub fn total_tokens(&self) -> u64 {
        self.cum.last().copied().unwrap_or(0)
    }

    /// Append one item.
    pub fn push(&mut self, fp: u128, tokens: u32) -> Result<(), ChainError> {
        if self.fps.len() >= self.max_items {
            return Err(ChainError::CapacityExceeded {
                max_items: self.max_items,
            });
        }
        let total = self.total_tokens() + u64::from(tokens);
        self.fps.push(fp);
        self.cum.push(total);
        Ok(())
    }

    /// Append many items, all or nothing.
    pub fn extend(&mut self, fps: &[u128], tokens: &[u32]) -> Result<(), ChainError> {
        if fps.len() != tokens.len() {
            return Err(ChainError::LengthMismatch {
                fps: fps.len(),
                tokens: tokens.len(),
            });
        }
        if fps.len() > self.max_items - self.fps.len() {
            return Err(ChainError::CapacityExceeded {
                max_items: self.max_items,
            });
        }
        self.fps.extend_from_slice(fps);
        self.cum.reserve(tokens.len());
        let mut total = self.total_tokens();
        for &t in tokens {
            total += u64::from(t);
            self.cum.push(total);
        }
        Ok(())
    }

    /// How many leading entries of `fps` equal this chain's fingerprints.
    pub fn common_prefix(&self, fps: &[u128]) -> usize {
        self.common_prefix_from(0, fps)
    }

    /// How many leading entries of `fps` equal this chain's fingerprints from item `start` on
    /// (0 when `start` is at or past the end).
    pub fn common_prefix_from(&self, start: usize, fps: &[u128]) -> usize {
        self.fps
            .get(start..)
            .map_or(0, |tail| tail.iter().zip(fps).take_while(|(a, b)| a == b).count())
    }

    /// Sum of the tokens of the first `n` items.
    pub fn tokens_upto(&self, n: usize) -> Result<u64, ChainError> {
        match n {
            0 => Ok(0),
            n if n <= self.cum.len() => Ok(self.cum[n - 1]),
            n => Err(ChainError::OutOfRange {
                n,
                len: self.cum.len(),
            }),
        }
    }

    /// Keep the first `n` items (no-op when `n >= len`).
    pub fn truncate(&mut self, n: usize) {
        self.fps.truncate(n);
        self.cum.truncate(n);
    }

    pub fn fingerprints(&self) -> &[u128] {
        &self.fps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_and_sums() {
        let mut c = ItemChain::default();
        assert!(c.is_empty());
        assert_eq!(c.total_tokens(), 0);
        c.push(1, 10).unwrap();
        c.push(2, 20).unwrap();
        c.push(3, u32::MAX).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(c.total_tokens(), 30 + u64::from(u32::MAX));
        assert_eq!(c.tokens_upto(0), Ok(0));
        assert_eq!(c.tokens_upto(1), Ok(10));
        assert_eq!(c.tokens_upto(2), Ok(30));
        assert_eq!(c.tokens_upto(3), Ok(30 + u64::from(u32::MAX)));
        assert_eq!(
            c.tokens_upto(4),
            Err(ChainError::OutOfRange { n: 4, len: 3 })
        );
        assert_eq!(c.fingerprints(), &[1, 2, 3]);
    }

    #[test]
    fn extend_is_all_or_nothing() {
        let mut c = ItemChain::new(3);
        c.extend(&[1, 2], &[5, 6]).unwrap();
        assert_eq!(
            c.extend(&[3], &[]),
            Err(ChainError::LengthMismatch { fps: 1, tokens: 0 })
        );
        assert_eq!(
            c.extend(&[3, 4], &[1, 1]),
            Err(ChainError::CapacityExceeded { max_items: 3 })
        );
        assert_eq!(c.len(), 2);
        assert_eq!(c.total_tokens(), 11);
        c.extend(&[3], &[7]).unwrap();
        assert_eq!(c.total_tokens(), 18);
        assert_eq!(
            c.push(9, 9),
            Err(ChainError::CapacityExceeded { max_items: 3 })
        );
        c.extend(&[], &[]).unwrap();
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn zero_capacity() {
        let mut c = ItemChain::new(0);
        assert!(c.push(1, 1).is_err());
        c.extend(&[], &[]).unwrap();
        assert!(c.is_empty());
    }

    #[test]
    fn common_prefix_and_truncate() {
        let mut c = ItemChain::default();
        c.extend(&[1, 2, 3, 4], &[1, 2, 3, 4]).unwrap();
        assert_eq!(c.common_prefix(&[]), 0);
        assert_eq!(c.common_prefix(&[1, 2, 9, 4]), 2);
        assert_eq!(c.common_prefix(&[1, 2, 3, 4, 5, 6]), 4);
        assert_eq!(c.common_prefix(&[9]), 0);
        assert_eq!(c.common_prefix_from(2, &[3, 4, 5]), 2);
        assert_eq!(c.common_prefix_from(2, &[3, 9]), 1);
        assert_eq!(c.common_prefix_from(4, &[5]), 0);
        assert_eq!(c.common_prefix_from(99, &[1]), 0);
        let copy = c.clone();
        c.truncate(2);
        assert_eq!(c.len(), 2);
        assert_eq!(c.total_tokens(), 3);
        assert_eq!(copy.len(), 4);
        c.truncate(10);
        assert_eq!(c.len(), 2);
        c.push(7, 100).unwrap();
        assert_eq!(c.total_tokens(), 103);
        c.truncate(0);
        assert_eq!(c.total_tokens(), 0);
    }
}
