//! Executing a copy plan: streaming, parallel, atomic.
//!
//! A plan is a list of target files, each an encoded header followed by range copies from
//! source files. Every target is written under a temporary name in its own folder, filled by
//! kernel copies (`copy_file_range`) or, where the kernel refuses, from a memory map in windows
//! whose pages are dropped once written; then fsynced. Only when every target is complete are
//! stale files removed (the old index first, so an interrupted run never leaves an index that
//! describes a half-written set), temporaries renamed into place, and the index written last
//! with the same temp-fsync-rename dance. A `kill -9` at any point leaves either the previous
//! state or the new one, plus at worst some `.tmp` files that no reader mistakes for a checkpoint.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::catalog::SourceFile;
use crate::error::{Error, IoContext, Result};
use crate::sys::{self, MappedFile};

/// A copy of `len` bytes from source file `src` (an index into the plan's sources) at `src_off`
/// to offset `dst_off` of a target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RangeCopy {
    pub src: usize,
    pub src_off: u64,
    pub dst_off: u64,
    pub len: u64,
}

/// One file to produce.
#[derive(Clone, Debug)]
pub struct TargetFile {
    pub path: PathBuf,
    /// Bytes written at offset 0 (the encoded header).
    pub head: Vec<u8>,
    pub len: u64,
    pub copies: Vec<RangeCopy>,
}

/// Everything an operation writes.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub targets: Vec<TargetFile>,
    /// Small files written after the targets, in order; the last is the commit marker (the index).
    pub trailers: Vec<(PathBuf, Vec<u8>)>,
    /// Files to delete before the new ones take their place (a previous checkpoint's index and
    /// shards). Deleted in order, so put the index first.
    pub stale: Vec<PathBuf>,
    /// Paths besides the source files that the plan must neither write nor delete (the index or
    /// metadata a source was opened from).
    pub protected: Vec<PathBuf>,
}

/// How tensor bytes are moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CopyMethod {
    /// `copy_file_range`, falling back to the memory map where the kernel refuses.
    #[default]
    Auto,
    /// Always through the memory map (a user-space copy).
    Mapped,
}

/// Options for writing.
#[derive(Default)]
pub struct WriteOptions<'a> {
    pub copy: CopyMethod,
    /// Write a `SHA256SUMS` manifest of the produced files.
    pub checksums: bool,
    /// Called with each number of tensor bytes copied, from any thread.
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
}

impl std::fmt::Debug for WriteOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteOptions").field("copy", &self.copy).field("checksums", &self.checksums).finish()
    }
}

/// Copies are cut into pieces of at most this size so that one large tensor still spreads over
/// every thread and progress moves smoothly.
const PIECE: u64 = 64 << 20;
/// The user-space copy window: what one thread holds resident at most.
const WINDOW: u64 = 8 << 20;

/// Runs `plan`, reading from `sources`. On error, no target or temporary is left behind and
/// nothing that existed before is touched.
pub fn execute(plan: &Plan, sources: &[SourceFile], opts: &WriteOptions<'_>) -> Result<()> {
    execute_with(plan, sources, opts, &|_, _, _| Ok(()))
}

/// Bytes of a target that are not range copies, written by the caller into the open temporary
/// (target index, file, temporary path) after the copies and before the fsync.
pub type Finish<'a> = dyn Fn(usize, &File, &Path) -> Result<()> + Sync + 'a;

