//! CRC32 checks of the stored bytes that zip records vouch for.
//!
//! Every storage of a torch file is a zip record, and its central directory entry carries the
//! CRC32 of the record's bytes; a DCP rank file is a run of such archives, one per item. So
//! every tensor byte of a torch, DeepSpeed, accelerate or DCP checkpoint is covered by a CRC
//! the writer computed. A catalog keeps, per source file, the records its tensors read
//! ([`Checks`]), and the bytes of a record are checked once, the first time any read touches
//! them: a flipped bit is refused by file, tensor and rank before it reaches an output or a
//! resumed model.
//!
//! The check reads the whole record even when only a slice of it is wanted (a rank's rows of a
//! tensor), because a CRC covers all of it. Operations that copy many records hash them as the
//! copies pass the bytes (the `crc_pass` module), and check the others beside the copies, in
//! parallel pieces whose CRCs are combined ([`verify_extents`]); a record checked
//! once in a catalog's lifetime is not checked again. The bytes are hashed where the file's
//! memory map has them (no copy) and each piece's pages are dropped after, so a check holds a
//! piece per thread.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

use crate::error::{short_source, Error, Result};
use crate::write::sys::MappedFile;

/// A record's bytes are checked in pieces of this size (bounded memory, parallel work).
const PIECE: u64 = 2 << 20;

/// A stretch of a source file covered by a CRC32.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    /// Absolute offset of its bytes in the file.
    pub offset: u64,
    pub len: u64,
    pub crc: u32,
    /// The record's name in its archive (`archive/data/0`).
    pub name: String,
    /// The offset of the archive in the file, when it is a DCP item.
    pub item: Option<u64>,
    /// The first tensor that reads it.
    pub tensor: String,
}

/// The checked records of one source file, sorted by offset, shared by the clones of a
/// catalog so that each record is checked at most once.
#[derive(Clone, Debug, Default)]
pub(crate) struct Checks(Option<Arc<Set>>);

#[derive(Debug)]
struct Set {
    records: Vec<Record>,
    /// The largest end of `records[..=i]`: lets a lookup stop early even when (hostile)
    /// records overlap.
    reach: Vec<u64>,
    good: Vec<AtomicBool>,
}

impl Checks {
    /// The records of a file; empty ones carry nothing to check, exact duplicates are one.
    pub(crate) fn new(mut records: Vec<Record>) -> Checks {
        records.retain(|r| r.len > 0);
        if records.is_empty() {
            return Checks(None);
        }
        records.sort_by_key(|r| (r.offset, r.len, r.crc));
        records.dedup_by(|b, a| (a.offset, a.len, a.crc) == (b.offset, b.len, b.crc));
        let mut reach = Vec::with_capacity(records.len());
        let mut max = 0u64;
        for r in &records {
            max = max.max(r.offset.saturating_add(r.len));
            reach.push(max);
        }
        let good = records.iter().map(|_| AtomicBool::new(false)).collect();
        Checks(Some(Arc::new(Set { records, reach, good })))
    }

    /// How many records there are.
    pub(crate) fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |s| s.records.len())
    }

    /// Indices of the records not yet checked that `[off, off + len)` touches.
    pub(crate) fn pending(&self, off: u64, len: u64, out: &mut Vec<usize>) {
        let Some(set) = &self.0 else { return };
        let end = off.saturating_add(len);
        let mut i = set.records.partition_point(|r| r.offset < end);
        while i > 0 {
            i -= 1;
            if set.reach[i] <= off {
                break;
            }
            let r = &set.records[i];
            if r.offset.saturating_add(r.len) > off && !set.good[i].load(Ordering::Relaxed) {
                out.push(i);
            }
        }
    }

    pub(crate) fn record(&self, i: usize) -> Option<&Record> {
        self.0.as_ref().and_then(|s| s.records.get(i))
    }

    pub(crate) fn mark_good(&self, i: usize) {
        if let Some(g) = self.0.as_ref().and_then(|s| s.good.get(i)) {
            g.store(true, Ordering::Relaxed);
        }
    }
}

/// One source file as the checks see it.
pub(crate) struct Source<'a> {
    pub map: &'a MappedFile,
    pub path: &'a Path,
    pub rank: Option<u64>,
    pub checks: &'a Checks,
}

