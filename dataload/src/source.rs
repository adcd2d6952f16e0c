//! What every data source shares: the [`Source`] trait, fingerprints, shard sets, and the
//! small bounded cache of decoded units.
//!
//! # Shards
//!
//! A source opens one path, which may be a file, a directory (every file below it whose name
//! ends with one of the format's extensions, recursively) or a glob (`data/train-*.parquet`).
//! The files are sorted by path, byte-wise, and their samples concatenated in that order: the
//! global index of sample `j` of file `k` is `j` plus the sample counts of files `0..k`. The
//! order does not depend on the file system's listing order, so the index is stable.
//!
//! # Fingerprints
//!
//! A [`Fingerprint`] lists, for each file, its path relative to the dataset root (the
//! directory given, or the fixed part of a glob, or the file's directory), its size and its
//! number of samples, plus the format and the options that change what a sample is (block
//! size, columns). Its [`id`](Fingerprint::id) is what a [`crate::LoaderState`] records:
//! moving the dataset directory keeps it, changing, adding or removing a file changes it.
//! Modification times are left out on purpose: copying a dataset changes them.

use std::collections::VecDeque;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::error::{DataloadError, Result};

/// The most samples a dataset may have: 2^63 - 1, what a signed 64-bit index (torch's, and
/// Python's `len`) counts. A file whose counts bring a dataset past it is refused when opened,
/// not when its length is first asked for.
pub(crate) const MAX_SAMPLES: u64 = i64::MAX as u64;

/// A random-access dataset whose samples are read a batch at a time.
///
/// `read_batch` must be deterministic (the same indices give the same batch) and safe to call
/// from several threads at once: the [`crate::DataLoader`] calls it from its workers.
pub trait Source: Send + Sync + fmt::Debug + 'static {
    /// A collated batch: contiguous buffers, one allocation per buffer per batch.
    type Batch: Send + 'static;

    /// Number of samples.
    fn len(&self) -> u64;

    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Identity of the data, recorded in loader states.
    fn fingerprint(&self) -> &Fingerprint;

    /// Reads and collates the samples at `indices`, in that order.
    fn read_batch(&self, indices: &[u64]) -> Result<Self::Batch>;

    /// The mixture this source reads in order, when it is one: a loader over it records the
    /// definition in its state ([`crate::MixtureSource`]).
    fn mixture(&self) -> Option<&crate::MixtureSpec> {
        None
    }
}

/// One file of a dataset, as its fingerprint records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileFingerprint {
    /// Path relative to the dataset root.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Samples it holds.
    pub rows: u64,
}

/// Identity of a dataset: its format, the options that shape a sample, and its files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fingerprint {
    /// Format (`tokens`, `arrow`, `parquet`, `jsonl`).
    pub format: &'static str,
    /// Options that change what a sample is, as text (`block_size=1024`, `columns=a,b`).
    pub options: String,
    /// The files, in dataset order.
    pub files: Vec<FileFingerprint>,
}

impl Fingerprint {
    /// Total samples.
    pub fn rows(&self) -> u64 {
        self.files.iter().map(|f| f.rows).sum()
    }

    /// A short, readable identity: format, file and row counts, and a SHA-256 of everything.
    pub fn id(&self) -> String {
        let canonical = serde_json::to_vec(self).unwrap_or_default();
        let digest = Sha256::digest(&canonical);
        let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
        format!("{}:{}files:{}rows:sha256-{hex}", self.format, self.files.len(), self.rows())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id())
    }
}

/// A file of a dataset: where it is and how the fingerprint names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DataFile {
    pub path: PathBuf,
    pub name: String,
}

/// The files `spec` names (a file, a directory searched recursively, or a glob), sorted; in a
/// directory or a glob only names ending with one of `extensions` count.
pub(crate) fn resolve_files(spec: &Path, extensions: &[&str]) -> Result<Vec<DataFile>> {
    let text = spec.to_string_lossy();
    let wanted = || extensions.iter().map(|e| format!("`*{e}`")).collect::<Vec<_>>().join(", ");
    let matches_ext = |p: &Path| {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        extensions.iter().any(|e| name.ends_with(e))
    };
    let (root, mut paths) = if text.contains(['*', '?', '[']) {
        let root = glob_root(spec);
        let entries = glob::glob(&text)
            .map_err(|e| DataloadError::BadPattern { pattern: spec.to_path_buf(), reason: e.to_string() })?;
        let mut paths = Vec::new();
        for entry in entries {
            let p = entry.map_err(|e| DataloadError::Io { path: e.path().to_path_buf(), source: e.into() })?;
            if p.is_file() && matches_ext(&p) {
                paths.push(p);
            }
        }
        (root, paths)
    } else if spec.is_dir() {
        let mut paths = Vec::new();
        walk(spec, &mut |p| {
            if matches_ext(p) {
                paths.push(p.to_path_buf());
            }
        })?;
        (spec.to_path_buf(), paths)
    } else {
        std::fs::metadata(spec).map_err(|e| DataloadError::io(spec, e))?;
        (spec.parent().map(Path::to_path_buf).unwrap_or_default(), vec![spec.to_path_buf()])
    };
    paths.sort();
    if paths.is_empty() {
        return Err(DataloadError::NoFiles { pattern: spec.to_path_buf(), wanted: wanted() });
    }
    Ok(paths
        .into_iter()
        .map(|path| {
            let rel = path.strip_prefix(&root).unwrap_or(&path);
            let name = rel.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/");
            DataFile { path, name }
        })
        .collect())
}

