//! JSON-lines files, plain (`.jsonl`) or zstd-compressed (`.jsonl.zst`), read by record.
//!
//! # On disk
//!
//! One JSON value per line, lines ending in `\n` (a `\r` before it is dropped), blank lines
//! ignored. A `.jsonl.zst` file is one or more zstd frames back to back; the text is their
//! outputs concatenated, and a line may straddle frames.
//!
//! # Random access
//!
//! A [line index](crate::line_index) gives each record's byte range in the text. It is built
//! on the first open, stored beside the file (or in a chosen directory, or only in memory:
//! [`IndexPlacement`]), and reused while the file keeps the size and modification time it was
//! built from and the index passes its checks; a stale index is rebuilt, a current one that
//! fails its checks is refused with an error naming it. A plain file is memory-mapped and a
//! record is a slice of it. In a compressed file a record is read by decompressing the frames
//! it lies in, kept in a small bounded cache of decompressed frames: zstd cannot start in the
//! middle of a frame, so the frame is the unit of access. A file written as one frame (what
//! the `zstd` tool and `zstandard.compress` do) is therefore decompressed whole on the first
//! access; write large files as frames of a few MiB to keep that bounded.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use crate::error::{DataloadError, Result};
use crate::line_index::{stamp, LineIndex};
use crate::mmap::{map_file, FileGuard};
use crate::source::{resolve_files, DataFile, FileFingerprint, Fingerprint, ShardIndex, Source, UnitCache};

/// Decompressed frames kept by default.
pub const DEFAULT_FRAME_CACHE: usize = 8;

/// Where line indexes are kept.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum IndexPlacement {
    /// `<file>.lines.idx` beside each data file (the default); in memory when that directory
    /// is not writable.
    #[default]
    Beside,
    /// In this directory, named after the file's path in the dataset.
    Dir(PathBuf),
    /// Only in memory: rebuilt at every open.
    Memory,
}

#[derive(Debug)]
struct JsonlFile {
    file: DataFile,
    bytes: Bytes,
    /// Checks the map is whole before it is read (`None`: bytes that are not a map).
    guard: Option<FileGuard>,
    index: LineIndex,
    /// Dataset-wide number of this file's first frame (the frame cache's key).
    frame_base: usize,
}

/// A batch of records: the raw JSON texts back to back, and their boundaries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextBatch {
    /// The records' bytes, concatenated.
    pub data: Vec<u8>,
    /// Record `r` is `data[offsets[r]..offsets[r + 1]]`.
    pub offsets: Vec<usize>,
}

impl TextBatch {
    /// Number of records.
    pub fn len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record `r` as text (records were checked to be JSON, hence UTF-8, when indexed).
    pub fn get(&self, r: usize) -> Option<&str> {
        let (a, b) = (*self.offsets.get(r)?, *self.offsets.get(r + 1)?);
        std::str::from_utf8(self.data.get(a..b)?).ok()
    }
}

/// Records of one or more JSON-lines files (see the module docs).
#[derive(Debug)]
pub struct JsonlDataset {
    files: Vec<JsonlFile>,
    index: ShardIndex,
    cache: UnitCache<Arc<Vec<u8>>>,
    fingerprint: Fingerprint,
    persisted: Vec<bool>,
}

impl JsonlDataset {
    /// Opens a file, a directory of `.jsonl`/`.jsonl.zst` files, or a glob.
    pub fn open(spec: impl AsRef<Path>, placement: IndexPlacement, cache_frames: usize) -> Result<Self> {
        let mut files = Vec::new();
        let mut persisted = Vec::new();
        let mut frame_base = 0usize;
        for file in resolve_files(spec.as_ref(), &[".jsonl", ".jsonl.zst", ".ndjson"])? {
            let now = stamp(&file.path)?;
            let (bytes, guard) = map_file(&file.path)?;
            if bytes.len() as u64 != now.0 {
                return Err(DataloadError::FileChanged { path: file.path.clone() });
            }
            let (index, saved) = load_or_build(&file, &bytes, now, &placement)?;
            let n_frames = index.frames.len();
            files.push(JsonlFile { file, bytes, guard: Some(guard), index, frame_base });
            persisted.push(saved);
            frame_base += n_frames;
        }
        Ok(Self::from_files(files, persisted, cache_frames))
    }

