//! The byte-source seam: every read of checkpoint bytes goes through here.
//!
//! Readers see bytes through [`ReadAt`] (a file, an in-memory buffer, or an item inside a larger
//! file), with whole small files (indexes, `latest`, `.metadata`) read by [`read_capped`] under a
//! size limit checked before the read. Operations read tensor bytes through [`Sources`]: the
//! open source files of a plan, each memory-mapped on first use so a window can be borrowed
//! without a copy and its pages dropped once written. The `unsafe` behind the map lives in
//! `sys.rs`.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{short_source, Error, IoContext, Result};
use crate::write::sys::MappedFile;

/// Positional reads of exactly `buf.len()` bytes.
pub(crate) trait ReadAt {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()>;
}

impl ReadAt for File {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        FileExt::read_exact_at(self, buf, off)
    }
}

impl ReadAt for [u8] {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        let start = usize::try_from(off).map_err(|_| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        let src = start
            .checked_add(buf.len())
            .and_then(|end| self.get(start..end))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

/// The bytes of `file` from `base` on, seen as a source of their own (a DCP item: a zip
/// archive whose offsets count from its own start).
pub(crate) struct Window<'a> {
    pub file: &'a File,
    pub base: u64,
}

impl ReadAt for Window<'_> {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        let at = self.base.checked_add(off).ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        FileExt::read_exact_at(self.file, buf, at)
    }
}

/// Maps the whole of `file` (named `path` in errors) read-only.
pub(crate) fn map(file: &File, path: &Path) -> Result<MappedFile> {
    MappedFile::open(file).at(path)
}

/// True when `name` names a file directly inside a folder on every OS: no separators, no
/// drive letter, no `..`, not empty. huggingface_hub applies the same rule (parsing the value as
/// a Windows path on every OS) before it opens a shard.
pub(crate) fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && !(name.len() >= 2 && name.as_bytes()[1] == b':')
}

/// The regular files directly inside `dir`, sorted.
pub(crate) fn regular_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).at(dir)? {
        let entry = entry.at(dir)?;
        if entry.file_type().at(entry.path())?.is_file() {
            out.push(entry.path());
        }
    }
    out.sort();
    Ok(out)
}

/// Every regular file under `dir`, recursively, sorted.
pub(crate) fn files_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).at(&d)? {
            let entry = entry.at(&d)?;
            let kind = entry.file_type().at(entry.path())?;
            if kind.is_dir() {
                todo.push(entry.path());
            } else if kind.is_file() {
                out.push(entry.path());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Opens `path` for reading, refusing anything but a regular file (after links) before it is
/// opened: opening a FIFO or a device planted in place of a shard would block forever or read
/// without end (the checks are `durable`'s, shared with the data loader).
pub(crate) fn open(path: &Path) -> Result<File> {
    // A catalog keeps its files open while a plan runs: a checkpoint of thousands of files (a
    // 405B model with its optimizer is 1,458) would pass the common soft limit of 1,024 open
    // files, which the hard limit usually allows raising (done once per process).
    crate::write::sys::raise_open_file_limit();
    durable::open_regular(path).map_err(fs_error)
}

/// A `durable` error as this crate's, at the edge: the variants and words `ckpt` has always
/// used (a directory is "a folder" here; a whole file over its cap is a record too large).
pub(crate) fn fs_error(e: durable::Error) -> Error {
    match e {
        durable::Error::Io { path, source } => Error::Io { path, source },
        durable::Error::NotARegularFile { path, kind } => {
            let kind = match kind {
                durable::FileKind::Directory => "a folder",
                other => other.noun(),
            };
            Error::NotARegularFile { path, kind }
        }
        durable::Error::TooLarge { path, size, limit } => too_large(&path, size, limit),
        durable::Error::Locked { dest, lock, pid } => Error::DestinationLocked { dst: dest, lock, pid },
        other => Error::Io { path: other.path().to_path_buf(), source: std::io::Error::other(other.to_string()) },
    }
}

/// Reads `len` bytes at `off` of `file` (named `path` in errors).
pub(crate) fn read_at(file: &(impl ReadAt + ?Sized), path: &Path, off: u64, len: u64) -> Result<Vec<u8>> {
    let n = usize::try_from(len).map_err(|_| too_large(path, len, u64::MAX))?;
    let mut buf = vec![0u8; n];
    file.read_exact_at(&mut buf, off).at(path)?;
    Ok(buf)
}

/// Reads a whole small file (an index, `latest`, `.metadata`, a manifest), refusing one larger
/// than `max` bytes before reading it (and one that grows past it while read).
pub(crate) fn read_capped(path: &Path, max: u64) -> Result<Vec<u8>> {
    crate::write::sys::raise_open_file_limit();
    durable::read_capped(path, max).map_err(fs_error)
}

fn too_large(path: &Path, size: u64, limit: u64) -> Error {
    Error::RecordTooLarge { path: path.to_path_buf(), record: "the whole file".into(), size, limit }
}

/// Bytes a source holds in memory instead of in its file.
enum Held<'m> {
    /// Decoded from the file (a torch file's numpy arrays), shared with the catalog.
    Shared(std::sync::Arc<[u8]>),
    /// Borrowed from the caller for the length of the operation (tensors saved from memory).
    Borrowed(&'m [u8]),
}

impl Held<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Held::Shared(b) => b,
            Held::Borrowed(b) => b,
        }
    }
}