/// [`execute`], with `finish` run on every target (in parallel) once its range copies are done.
pub fn execute_with(plan: &Plan, sources: &[SourceFile], opts: &WriteOptions<'_>, finish: &Finish<'_>) -> Result<()> {
    refuse_overwriting_sources(plan, sources)?;
    let mut temps = TempSet::default();
    for t in &plan.targets {
        if let Some(dir) = t.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).at(dir)?;
        }
        temps.create(&t.path)?;
    }
    let srcs: Vec<File> = sources.iter().map(|s| File::open(&s.path).at(&s.path)).collect::<Result<_>>()?;
    let maps: Vec<std::sync::OnceLock<std::result::Result<MappedFile, String>>> =
        sources.iter().map(|_| std::sync::OnceLock::new()).collect();

    // Size each target and write its header, then fill the data in parallel pieces.
    for (t, (tmp, f)) in plan.targets.iter().zip(&temps.files) {
        f.set_len(t.len).at(tmp)?;
        f.write_all_at(&t.head, 0).at(tmp)?;
    }
    let mut pieces = Vec::new();
    for (ti, t) in plan.targets.iter().enumerate() {
        for c in &t.copies {
            let mut done = 0;
            while done < c.len {
                let len = (c.len - done).min(PIECE);
                pieces.push((ti, RangeCopy { src: c.src, src_off: c.src_off + done, dst_off: c.dst_off + done, len }));
                done += len;
            }
        }
    }
    let kernel_ok = AtomicBool::new(opts.copy == CopyMethod::Auto);
    pieces.par_iter().try_for_each(|(ti, c)| {
        let (_, dst) = &temps.files[*ti];
        let src = &srcs[c.src];
        let src_path = &sources[c.src].path;
        let copied = if kernel_ok.load(Ordering::Relaxed) {
            kernel_copy(src, src_path, dst, &temps.files[*ti].0, c, &kernel_ok)?
        } else {
            0
        };
        if let (Some(p), true) = (opts.progress, copied > 0) {
            p(copied);
        }
        if copied < c.len {
            let map = maps[c.src].get_or_init(|| MappedFile::open(src).map_err(|e| e.to_string()));
            let map = map
                .as_ref()
                .map_err(|e| Error::Io { path: src_path.clone(), source: std::io::Error::other(e.clone()) })?;
            let rest =
                RangeCopy { src: c.src, src_off: c.src_off + copied, dst_off: c.dst_off + copied, len: c.len - copied };
            mapped_copy(map, src_path, dst, &temps.files[*ti].0, &rest, opts.progress)?;
        }
        Ok::<(), Error>(())
    })?;

    temps.files.par_iter().enumerate().try_for_each(|(i, (p, f))| finish(i, f, p))?;
    temps.files.par_iter().try_for_each(|(p, f)| f.sync_all().at(p))?;
    let mut trailers = plan.trailers.clone();
    if opts.checksums {
        let sums: Vec<(String, String)> = plan
            .targets
            .par_iter()
            .zip(&temps.files)
            .map(|(t, (p, _))| Ok((file_name(&t.path), crate::manifest::sha256_file(p)?)))
            .collect::<Result<_>>()?;
        let dir = plan.targets.first().and_then(|t| t.path.parent()).unwrap_or(Path::new("."));
        // The manifest goes before the index: the index stays the last thing written.
        trailers.insert(0, (dir.join(crate::manifest::MANIFEST_NAME), crate::manifest::render(&sums).into_bytes()));
    }

    for stale in &plan.stale {
        match std::fs::remove_file(stale) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::Io { path: stale.clone(), source: e }),
        }
    }
    for (t, (tmp, _)) in plan.targets.iter().zip(&temps.files) {
        std::fs::rename(tmp, &t.path).at(&t.path)?;
    }
    temps.files.clear();
    for (path, bytes) in &trailers {
        write_atomic(path, bytes)?;
    }
    let mut dirs: Vec<&Path> = plan.targets.iter().filter_map(|t| t.path.parent()).collect();
    dirs.extend(trailers.iter().filter_map(|(p, _)| p.parent()));
    dirs.sort();
    dirs.dedup();
    for d in dirs {
        sync_dir(d)?;
    }
    Ok(())
}

fn kernel_copy(
    src: &File,
    src_path: &Path,
    dst: &File,
    dst_path: &Path,
    c: &RangeCopy,
    ok: &AtomicBool,
) -> Result<u64> {
    let mut done = 0;
    while done < c.len {
        match sys::copy_file_range(src, c.src_off + done, dst, c.dst_off + done, c.len - done) {
            Ok(0) => return Err(short_source(src_path, c.src_off + done)),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if sys::copy_unsupported(&e) && done == 0 => {
                ok.store(false, Ordering::Relaxed);
                return Ok(0);
            }
            Err(e) => return Err(Error::Io { path: dst_path.to_path_buf(), source: e }),
        }
    }
    Ok(done)
}