    /// The dataset of files already mapped and indexed.
    fn from_files(files: Vec<JsonlFile>, persisted: Vec<bool>, cache_frames: usize) -> Self {
        let fingerprint = Fingerprint {
            format: "jsonl",
            options: String::new(),
            files: files
                .iter()
                .map(|f| FileFingerprint {
                    name: f.file.name.clone(),
                    size: f.index.source_size,
                    rows: f.index.lines.len() as u64,
                })
                .collect(),
        };
        Self {
            index: ShardIndex::new(files.iter().map(|f| f.index.lines.len() as u64)),
            files,
            cache: UnitCache::new(cache_frames),
            fingerprint,
            persisted,
        }
    }

    /// For each file, whether its index is stored on disk (false: kept in memory only).
    pub fn index_persisted(&self) -> &[bool] {
        &self.persisted
    }

    /// The file of record `i` and its line number in that file (from 1, blank lines counted),
    /// for an error about the record that a caller found (a parser that refuses it). The index
    /// keeps byte ranges, not line numbers: this counts the newlines before the record, reading
    /// (and decompressing) the file up to it, which is what an error may cost.
    pub fn record_line(&self, i: u64) -> Result<(PathBuf, u64)> {
        let (k, l) = self.index.locate(i)?;
        let f = &self.files[k];
        let start = f.index.lines[l as usize].0;
        let newlines = |b: &[u8]| b.iter().filter(|&&c| c == b'\n').count() as u64;
        let mut count = 0u64;
        if let Some(guard) = &f.guard {
            guard.check(&f.file.path)?;
        }
        if !f.index.zstd {
            let end = usize::try_from(start).unwrap_or(usize::MAX).min(f.bytes.len());
            count = newlines(&f.bytes[..end]);
        } else {
            for (n, frame) in f.index.frames.iter().enumerate().take_while(|(_, fr)| fr.text_start < start) {
                let text = decompress_frame(f, n)?;
                let upto = usize::try_from(start - frame.text_start).unwrap_or(usize::MAX).min(text.len());
                count += newlines(&text[..upto]);
            }
        }
        Ok((f.file.path.clone(), count + 1))
    }

    /// Appends record `line` of file `k` to `out`.
    fn read_record(&self, k: usize, line: usize, out: &mut Vec<u8>) -> Result<()> {
        let f = &self.files[k];
        let (start, end) = f.index.lines[line];
        if !f.index.zstd {
            let range = usize::try_from(start).ok().zip(usize::try_from(end).ok());
            let bytes = range
                .and_then(|(a, b)| f.bytes.get(a..b))
                .ok_or_else(|| DataloadError::ShorterThanIndex { path: f.file.path.clone() })?;
            out.extend_from_slice(bytes);
            return Ok(());
        }
        let mut p = start;
        while p < end {
            let k = f.index.frames.partition_point(|fr| fr.text_start <= p).saturating_sub(1);
            let frame = f.index.frames[k];
            let text = self.cache.get_or_load(f.frame_base + k, || decompress_frame(f, k).map(Arc::new))?;
            let take = end.min(frame.text_start + text.len() as u64);
            if take <= p {
                return Err(DataloadError::CorruptFrame {
                    path: f.file.path.clone(),
                    offset: frame.offset,
                    reason: "frame is shorter than its index says".into(),
                });
            }
            out.extend_from_slice(&text[(p - frame.text_start) as usize..(take - frame.text_start) as usize]);
            p = take;
        }
        Ok(())
    }
}