impl std::fmt::Debug for Held<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes in memory", self.bytes().len())
    }
}

/// The sources of an operation: open files, each mapped on first use, or the caller's memory.
///
/// Source `i` is read by offset whatever it is: a file from its start, then the bytes decoded
/// from it past its recorded length ([`crate::SourceFile`]); a buffer of the caller's
/// ([`Sources::memory`]) from offset 0, with no file behind it. Bytes in memory are borrowed
/// where they are, never copied first, so an operation over them holds no more than over files.
#[derive(Debug)]
pub(crate) struct Sources<'m> {
    /// Each source's name in errors, and its open file (none for the caller's memory).
    files: Vec<(PathBuf, Option<File>)>,
    maps: Vec<OnceLock<std::result::Result<MappedFile, String>>>,
    /// Bytes held in memory and the offset they are addressed from.
    tails: Vec<Option<(u64, Held<'m>)>>,
    /// The CRC-covered records of each file, and the rank that wrote it (for the message).
    checks: Vec<(crate::read::checksum::Checks, Option<u64>)>,
}

impl Sources<'static> {
    /// The files at `paths`, with nothing decoded from them.
    pub(crate) fn open<'p>(paths: impl IntoIterator<Item = &'p Path>) -> Result<Sources<'static>> {
        let files = paths.into_iter().map(|p| Ok((p.to_path_buf(), Some(open(p)?)))).collect::<Result<Vec<_>>>()?;
        let maps = files.iter().map(|_| OnceLock::new()).collect();
        let tails = files.iter().map(|_| None).collect();
        let checks = files.iter().map(|_| Default::default()).collect();
        Ok(Sources { files, maps, tails, checks })
    }

    /// The source files of a catalog, with the bytes decoded from them and the records whose
    /// CRCs every read checks.
    pub(crate) fn of(files: &[crate::SourceFile]) -> Result<Sources<'static>> {
        let mut s = Sources::open(files.iter().map(|f| f.path.as_path()))?;
        s.tails = files.iter().map(|f| f.inline.0.clone().map(|b| (f.len, Held::Shared(b)))).collect();
        s.checks = files.iter().map(|f| (f.checks.clone(), f.rank)).collect();
        Ok(s)
    }
}

impl<'m> Sources<'m> {
    /// The caller's buffers as sources, borrowed for the operation: source `i` is the bytes of
    /// the `i`th, from offset 0, named by its `name` in errors.
    pub(crate) fn memory(buffers: impl IntoIterator<Item = (PathBuf, &'m [u8])>) -> Sources<'m> {
        let (files, tails): (Vec<_>, Vec<_>) =
            buffers.into_iter().map(|(name, bytes)| ((name, None), Some((0, Held::Borrowed(bytes))))).unzip();
        let maps = files.iter().map(|_| OnceLock::new()).collect();
        let checks = files.iter().map(|_| Default::default()).collect();
        Sources { files, maps, tails, checks }
    }

    /// File `i` as the CRC checks see it, when it has records to check.
    fn checked_source(&self, i: usize) -> Result<Option<crate::read::checksum::Source<'_>>> {
        // The baseline bench/crc_cost.py measures the checks against: no file has records to check.
        // A `cfg` that only bench/all.sh sets (in RUSTFLAGS, with a target folder of its own), not a
        // feature: `--all-features` must never build a `ckpt` that skips its checks.
        if cfg!(statekit_bench_unchecked) {
            return Ok(None);
        }
        match (self.files.get(i), self.checks.get(i)) {
            (Some((path, _)), Some((checks, rank))) if checks.len() > 0 => {
                Ok(Some(crate::read::checksum::Source { map: self.map(i)?, path, rank: *rank, checks }))
            }
            _ => Ok(None),
        }
    }

    pub(crate) fn checked(&self) -> Result<Vec<Option<crate::read::checksum::Source<'_>>>> {
        (0..self.files.len()).map(|i| self.checked_source(i)).collect()
    }