fn mapped_copy(
    map: &MappedFile,
    src_path: &Path,
    dst: &File,
    dst_path: &Path,
    c: &RangeCopy,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<()> {
    let mut done = 0;
    while done < c.len {
        let len = (c.len - done).min(WINDOW);
        let bytes = map.get(c.src_off + done, len).ok_or_else(|| short_source(src_path, c.src_off + done))?;
        dst.write_all_at(bytes, c.dst_off + done).at(dst_path)?;
        map.release(c.src_off + done, len);
        done += len;
        if let Some(p) = progress {
            p(len);
        }
    }
    Ok(())
}

fn short_source(path: &Path, at: u64) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("file ended at byte {at} while copying (was it changed during the copy?)"),
        ),
    }
}

/// Refuses a plan that would replace or delete what it reads: writing a checkpoint over its own
/// source files would destroy them mid-read. Paths are compared after resolving links.
fn refuse_overwriting_sources(plan: &Plan, sources: &[SourceFile]) -> Result<()> {
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    let read: Vec<PathBuf> = sources
        .iter()
        .map(|s| s.path.as_path())
        .chain(plan.protected.iter().map(PathBuf::as_path))
        .filter_map(canon)
        .collect();
    let written = plan.targets.iter().map(|t| &t.path).chain(&plan.stale).chain(plan.trailers.iter().map(|(p, _)| p));
    for out in written {
        if canon(out).is_some_and(|c| read.contains(&c)) {
            return Err(Error::OutputIsSource { path: out.clone() });
        }
    }
    Ok(())
}

/// A previous checkpoint's files in `dir`: the names `managed` accepts, commit markers (`marker`:
/// the index or metadata) first, so that an interrupted replacement never leaves a marker that
/// describes a mix of old and new files. A missing `dir` has none.
pub(crate) fn stale_files(
    dir: &Path,
    managed: impl Fn(&str) -> bool,
    marker: impl Fn(&str) -> bool,
) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::Io { path: dir.to_path_buf(), source: e }),
    };
    let mut stale = Vec::new();
    for entry in entries {
        let name = entry.at(dir)?.file_name().to_string_lossy().into_owned();
        if managed(&name) {
            stale.push((!marker(&name), dir.join(name)));
        }
    }
    stale.sort();
    Ok(stale.into_iter().map(|(_, p)| p).collect())
}

/// Writes `bytes` to `path` atomically: temp beside it, fsync, rename, fsync the folder.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut temps = TempSet::default();
    temps.create(path)?;
    let (tmp, f) = &mut temps.files[0];
    let tmp = tmp.clone();
    f.write_all(bytes).at(&tmp)?;
    f.sync_all().at(&tmp)?;
    std::fs::rename(&tmp, path).at(path)?;
    temps.files.clear();
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<()> {
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    File::open(dir).and_then(|d| d.sync_all()).at(dir)
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Temporary files that are removed unless renamed into place.
#[derive(Default)]
struct TempSet {
    files: Vec<(PathBuf, File)>,
}

impl TempSet {
    /// Creates `.<name>.tmp.<pid>` beside `target`. The leading dot and the `.tmp.` suffix keep
    /// it from ever matching a checkpoint file name.
    fn create(&mut self, target: &Path) -> Result<()> {
        let name = file_name(target);
        let tmp = target.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
        // Readable too: finishing a target may read back what was copied (torch CRCs).
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&tmp).at(&tmp)?;
        self.files.push((tmp, f));
        Ok(())
    }
}

impl Drop for TempSet {
    fn drop(&mut self) {
        for (p, _) in self.files.drain(..) {
            let _ = std::fs::remove_file(p);
        }
    }
}
