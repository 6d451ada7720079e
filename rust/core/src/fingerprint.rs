//! Item fingerprints: keyed BLAKE2b with a 16-byte digest (the `blake2b_simd` crate).
//!
//! A fingerprint is `BLAKE2b(data, key, digest_length=16)` read as a little-endian `u128`; its
//! bytes (`to_le_bytes`) equal Python's `hashlib.blake2b(data, digest_size=16, key=key).digest()`.
//! The key is the deployment's secret, so nobody without it can craft two items with one
//! fingerprint. The digest length and the key length are part of the BLAKE2 parameter block:
//! this is not a truncated BLAKE2b-512.

use std::fmt;

/// Shortest key accepted (bytes): a shorter one would make the fingerprints guessable.
pub const MIN_KEY_LEN: usize = 16;
/// Longest key BLAKE2b takes (bytes).
pub const MAX_KEY_LEN: usize = blake2b_simd::KEYBYTES;
/// Digest length (bytes).
pub const FINGERPRINT_LEN: usize = 16;

/// A key of the wrong length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLengthError {
    pub len: usize,
}

impl fmt::Display for KeyLengthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a fingerprint key must be {MIN_KEY_LEN} to {MAX_KEY_LEN} bytes, got {}",
            self.len
        )
    }
}

impl std::error::Error for KeyLengthError {}

/// Fingerprints under one key. `Debug` never shows the key.
#[derive(Clone)]
pub struct Fingerprinter {
    params: blake2b_simd::Params,
}

impl fmt::Debug for Fingerprinter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Fingerprinter { .. }")
    }
}

impl Fingerprinter {
    pub fn new(key: &[u8]) -> Result<Self, KeyLengthError> {
        if !(MIN_KEY_LEN..=MAX_KEY_LEN).contains(&key.len()) {
            return Err(KeyLengthError { len: key.len() });
        }
        let mut params = blake2b_simd::Params::new();
        params.hash_length(FINGERPRINT_LEN).key(key);
        Ok(Fingerprinter { params })
    }

    /// The fingerprint of `data`.
    pub fn fingerprint(&self, data: &[u8]) -> u128 {
        let hash = self.params.hash(data);
        let mut out = [0u8; FINGERPRINT_LEN];
        out.copy_from_slice(hash.as_bytes());
        u128::from_le_bytes(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(v: u128) -> String {
        v.to_le_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Vectors from `hashlib.blake2b(data, digest_size=16, key=bytes(range(32))).hexdigest()`.
    #[test]
    fn known_vectors() {
        let key: Vec<u8> = (0u8..32).collect();
        let f = Fingerprinter::new(&key).unwrap();
        let pattern: Vec<u8> = (0..5).flat_map(|_| 0u8..=255).collect();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"".to_vec(), "3daf97bce7888fd59773c66bf647459c"),
            (b"abc".to_vec(), "1a64be47e4729d951c302ee543f97cf3"),
            (vec![b'a'; 127], "041ee0c6a501742ab96ecba2b8236d6d"),
            (vec![b'a'; 128], "0b9a3002df3da114394c7d5c27de9330"),
            (vec![b'a'; 129], "1323c48fcde1d1e9fde147e4071bfd26"),
            (pattern, "09cc62ca5a77b2e91bf8544894497695"),
        ];
        for (data, want) in cases {
            assert_eq!(hex(f.fingerprint(&data)), want, "len {}", data.len());
        }
    }

    #[test]
    fn the_key_matters() {
        let a = Fingerprinter::new(&[1u8; 32]).unwrap();
        let b = Fingerprinter::new(&[2u8; 32]).unwrap();
        assert_ne!(a.fingerprint(b"item"), b.fingerprint(b"item"));
        assert_eq!(a.fingerprint(b"item"), a.clone().fingerprint(b"item"));
        assert_eq!(format!("{a:?}"), "Fingerprinter { .. }");
    }

    #[test]
    fn key_length_is_bounded() {
        assert_eq!(
            Fingerprinter::new(&[0u8; 15]).unwrap_err(),
            KeyLengthError { len: 15 }
        );
        assert!(Fingerprinter::new(&[0u8; 65]).is_err());
        assert!(Fingerprinter::new(&[0u8; 16]).is_ok());
        assert!(Fingerprinter::new(&[0u8; 64]).is_ok());
    }
}
