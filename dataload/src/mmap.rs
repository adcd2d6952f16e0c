//! Read-only memory maps of data files: the crate's only `unsafe`.
//!
//! A map is shared by every reader of a file (it is reference-counted through
//! [`bytes::Bytes`], which Arrow buffers and Parquet's chunk reader take without a copy), so
//! opening a dataset costs page-table entries, not reads.
//!
//! The one hazard of a file map is another process truncating or rewriting the file while it
//! is mapped: reads past the new end fault and rewritten bytes show through. Data sets are
//! written once and then read, and every source records the size it mapped in its
//! fingerprint, so a file changed *between* runs is refused; a file changed *during* a run is
//! outside what any reader (memory-mapped or not) can make safe.
#![allow(unsafe_code)]

use std::fs::File;
use std::path::Path;

use bytes::Bytes;
use memmap2::Mmap;

use crate::error::{DataloadError, Result};

/// The bytes of a whole file, memory-mapped (empty files are not mapped: a zero-length map is
/// an error on some systems).
pub(crate) fn map_file(path: &Path) -> Result<Bytes> {
    let file = File::open(path).map_err(|e| DataloadError::io(path, e))?;
    let len = file.metadata().map_err(|e| DataloadError::io(path, e))?.len();
    if len == 0 {
        return Ok(Bytes::new());
    }
    // SAFETY: the map is read-only and private to this process; nothing in this crate writes
    // to a mapped file. See the module docs for files changed by other processes while
    // mapped, the one case no reader can guard against.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| DataloadError::io(path, e))?;
    Ok(Bytes::from_owner(map))
}