    /// Checks the CRCs of the records `[off, off + len)` of file `i` touches, once each.
    fn check(&self, i: usize, off: u64, len: u64) -> Result<()> {
        match self.checked_source(i)? {
            Some(src) => crate::read::checksum::check(&src, off, len),
            None => Ok(()),
        }
    }

    /// Checks, in parallel, every record the `(file, offset, len)` extents touch: what an
    /// operation does before it copies them. The first mismatch is the error.
    pub(crate) fn check_extents(&self, extents: impl IntoIterator<Item = (usize, u64, u64)>) -> Result<()> {
        if self.checks.iter().all(|(c, _)| c.len() == 0) {
            return Ok(());
        }
        match crate::read::checksum::verify_extents(&self.checked()?, extents)?.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Checks every record of every file, returning each mismatch: what `verify` reports.
    pub(crate) fn check_all(&self) -> Result<Vec<Error>> {
        let sources = self.checked()?;
        let extents = crate::read::checksum::all_extents(&sources);
        crate::read::checksum::verify_extents(&sources, extents)
    }

    /// True when `[off, off + len)` of source `i` is held in memory, not in the file.
    pub(crate) fn in_memory(&self, i: usize, off: u64) -> bool {
        matches!(self.tails.get(i), Some(Some((start, _))) if off >= *start)
    }

    /// The open file `i` and its path (an error for a buffer in memory, which has no file).
    pub(crate) fn file(&self, i: usize) -> Result<(&File, &Path)> {
        match self.files.get(i) {
            Some((p, Some(f))) => Ok((f, p.as_path())),
            Some((p, None)) => Err(Error::Io {
                path: p.clone(),
                source: std::io::Error::new(std::io::ErrorKind::Unsupported, "held in memory, not in a file"),
            }),
            None => Err(unknown(i)),
        }
    }

    /// The name of source `i` in errors.
    fn name(&self, i: usize) -> Result<&Path> {
        self.files.get(i).map(|(p, _)| p.as_path()).ok_or_else(|| unknown(i))
    }

    fn map(&self, i: usize) -> Result<&MappedFile> {
        let (file, path) = self.file(i)?;
        let m = self.maps.get(i).ok_or_else(|| unknown(i))?;
        m.get_or_init(|| MappedFile::open(file).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| Error::Io { path: path.to_path_buf(), source: std::io::Error::other(e.clone()) })
    }

    /// The bytes `[off, off + len)` of file `i`, borrowed from its map.
    pub(crate) fn read(&self, i: usize, off: u64, len: u64) -> Result<&[u8]> {
        let path = self.name(i)?;
        if let Some(Some((start, tail))) = self.tails.get(i).filter(|_| self.in_memory(i, off)) {
            let lo = usize::try_from(off - start).unwrap_or(usize::MAX);
            let hi = usize::try_from(len).ok().and_then(|n| lo.checked_add(n));
            return hi.and_then(|hi| tail.bytes().get(lo..hi)).ok_or_else(|| short_source(path, off));
        }
        self.check(i, off, len)?;
        self.map(i)?.get(off, len).ok_or_else(|| short_source(path, off))
    }

    /// Reads `buf.len()` bytes of file `i` at `off` with `pread`, bypassing the map (no pages
    /// of ours stay resident afterwards).
    pub(crate) fn read_into(&self, i: usize, off: u64, buf: &mut [u8]) -> Result<()> {
        if self.in_memory(i, off) {
            let bytes = self.read(i, off, buf.len() as u64)?;
            buf.copy_from_slice(bytes);
            return Ok(());
        }
        self.check(i, off, buf.len() as u64)?;
        self.read_unchecked(i, off, buf)
    }

    /// `pread` of `buf.len()` bytes of file `i` at `off`, without checking the CRCs of the
    /// records they belong to: for a caller that hashes the bytes itself (`crc_pass.rs`).
    pub(crate) fn read_unchecked(&self, i: usize, off: u64, buf: &mut [u8]) -> Result<()> {
        let (file, path) = self.file(i)?;
        match ReadAt::read_exact_at(file, buf, off) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(short_source(path, off)),
            Err(e) => Err(Error::Io { path: path.to_path_buf(), source: e }),
        }
    }

    /// Drops the resident pages of `[off, off + len)` of file `i`, if it is mapped.
    pub(crate) fn release(&self, i: usize, off: u64, len: u64) {
        if let Some(Some(Ok(m))) = self.maps.get(i).map(OnceLock::get) {
            m.release(off, len);
        }
    }
}

fn unknown(i: usize) -> Error {
    Error::Io {
        path: PathBuf::from(format!("<source {i}>")),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such source file in the plan"),
    }
}
