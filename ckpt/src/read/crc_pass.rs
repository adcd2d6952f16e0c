//! CRC32 checks of the records an operation copies, hashed as the copies pass the bytes.
//!
//! A check on its own reads every byte of a record from memory once more than the copy does,
//! which on a machine whose memory bandwidth is the limit costs nearly as much as the copy
//! (bench/RESULTS-crc.md). So a range copy whose source bytes belong to records not yet checked
//! does not use `copy_file_range`: it reads the source into a small buffer (`pread`), hashes the
//! buffer while it sits in the cache, and writes it from there, so the bytes are read from memory
//! once for both. A buffer and not the memory map: faulting the map in and releasing it chunk by
//! chunk costs more system time than the copy itself. Each copy keeps the CRC of every stretch of
//! a record it passed; once all copies are done, [`PassCheck::finish`] joins each record's
//! stretches in order (CRC32s combine), hashes from the map the bytes no copy passed (the part of
//! a record outside the tensor, or what a gather reads), and compares. A damaged record is
//! refused with the error the up-front check gives, before anything is committed.
//!
//! Records no copy touches (those only gathers read) are checked beside the copies as before,
//! in parallel pieces (`Sources::check_extents`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

use rayon::prelude::*;

use crate::error::{Error, IoContext, Result};
use crate::read::checksum::{crc_of, Source};
use crate::read::io::Sources;
use crate::write::RangeCopy;

/// A copy reads, hashes and writes this many bytes at a time: small enough that the bytes it
/// hashed are still in the cache when it writes them.
const CHUNK: usize = 256 << 10;

thread_local! {
    /// Each copying thread's chunk buffer, allocated once: an allocation this size per copy
    /// would be a fresh mapping (and its page faults) each time.
    static BUFFER: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; CHUNK]);
}

/// The records an operation's range copies read, each hashed as the copies pass it.
pub(crate) struct PassCheck<'s> {
    /// The files the copies read.
    srcs: &'s Sources<'s>,
    /// Each file as the checks see it (none: nothing to check in it).
    sources: Vec<Option<Source<'s>>>,
    /// Per file, the sorted indices of the records the copies touch and that were not checked.
    passed: Vec<Vec<usize>>,
    /// What the copies hashed: `(file, record, stretch)`.
    stretches: Mutex<Vec<(usize, usize, Stretch)>>,
}

/// A run of a record's bytes that one copy passed, and their CRC.
struct Stretch {
    offset: u64,
    len: u64,
    crc: crc32fast::Hasher,
}

