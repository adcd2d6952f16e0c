//! The `.npy` header, as numpy writes it.
//!
//! A `.npy` file is: the six bytes `\x93NUMPY`, a major and a minor version byte, the header
//! length (2 bytes little-endian in version 1, 4 bytes in versions 2 and 3), then the header:
//! a Python dict literal such as `{'descr': '<u2', 'fortran_order': False, 'shape': (1000,), }`
//! padded with spaces and a newline so the data starts on a 64-byte boundary. The data is
//! the array's elements, back to back, in the byte order `descr` names (`<` little-endian,
//! `|` for one-byte types). Only what token files need is accepted: one dimension, C order.

use std::path::Path;

use crate::error::{DataloadError, Result};

const MAGIC: &[u8] = b"\x93NUMPY";
/// Headers numpy writes are a few hundred bytes; refuse absurd lengths before reading them.
const MAX_HEADER: usize = 1 << 20;

/// What a `.npy` header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NpyHeader {
    /// numpy's type string, e.g. `<u2`.
    pub descr: String,
    /// Number of elements (the one dimension).
    pub len: u64,
    /// Where the data starts.
    pub data_offset: usize,
}

pub(crate) fn parse_header(bytes: &[u8], path: &Path) -> Result<NpyHeader> {
    let bad = |reason: String| DataloadError::BadFormat { path: path.to_owned(), format: "npy", reason };
    if bytes.len() < 10 || !bytes.starts_with(MAGIC) {
        return Err(bad("missing the `\\x93NUMPY` magic".into()));
    }
    let major = bytes[6];
    let (len_bytes, start) = match major {
        1 => (2, 10),
        2 | 3 => (4, 12),
        v => return Err(bad(format!("unknown version {v}"))),
    };
    let len_field = bytes.get(8..8 + len_bytes).ok_or_else(|| bad("header length cut off".into()))?;
    let header_len = len_field.iter().rev().fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
    if header_len > MAX_HEADER {
        return Err(bad(format!("header of {header_len} bytes is larger than {MAX_HEADER}")));
    }
    let end = start + header_len;
    let header = bytes.get(start..end).ok_or_else(|| DataloadError::Truncated {
        path: path.to_owned(),
        expected: end as u64,
        found: bytes.len() as u64,
    })?;
    let text = std::str::from_utf8(header).map_err(|_| bad("header is not text".into()))?;
    let descr = dict_value(text, "descr").ok_or_else(|| bad("no `descr`".into()))?;
    let descr = descr.trim_matches(['\'', '"']).to_owned();
    let fortran = dict_value(text, "fortran_order").ok_or_else(|| bad("no `fortran_order`".into()))?;
    let shape = dict_value(text, "shape").ok_or_else(|| bad("no `shape`".into()))?;
    let dims: Vec<&str> = shape
        .trim_start_matches('(')
        .trim_end_matches(')')
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    if dims.len() != 1 {
        return Err(bad(format!("shape {shape} is not one-dimensional")));
    }
    let len: u64 = dims[0].parse().map_err(|_| bad(format!("shape {shape} is not a tuple of integers")))?;
    // One dimension reads the same in either order; only the value's form is checked.
    if fortran != "False" && fortran != "True" {
        return Err(bad(format!("`fortran_order` is {fortran}")));
    }
    Ok(NpyHeader { descr, len, data_offset: end })
}

/// The raw text of `key`'s value in a Python dict literal of simple values (strings, booleans,
/// tuples of integers).
fn dict_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let at = text.find(&format!("'{key}'")).or_else(|| text.find(&format!("\"{key}\"")))?;
    let rest = text[at + key.len() + 2..].trim_start().strip_prefix(':')?.trim_start();
    let end = if rest.starts_with('(') {
        rest.find(')')? + 1
    } else if let Some(q) = rest.chars().next().filter(|c| *c == '\'' || *c == '"') {
        rest[1..].find(q)? + 2
    } else {
        rest.find([',', '}']).unwrap_or(rest.len())
    };
    Some(rest[..end].trim())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn file(header: &str) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        v.extend_from_slice(&[1, 0]);
        v.extend_from_slice(&(header.len() as u16).to_le_bytes());
        v.extend_from_slice(header.as_bytes());
        v
    }

    #[test]
    fn parses_what_numpy_writes() {
        let h = parse_header(&file("{'descr': '<u2', 'fortran_order': False, 'shape': (1000,), }\n"), Path::new("x"))
            .unwrap();
        assert_eq!(h, NpyHeader { descr: "<u2".into(), len: 1000, data_offset: 71 });
    }

    #[test]
    fn refuses_two_dimensions_and_bad_magic() {
        let err = parse_header(&file("{'descr': '<u2', 'fortran_order': False, 'shape': (3, 4), }"), Path::new("x"))
            .unwrap_err();
        assert_eq!(err.to_string(), "`x`: malformed npy: shape (3, 4) is not one-dimensional");
        let err = parse_header(b"PK\x03\x04 not numpy", Path::new("y")).unwrap_err();
        assert_eq!(err.to_string(), "`y`: malformed npy: missing the `\\x93NUMPY` magic");
    }
}