fn decompress_frame(f: &JsonlFile, k: usize) -> Result<Vec<u8>> {
    use std::io::Read;
    let frame = f.index.frames[k];
    let corrupt =
        |reason: String| DataloadError::CorruptFrame { path: f.file.path.clone(), offset: frame.offset, reason };
    let range = usize::try_from(frame.offset).ok().zip(usize::try_from(frame.offset + frame.len).ok());
    let compressed = range.and_then(|(a, b)| f.bytes.get(a..b)).ok_or_else(|| corrupt("outside the file".into()))?;
    let expected = f.index.frame_text_len(k);
    // The index's numbers are only a hint for the allocation (an index may lie within its
    // rules), and the decoder stops one byte past them, so a frame bigger than its index says
    // costs no more memory than the index promised.
    let mut out = Vec::with_capacity(capacity_hint(expected));
    zstd::stream::read::Decoder::with_buffer(compressed)
        .map_err(|e| corrupt(e.to_string()))?
        .single_frame()
        .take(expected.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| corrupt(e.to_string()))?;
    if out.len() as u64 != expected {
        return Err(corrupt(format!("{} bytes decompressed where the index says {expected}", out.len())));
    }
    Ok(out)
}

/// An allocation size for `n` bytes the index announces, capped: memory grows with what is
/// actually read, not with what a damaged index claims.
fn capacity_hint(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX).min(1 << 24)
}

/// Where the index of `file` lives under `placement`.
fn index_path(file: &DataFile, placement: &IndexPlacement) -> Option<PathBuf> {
    match placement {
        IndexPlacement::Beside => {
            let mut name = file.path.file_name()?.to_os_string();
            name.push(".lines.idx");
            Some(file.path.with_file_name(name))
        }
        IndexPlacement::Dir(dir) => Some(dir.join(format!("{}.lines.idx", file.name.replace('/', "__")))),
        IndexPlacement::Memory => None,
    }
}

/// The index of `file` (whose bytes are `data` and whose size and modification time are
/// `now`): from disk when it is current, otherwise built (and stored when the placement
/// allows); and whether it is stored. A stored index that is current but fails validation
/// is refused (see [`crate::line_index`]).
fn load_or_build(
    file: &DataFile,
    data: &[u8],
    now: (u64, (u64, u32)),
    placement: &IndexPlacement,
) -> Result<(LineIndex, bool)> {
    let zstd = file.name.ends_with(".zst");
    let idx_path = index_path(file, placement);
    if let Some(p) = &idx_path {
        // An index that cannot be read is treated like a missing one: it is a cache. Only a
        // regular file of a size an index of this file can have is read at all (a FIFO would
        // block, a sparse giant would be read into memory).
        let size = std::fs::metadata(p).ok().filter(|m| m.is_file()).map(|m| m.len());
        let oversized = size.filter(|&n| n > crate::line_index::max_index_len(data.len() as u64, zstd));
        if let Some(n) = oversized {
            // Its header says whether it claims to be this file's index (corrupt) or another's
            // (stale, rebuilt below).
            let head = read_head(p).unwrap_or_default();
            let current =
                LineIndex::stored_stamp(&head).is_some_and(|s| (s.source_size, s.mtime) == now && s.zstd == zstd);
            if current {
                return Err(DataloadError::CorruptIndex {
                    path: p.clone(),
                    data: file.path.clone(),
                    reason: format!("{n} bytes, more than any index of this file can hold"),
                });
            }
        }
        let cap = crate::line_index::max_index_len(data.len() as u64, zstd);
        if let Some(bytes) = size.filter(|_| oversized.is_none()).and_then(|_| crate::fs::read_regular(p, cap).ok()) {
            if let Some(index) = stored_index(&bytes, data, zstd, now)
                .map_err(|reason| DataloadError::CorruptIndex { path: p.clone(), data: file.path.clone(), reason })?
            {
                return Ok((index, true));
            }
        }
    }
    let index = LineIndex::build(data, zstd, now, &file.path)?;
    let saved = idx_path.is_some_and(|p| index.save(&p).is_ok());
    Ok((index, saved))
}

/// The first bytes of a file (an index's header), without reading the rest.
fn read_head(p: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut head = Vec::with_capacity(64);
    crate::fs::open_regular(p).map_err(std::io::Error::other)?.take(64).read_to_end(&mut head)?;
    Ok(head)
}