/// The directory part of a glob before its first pattern character.
fn glob_root(spec: &Path) -> PathBuf {
    let mut root = PathBuf::new();
    for c in spec.components() {
        if c.as_os_str().to_string_lossy().contains(['*', '?', '[']) {
            break;
        }
        root.push(c);
    }
    root
}

fn walk(dir: &Path, f: &mut dyn FnMut(&Path)) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| DataloadError::io(dir, e))?
        .map(|e| e.map(|e| e.path()).map_err(|e| DataloadError::io(dir, e)))
        .collect::<Result<_>>()?;
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, f)?;
        } else if p.is_file() {
            f(&p);
        }
    }
    Ok(())
}

/// Prefix sums over consecutive units (files, record batches, row groups): maps a global
/// index to (unit, index within the unit) by binary search.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardIndex {
    /// `starts[k]` is the global index of unit `k`'s first sample; one more entry: the total.
    starts: Vec<u64>,
}

impl ShardIndex {
    pub(crate) fn new(counts: impl IntoIterator<Item = u64>) -> Self {
        let mut starts = vec![0u64];
        let mut total = 0u64;
        for c in counts {
            total = total.saturating_add(c);
            starts.push(total);
        }
        Self { starts }
    }

    pub(crate) fn total(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    /// `(unit, local index)` of global index `i`, which must be below the total (units with no
    /// samples are never returned).
    pub(crate) fn locate(&self, i: u64) -> Result<(usize, u64)> {
        if i >= self.total() {
            return Err(DataloadError::IndexOutOfRange { index: i, len: self.total() });
        }
        // First unit whose end is past `i`.
        let unit = self.starts[1..].partition_point(|&end| end <= i);
        Ok((unit, i - self.starts[unit]))
    }
}

/// A small least-recently-used cache of decoded units (row groups, zstd frames), shared by
/// the workers. Values are cheap to clone (reference-counted).
#[derive(Debug)]
pub(crate) struct UnitCache<V> {
    capacity: usize,
    entries: Mutex<VecDeque<(usize, V)>>,
}

impl<V: Clone> UnitCache<V> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { capacity: capacity.max(1), entries: Mutex::new(VecDeque::new()) }
    }

    /// The cached value of `key`, or `load(key)` (run without holding the lock, so two workers
    /// may decode the same unit at once; both get the same value).
    pub(crate) fn get_or_load(&self, key: usize, load: impl FnOnce() -> Result<V>) -> Result<V> {
        {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(pos) = entries.iter().position(|(k, _)| *k == key) {
                let hit = entries.remove(pos).ok_or(DataloadError::Worker { reason: "cache entry vanished".into() })?;
                let value = hit.1.clone();
                entries.push_back(hit);
                return Ok(value);
            }
        }
        let value = load()?;
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if !entries.iter().any(|(k, _)| *k == key) {
            if entries.len() >= self.capacity {
                entries.pop_front();
            }
            entries.push_back((key, value.clone()));
        }
        Ok(value)
    }

    /// Keys cached now, least recently used first.
    #[cfg(test)]
    pub(crate) fn keys(&self) -> Vec<usize> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, _)| *k).collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn shard_index_skips_empty_units() {
        let idx = ShardIndex::new([3, 0, 2]);
        assert_eq!(idx.total(), 5);
        let got: Vec<_> = (0..5).map(|i| idx.locate(i).unwrap()).collect();
        assert_eq!(got, vec![(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]);
        assert_eq!(idx.locate(5), Err(DataloadError::IndexOutOfRange { index: 5, len: 5 }));
    }

    #[test]
    fn cache_is_bounded_and_lru() {
        let cache = UnitCache::new(2);
        for k in [1, 2, 1, 3] {
            assert_eq!(cache.get_or_load(k, || Ok(k * 10)).unwrap(), k * 10);
        }
        assert_eq!(cache.keys(), vec![1, 3]);
    }
}