impl<'s> PassCheck<'s> {
    /// The unchecked records that the `(file, offset, len)` extents of the range copies touch.
    /// Extents of bytes held in memory are not in a file and have no records.
    pub(crate) fn new(srcs: &'s Sources<'s>, copies: &[(usize, u64, u64)]) -> Result<PassCheck<'s>> {
        let sources = srcs.checked()?;
        let mut passed: Vec<Vec<usize>> = sources.iter().map(|_| Vec::new()).collect();
        for &(s, off, len) in copies {
            if let (Some(Some(src)), Some(out)) = (sources.get(s), passed.get_mut(s)) {
                if !srcs.in_memory(s, off) {
                    src.checks.pending(off, len, out);
                }
            }
        }
        for p in &mut passed {
            p.sort_unstable();
            p.dedup();
        }
        Ok(PassCheck { srcs, sources, passed, stretches: Mutex::new(Vec::new()) })
    }

    /// The extents of the records `extents` touch that no copy passes: what is left for the
    /// check beside the copies.
    pub(crate) fn rest(&self, extents: impl IntoIterator<Item = (usize, u64, u64)>) -> Vec<(usize, u64, u64)> {
        let mut todo = Vec::new();
        let mut scratch = Vec::new();
        for (s, off, len) in extents {
            let Some(Some(src)) = self.sources.get(s) else { continue };
            scratch.clear();
            src.checks.pending(off, len, &mut scratch);
            for &i in &scratch {
                if self.passed.get(s).is_some_and(|p| p.binary_search(&i).is_err()) {
                    if let Some(r) = src.checks.record(i) {
                        todo.push((s, r.offset, r.len));
                    }
                }
            }
        }
        todo.sort_unstable();
        todo.dedup();
        todo
    }

    /// Copies `c` into `dst` through a buffer, hashing the records it passes, when its source
    /// bytes hold any; false (nothing done) otherwise, for the caller's own copy.
    pub(crate) fn copy(
        &self,
        dst: &File,
        dst_path: &Path,
        c: &RangeCopy,
        progress: Option<&(dyn Fn(u64) + Sync)>,
    ) -> Result<bool> {
        let (Some(Some(src)), Some(passed)) = (self.sources.get(c.src), self.passed.get(c.src)) else {
            return Ok(false);
        };
        let mut touched = Vec::new();
        src.checks.pending(c.src_off, c.len, &mut touched);
        // Bytes past the file's end (held in memory, or a short file) are the caller's to copy
        // or to refuse, as without the checks.
        if !touched.iter().any(|i| passed.binary_search(i).is_ok()) || src.map.get(c.src_off, c.len).is_none() {
            return Ok(false);
        }
        let open = BUFFER.with(|buffer| -> Result<Vec<(usize, Stretch)>> {
            let mut buffer = buffer.borrow_mut();
            let mut open: Vec<(usize, Stretch)> = Vec::new();
            let mut done = 0u64;
            while done < c.len {
                let at = c.src_off + done;
                let n = (c.len - done).min(CHUNK as u64);
                let bytes = &mut buffer[..n as usize];
                self.srcs.read_unchecked(c.src, at, bytes)?;
                touched.clear();
                src.checks.pending(at, n, &mut touched);
                for &i in touched.iter().filter(|i| passed.binary_search(i).is_ok()) {
                    let Some(r) = src.checks.record(i) else { continue };
                    let lo = r.offset.max(at);
                    let hi = r.offset.saturating_add(r.len).min(at + n);
                    if let Some(part) = bytes.get((lo - at) as usize..(hi - at) as usize) {
                        hash_into(&mut open, i, lo, part);
                    }
                }
                dst.write_all_at(bytes, c.dst_off + done).at(dst_path)?;
                done += n;
                if let Some(p) = progress {
                    p(n);
                }
            }
            Ok(open)
        })?;
        let mut all = self.stretches.lock().unwrap_or_else(|e| e.into_inner());
        all.extend(open.into_iter().map(|(i, s)| (c.src, i, s)));
        Ok(true)
    }

    /// Once every copy is done: each passed record's CRC from its stretches and, for the bytes
    /// no copy passed, from the map; the first record whose CRC is not the archive's is the error.
    pub(crate) fn finish(self) -> Result<()> {
        let mut stretches = self.stretches.into_inner().unwrap_or_else(|e| e.into_inner());
        stretches.sort_unstable_by_key(|(s, i, st)| (*s, *i, st.offset));
        let work: Vec<(usize, usize)> =
            self.passed.iter().enumerate().flat_map(|(s, p)| p.iter().map(move |&i| (s, i))).collect();
        let sources = &self.sources;
        let stretches = &stretches;
        let bad = work
            .par_iter()
            .map(|&(s, i)| {
                let Some(Some(src)) = sources.get(s) else { return Ok(None) };
                let Some(r) = src.checks.record(i) else { return Ok(None) };
                let from = stretches.partition_point(|(fs, fi, _)| (*fs, *fi) < (s, i));
                let to = stretches.partition_point(|(fs, fi, _)| (*fs, *fi) <= (s, i));
                let actual = record_crc(src, r.offset, r.len, stretches[from..to].iter().map(|(_, _, st)| st))?;
                if actual == r.crc {
                    src.checks.mark_good(i);
                    Ok(None)
                } else {
                    Ok(Some(src.mismatch(r, actual)))
                }
            })
            .collect::<Result<Vec<Option<Error>>>>()?;
        match bad.into_iter().flatten().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Adds `bytes` (at `offset` of the file) to record `i`'s open stretch when they extend it, or
/// opens a new one.
fn hash_into(open: &mut Vec<(usize, Stretch)>, i: usize, offset: u64, bytes: &[u8]) {
    let len = bytes.len() as u64;
    match open.iter_mut().rev().find(|(j, s)| *j == i && s.offset + s.len == offset) {
        Some((_, s)) => {
            s.crc.update(bytes);
            s.len += len;
        }
        None => {
            let mut crc = crc32fast::Hasher::new();
            crc.update(bytes);
            open.push((i, Stretch { offset, len, crc }));
        }
    }
}

/// The CRC32 of the `len` bytes at `offset`: the stretches (sorted by offset) where they start
/// at the bytes not yet counted, the map for the rest. A stretch that starts inside what was
/// counted (two copies of the same bytes) is not needed.
fn record_crc<'a>(
    src: &Source<'_>,
    offset: u64,
    len: u64,
    stretches: impl Iterator<Item = &'a Stretch>,
) -> Result<u32> {
    let end = offset.saturating_add(len);
    let mut crc = crc32fast::Hasher::new();
    let mut at = offset;
    for s in stretches {
        if s.offset < at || s.offset + s.len > end {
            continue;
        }
        if s.offset > at {
            crc.combine(&crc_of(src.map, src.path, at, s.offset - at)?);
        }
        crc.combine(&s.crc);
        at = s.offset + s.len;
    }
    if at < end {
        crc.combine(&crc_of(src.map, src.path, at, end - at)?);
    }
    Ok(crc.finalize())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn stretch(data: &[u8], offset: u64, len: u64) -> Stretch {
        let mut crc = crc32fast::Hasher::new();
        crc.update(&data[offset as usize..(offset + len) as usize]);
        Stretch { offset, len, crc }
    }

    #[test]
    fn stretches_extend_only_when_contiguous() {
        let data: Vec<u8> = (0..100u8).collect();
        let mut open = Vec::new();
        hash_into(&mut open, 3, 10, &data[10..20]);
        hash_into(&mut open, 3, 20, &data[20..30]);
        hash_into(&mut open, 3, 40, &data[40..50]);
        hash_into(&mut open, 4, 50, &data[50..60]);
        let spans: Vec<(usize, u64, u64)> = open.iter().map(|(i, s)| (*i, s.offset, s.len)).collect();
        assert_eq!(spans, vec![(3, 10, 20), (3, 40, 10), (4, 50, 10)]);
        assert_eq!(open[0].1.crc.clone().finalize(), crc32fast::hash(&data[10..30]));
    }

    #[test]
    fn stretches_and_gaps_give_the_record_crc() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("src.bin");
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let file = File::open(&path).unwrap();
        let map = crate::write::sys::MappedFile::open(&file).unwrap();
        let checks = crate::read::checksum::Checks::default();
        let src = Source { map: &map, path: &path, rank: None, checks: &checks };
        let want = crc32fast::hash(&data[100..4100]);
        // Gaps at both ends and between, a duplicate and an overlapping stretch to skip.
        let parts =
            [stretch(&data, 300, 700), stretch(&data, 300, 700), stretch(&data, 900, 500), stretch(&data, 2000, 1000)];
        assert_eq!(record_crc(&src, 100, 4000, parts.iter()).unwrap(), want);
        assert_eq!(record_crc(&src, 100, 4000, std::iter::empty()).unwrap(), want);
        let whole = [stretch(&data, 100, 4000)];
        assert_eq!(record_crc(&src, 100, 4000, whole.iter()).unwrap(), want);
    }

    /// Copies the first stored tensor of torch's `basic.pt` (damaged by `flip` first) through a
    /// pass check, then finishes it.
    fn copy_first_tensor(flip: bool) -> (Result<()>, Vec<u8>, Vec<u8>, bool) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("basic.pt");
        let fixture = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/torch/basic.pt");
        let mut bytes = std::fs::read(fixture).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        let ck = crate::Checkpoint::open(path.to_str().unwrap()).unwrap();
        let b = ck.tensors().iter().find_map(|t| t.boxes().iter().find(|b| b.len > 0).cloned()).unwrap();
        if flip {
            bytes[(b.base + b.len / 2) as usize] ^= 0x40;
            std::fs::write(&path, &bytes).unwrap();
        }
        let srcs = Sources::of(ck.files()).unwrap();
        let extent = (b.file, b.base, b.len);
        let pass = PassCheck::new(&srcs, &[extent]).unwrap();
        assert!(pass.rest([extent]).is_empty(), "the copy passes the whole record");
        let out_path = dir.path().join("out");
        let out = File::create(&out_path).unwrap();
        let c = RangeCopy { src: b.file, src_off: b.base, dst_off: 0, len: b.len };
        let passed = pass.copy(&out, &out_path, &c, None).unwrap();
        let want = bytes[b.base as usize..(b.base + b.len) as usize].to_vec();
        (pass.finish(), std::fs::read(&out_path).unwrap(), want, passed)
    }

    #[test]
    fn a_copy_passes_the_record_and_writes_its_bytes() {
        let (checked, written, want, passed) = copy_first_tensor(false);
        assert!(passed);
        checked.unwrap();
        assert_eq!(written, want);
    }

    #[test]
    fn a_damaged_record_is_refused_once_its_copy_is_done() {
        let (checked, written, want, passed) = copy_first_tensor(true);
        assert!(passed);
        assert_eq!(written, want, "the copy writes what it read");
        let err = checked.unwrap_err();
        assert!(matches!(err, Error::BadChecksum { .. }), "{err}");
        assert!(err.to_string().contains("fails its CRC32 check"), "{err}");
    }
}
