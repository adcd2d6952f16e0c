//! Read-only memory maps of data files: the crate's only `unsafe`.
//!
//! A map is shared by every reader of a file (it is reference-counted through
//! [`bytes::Bytes`], which Arrow buffers and Parquet's chunk reader take without a copy), so
//! opening a dataset costs page-table entries, not reads.
//!
//! The one hazard of a file map is another process truncating or rewriting the file while it
//! is mapped: reads past the new end fault (`SIGBUS`, which kills the process) and rewritten
//! bytes show through. Data sets are written once and then read, and every source records the
//! size it mapped in its fingerprint, so a file changed *between* runs is refused. For a file
//! changed *during* a run, every source checks, before each read of a mapped file, that the
//! file still has the size it was mapped with ([`FileGuard::check`]), and refuses to read it
//! otherwise ([`DataloadError::FileChanged`]). That check narrows the window but cannot close
//! it: a file truncated between the check and the read still faults. Token files, the one
//! source read a window at a time, are read with `pread` instead (see [`crate::tokens`]), where
//! a shrunk file is a short read, never a fault. A writer that rewrites bytes in place without
//! changing the size shows through in every case.
//!
//! Only regular files are mapped ([`crate::fs::open_regular`]).
#![allow(unsafe_code)]

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use memmap2::Mmap;

use crate::error::{DataloadError, Result};

/// The open file behind a map, to check it has not shrunk before the map is read.
#[derive(Debug, Clone)]
pub(crate) struct FileGuard {
    file: Arc<File>,
    len: u64,
}

impl FileGuard {
    /// Refuses to go on when `path` (this file) is now shorter than when it was mapped: a read
    /// of the map past its new end would kill the process (see the module docs).
    pub(crate) fn check(&self, path: &Path) -> Result<()> {
        let now = self.file.metadata().map_err(|e| DataloadError::io(path, e))?.len();
        if now < self.len {
            return Err(DataloadError::FileChanged { path: path.to_owned() });
        }
        Ok(())
    }
}

/// The bytes of a whole file, memory-mapped (empty files are not mapped: a zero-length map is
/// an error on some systems), and the guard that checks it is still whole. Only a regular
/// file is opened.
pub(crate) fn map_file(path: &Path) -> Result<(Bytes, FileGuard)> {
    let file = crate::fs::open_regular(path)?;
    let len = file.metadata().map_err(|e| DataloadError::io(path, e))?.len();
    if len == 0 {
        return Ok((Bytes::new(), FileGuard { file: Arc::new(file), len }));
    }
    // SAFETY: the map is read-only and private to this process; nothing in this crate writes
    // to a mapped file. Files that other processes shrink while mapped are checked for before
    // each read (see the module docs and `FileGuard::check`).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| DataloadError::io(path, e))?;
    Ok((Bytes::from_owner(map), FileGuard { file: Arc::new(file), len }))
}