/// The stored index `bytes` of `data`: `None` when it is stale (not an index, or built from
/// another size, time or kind of file), an error when it is current but corrupt.
fn stored_index(
    bytes: &[u8],
    data: &[u8],
    zstd: bool,
    now: (u64, (u64, u32)),
) -> std::result::Result<Option<LineIndex>, String> {
    match LineIndex::stored_stamp(bytes) {
        Some(s) if (s.source_size, s.mtime) == now && s.zstd == zstd => {}
        _ => return Ok(None),
    }
    let index = LineIndex::from_bytes(bytes)?;
    if !zstd {
        index.check_text(data)?;
    }
    Ok(Some(index))
}

/// The reader of [`crate::fuzz::line_index`]: `index` as a stored index of `data`, current by
/// construction (its own time, the data's size), then every record it points at; or, when the
/// index is stale, the index built from `data` and its records.
pub(crate) fn fuzz_read(data: &[u8], index: &[u8], zstd: bool) {
    let Some(stored) = LineIndex::stored_stamp(index) else { return };
    let now = (data.len() as u64, stored.mtime);
    let path = Path::new(if zstd { "fuzz.jsonl.zst" } else { "fuzz.jsonl" });
    let index = match stored_index(index, data, zstd, now) {
        Ok(Some(index)) => index,
        Err(_) => return,
        // Decompressing what the fuzzer writes can take memory out of proportion to the input;
        // that is zstd's ratio, not a bug of ours, so only small compressed inputs are built.
        Ok(None) if zstd && data.len() > 1024 => return,
        Ok(None) => match LineIndex::build(data, zstd, now, path) {
            Ok(index) => index,
            Err(_) => return,
        },
    };
    // Same reasoning: a text the index says is huge is only read when the data is real.
    if index.text_len > 1 << 24 {
        return;
    }
    let file = DataFile { path: path.to_path_buf(), name: path.display().to_string() };
    let ds = JsonlDataset::from_files(
        vec![JsonlFile { file, bytes: Bytes::copy_from_slice(data), guard: None, index, frame_base: 0 }],
        vec![false],
        2,
    );
    let n = ds.len().min(256);
    let all: Vec<u64> = (0..n).rev().collect();
    if let Ok(batch) = ds.read_batch(&all) {
        assert_eq!(batch.len() as u64, n);
    }
    let _ = ds.read_batch(&[n]);
}

impl Source for JsonlDataset {
    type Batch = TextBatch;

    fn len(&self) -> u64 {
        self.index.total()
    }

    fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    fn read_batch(&self, indices: &[u64]) -> Result<TextBatch> {
        let located = indices.iter().map(|&i| self.index.locate(i)).collect::<Result<Vec<_>>>()?;
        // Each file the batch reads is checked whole once, before its map is read.
        let mut touched: Vec<usize> = located.iter().map(|&(k, _)| k).collect();
        touched.sort_unstable();
        touched.dedup();
        for k in touched {
            if let Some(guard) = &self.files[k].guard {
                guard.check(&self.files[k].file.path)?;
            }
        }
        let total = located.iter().fold(0u64, |sum, &(k, l)| {
            let (a, b) = self.files[k].index.lines[l as usize];
            sum.saturating_add(b - a)
        });
        let mut data = Vec::with_capacity(capacity_hint(total));
        let mut offsets = Vec::with_capacity(indices.len() + 1);
        offsets.push(0);
        for (&i, (k, l)) in indices.iter().zip(located) {
            let at = data.len();
            self.read_record(k, l as usize, &mut data)?;
            // Records were checked to be UTF-8 when indexed; an index of other data (or a file
            // rewritten in place since) must not hand out text that is not.
            if let Err(e) = std::str::from_utf8(&data[at..]) {
                let (path, line) = self.record_line(i)?;
                return Err(DataloadError::NotJson {
                    path,
                    line,
                    column: e.valid_up_to() as u64 + 1,
                    reason: "invalid UTF-8".into(),
                });
            }
            offsets.push(data.len());
        }
        Ok(TextBatch { data, offsets })
    }
}
