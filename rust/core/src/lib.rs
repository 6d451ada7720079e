//! hotloop's native core: pure Rust, no Python.
//!
//! * [`Fingerprinter`]: the 128-bit item fingerprint (keyed BLAKE2b with a 16-byte digest).
//! * [`ItemChain`]: an ordered chain of `(fingerprint, tokens)` items with running token sums and a
//!   capacity bound, used to find how much of a conversation is already known.
//! * [`SseDecoder`]: an incremental WHATWG Server-Sent-Events decoder for backend streams.
//! * [`plain_delta`]: whether one chat-completions stream event only continues the open output
//!   item (a token of text, reasoning or tool-call arguments), its piece, and [`delta_event`], the
//!   Responses delta event it becomes.
//! * [`SecretScanner`]: finds well-known credential formats in text (tool outputs, pasted text)
//!   from a pattern table, for redaction and classification.
//! * [`TokenCounter`]: exact o200k_base token counts (tiktoken's pieces and byte-pair merge)
//!   with a hand-written pre-tokenizer instead of a regex engine.
//!
//! The pyo3 glue in `rust/py` wraps these with coarse, builtin-typed calls; every item here has a
//! pure-Python twin in `python/hotloop/_pure.py` and tests that the two agree.

#![forbid(unsafe_code)]

pub mod chain;
pub mod fingerprint;
pub mod plain;
pub mod secrets;
pub mod sse;
pub mod tokens;

pub use chain::{ChainError, ItemChain, DEFAULT_MAX_ITEMS};
pub use fingerprint::{Fingerprinter, KeyLengthError, FINGERPRINT_LEN, MAX_KEY_LEN, MIN_KEY_LEN};
pub use plain::{delta_event, plain_delta, Plain};
pub use secrets::{PatternError, PatternSpec, SecretScanner, DEFAULT_MAX_MATCHES};
pub use sse::{Event, FeedError, SseDecoder, SseError, DEFAULT_MAX_BUFFER};
pub use tokens::{Pretokenizer, Rank, TokenCounter, VocabularyError};