impl Source<'_> {
    pub(crate) fn mismatch(&self, r: &Record, actual: u32) -> Error {
        Error::BadChecksum {
            path: self.path.to_path_buf(),
            tensor: Some(r.tensor.clone()),
            rank: self.rank,
            record: r.name.clone(),
            item: r.item,
            stored: r.crc,
            actual,
        }
    }
}

/// CRC32 of `len` bytes at `off` of the mapped file, in pieces whose pages are dropped once
/// hashed.
pub(crate) fn crc_of(map: &MappedFile, path: &Path, off: u64, len: u64) -> Result<crc32fast::Hasher> {
    let mut h = crc32fast::Hasher::new();
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(PIECE);
        let at = off + done;
        h.update(map.get(at, n).ok_or_else(|| short_source(path, at))?);
        map.release(at, n);
        done += n;
    }
    Ok(h)
}

/// Checks, one after the other, the records of `src` that `[off, off + len)` touches and that
/// were not checked yet: what a single read does before it hands out bytes.
pub(crate) fn check(src: &Source<'_>, off: u64, len: u64) -> Result<()> {
    let mut todo = Vec::new();
    src.checks.pending(off, len, &mut todo);
    for i in todo {
        let Some(r) = src.checks.record(i) else { continue };
        let actual = crc_of(src.map, src.path, r.offset, r.len)?.finalize();
        if actual != r.crc {
            return Err(src.mismatch(r, actual));
        }
        src.checks.mark_good(i);
    }
    Ok(())
}

/// Checks every record the `(source, offset, len)` extents touch, in parallel pieces, and
/// returns every mismatch (an I/O error ends the check). What an operation that copies many
/// records does first.
pub(crate) fn verify_extents(
    sources: &[Option<Source<'_>>],
    extents: impl IntoIterator<Item = (usize, u64, u64)>,
) -> Result<Vec<Error>> {
    let mut todo: Vec<(usize, usize)> = Vec::new();
    let mut scratch = Vec::new();
    for (s, off, len) in extents {
        let Some(Some(src)) = sources.get(s) else { continue };
        scratch.clear();
        src.checks.pending(off, len, &mut scratch);
        todo.extend(scratch.iter().map(|&i| (s, i)));
    }
    todo.sort_unstable();
    todo.dedup();
    let work: Vec<(&Source<'_>, usize, &Record)> = todo
        .iter()
        .filter_map(|&(s, i)| {
            let src = sources.get(s)?.as_ref()?;
            Some((src, i, src.checks.record(i)?))
        })
        .collect();
    // Every record in pieces, `(work index, offset, len)`; their CRCs are combined in order.
    let pieces: Vec<(usize, u64, u64)> = work
        .iter()
        .enumerate()
        .flat_map(|(w, (_, _, r))| {
            (0..r.len.div_ceil(PIECE)).map(move |k| (w, r.offset + k * PIECE, (r.len - k * PIECE).min(PIECE)))
        })
        .collect();
    let crcs = pieces
        .par_iter()
        .map(|&(w, off, len)| crc_of(work[w].0.map, work[w].0.path, off, len))
        .collect::<Result<Vec<_>>>()?;
    let mut combined: Vec<crc32fast::Hasher> = work.iter().map(|_| crc32fast::Hasher::new()).collect();
    for (&(w, _, _), h) in pieces.iter().zip(&crcs) {
        combined[w].combine(h);
    }
    let mut bad = Vec::new();
    for ((src, i, r), h) in work.into_iter().zip(combined) {
        let actual = h.finalize();
        if actual == r.crc {
            src.checks.mark_good(i);
        } else {
            bad.push(src.mismatch(r, actual));
        }
    }
    Ok(bad)
}

/// Every record of every source: what `verify` checks.
pub(crate) fn all_extents(sources: &[Option<Source<'_>>]) -> Vec<(usize, u64, u64)> {
    sources
        .iter()
        .enumerate()
        .flat_map(|(s, src)| {
            src.iter().flat_map(move |src| {
                src.checks.0.iter().flat_map(move |set| set.records.iter().map(move |r| (s, r.offset, r.len)))
            })
        })
        .collect()
}
