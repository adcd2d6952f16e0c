//! Executing a copy plan: streaming, parallel, atomic.
//!
//! A plan is a list of target files, each an encoded header followed by range copies from
//! source files. Every target is written under a temporary name in its own folder, filled by
//! kernel copies (`copy_file_range`) or, where the kernel refuses, from a memory map in windows
//! whose pages are dropped once written; then fsynced. Only when every target is complete are
//! the temporaries renamed into place, and the index written last with the same
//! temp-fsync-rename dance; a previous checkpoint's files that nothing replaced are removed after
//! that. A `kill -9` at any point leaves the previous checkpoint or the new one (plus at worst
//! `.tmp` files and the old set's unreferenced shards, which no reader mistakes for a
//! checkpoint). One case cannot be atomic without replacing the whole folder: when new files
//! take old files' names (or a sharded set becomes one file), the old index is removed before
//! the renames, so a kill in between leaves no index, never an index that describes a mixed
//! set.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::cast::cast_into;
use crate::catalog::{Checkpoint, TensorData, TensorInfo};
use crate::dtype::Dtype;
use crate::error::{Error, IoContext, Result};
use crate::io::Sources;
use crate::sys;

/// A copy of `len` bytes from source file `src` (an index into the plan's sources) at `src_off`
/// to offset `dst_off` of a target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RangeCopy {
    pub src: usize,
    pub src_off: u64,
    pub dst_off: u64,
    pub len: u64,
}

/// A tensor that is not one plain range of its source (a strided view, boxes of small runs, or
/// one to cast): read run by run through a bounded window, cast to `to`, and written
/// contiguously at `dst_off`.
#[derive(Clone, Debug)]
pub(crate) struct Gather {
    pub tensor: TensorInfo,
    pub to: Dtype,
    pub dst_off: u64,
    /// Bytes computed from the tensor's instead of cast (block-scaled FP8).
    pub compute: Option<crate::blockscale::SharedCompute>,
    /// Only these bytes of the tensor's row-major stored bytes (a rank's rows of it), uncast.
    pub range: Option<std::ops::Range<u64>>,
}

/// Runs shorter than this on average are gathered through the window rather than copied one
/// kernel call each: a row of a tensor-parallel shard is a few KiB.
const MIN_COPY_RUN: u64 = 64 << 10;
/// Boxes with at most this many runs are copied run by run whatever their length.
const FEW_RUNS: u64 = 64;

impl TensorInfo {
    /// True when its stored bytes are best moved as range copies: ranges, or boxes whose runs
    /// are few or long.
    pub(crate) fn copies_well(&self) -> bool {
        match &self.data {
            TensorData::Ranges(_) => true,
            TensorData::Boxes(_) => {
                // A few kernel copies cost nothing whatever their size (FSDP2's dim-0 chunks).
                let runs = self.run_count();
                runs <= FEW_RUNS || self.stored_len() / runs >= MIN_COPY_RUN
            }
        }
    }
}

/// Bytes of a target that depend on the rest of it (torch's CRC32s), written once every copy
/// and gather is done and before the fsync.
pub(crate) trait Seal: Send + Sync + std::fmt::Debug {
    fn seal(&self, file: &File, path: &Path) -> Result<()>;
}

/// One file to produce.
#[derive(Debug)]
pub(crate) struct TargetFile {
    pub path: PathBuf,
    /// Bytes written at offset 0 (the encoded header).
    pub head: Vec<u8>,
    pub len: u64,
    pub copies: Vec<RangeCopy>,
    pub gathers: Vec<Gather>,
    pub seal: Option<Box<dyn Seal>>,
}

impl TargetFile {
    pub(crate) fn new(path: PathBuf, head: Vec<u8>, len: u64) -> TargetFile {
        TargetFile { path, head, len, copies: Vec::new(), gathers: Vec::new(), seal: None }
    }

    /// Places `tensor`, written as `to`, at `dst_off`: as range copies when its stored bytes
    /// are already what is written (no cast, at most one run per chunk), else as a gather.
    pub(crate) fn place(
        &mut self,
        tensor: &TensorInfo,
        to: Dtype,
        dst_off: u64,
        compute: Option<crate::blockscale::SharedCompute>,
    ) {
        if compute.is_some() {
            if tensor.numel() > 0 {
                self.gathers.push(Gather { tensor: tensor.clone(), to, dst_off, compute, range: None });
            }
            return;
        }
        if to == tensor.stored && tensor.copies_well() {
            let mut at = dst_off;
            for (src, src_off, len) in tensor.runs() {
                // Back-to-back tensors of one source become one copy (one kernel call).
                match self.copies.last_mut() {
                    Some(c) if c.src == src && c.src_off + c.len == src_off && c.dst_off + c.len == at => c.len += len,
                    _ => self.copies.push(RangeCopy { src, src_off, dst_off: at, len }),
                }
                at += len;
            }
        } else if tensor.numel() > 0 {
            self.gathers.push(Gather { tensor: tensor.clone(), to, dst_off, compute: None, range: None });
        }
    }
}

/// A previous checkpoint's files where a plan writes (see [`stale_files`]).
#[derive(Debug, Default)]
pub(crate) struct Stale {
    /// Its commit markers (the index, `.metadata`).
    pub markers: Vec<PathBuf>,
    /// Its other files (shards, rank files).
    pub files: Vec<PathBuf>,
}

impl Stale {
    fn all(&self) -> impl Iterator<Item = &PathBuf> {
        self.markers.iter().chain(&self.files)
    }
}

/// Everything an operation writes.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub targets: Vec<TargetFile>,
    /// Small files written after the targets, in order; the last is the commit marker (the index).
    pub trailers: Vec<(PathBuf, Vec<u8>)>,
    /// A previous checkpoint's files in the output folder, which the new one replaces.
    pub stale: Stale,
    /// Every file the source consists of (data files, indexes, `.metadata`, `latest`,
    /// manifests, helper files): the plan must neither write, replace nor delete any of them.
    pub protected: Vec<PathBuf>,
    /// Outputs the user named: the only paths that may be replaced even when they are symlinks
    /// (replacing the link, never writing through it).
    pub named: Vec<PathBuf>,
}

impl Plan {
    /// Every file the plan produces, in order: targets, then trailers (the commit marker last).
    pub(crate) fn outputs(&self) -> Vec<PathBuf> {
        self.targets.iter().map(|t| t.path.clone()).chain(self.trailers.iter().map(|(p, _)| p.clone())).collect()
    }
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
    /// How tensor bytes are moved.
    pub copy: CopyMethod,
    /// Write a `SHA256SUMS` manifest of the produced files.
    pub checksums: bool,
    /// Called with each number of tensor bytes copied, from any thread.
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
    /// Write views that read the same storage bytes many times over (a broadcast, as torch's
    /// `expand` makes) at their full size, instead of refusing them.
    pub allow_expanded: bool,
}

impl std::fmt::Debug for WriteOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteOptions")
            .field("copy", &self.copy)
            .field("checksums", &self.checksums)
            .field("allow_expanded", &self.allow_expanded)
            .finish()
    }
}

/// Copies are cut into pieces of at most this size so that one large tensor still spreads over
/// every thread and progress moves smoothly.
const PIECE: u64 = 64 << 20;
/// The user-space copy window: what one thread holds resident at most.
const WINDOW: u64 = 8 << 20;
/// What all gathering threads hold together at most: with many threads each window shrinks,
/// down to [`MIN_WINDOW`], so the peak stays near this whatever the machine.
const GATHER_BUDGET: u64 = 32 << 20;
const MIN_WINDOW: u64 = 1 << 20;
/// Runs at least this long are read into the window with `pread` (no mapped pages to hold or
/// drop); shorter ones, a strided view's elements, come from the map.
const PREAD_MIN: u64 = 1 << 10;

/// Runs `plan`, reading from the files of `source`. On error, no target or temporary is left
/// behind and nothing that existed before is touched.
pub(crate) fn execute(plan: &Plan, source: &Checkpoint, opts: &WriteOptions<'_>) -> Result<()> {
    execute_from(plan, &Sources::of(source.files())?, source.members(), opts)
}

/// Runs `plan`, reading from `srcs` (open files, or the caller's memory: [`Sources::memory`]),
/// refusing to write, replace or delete any of `members` (the files the sources are part of)
/// or of the plan's protected files. As [`execute`] on error.
pub(crate) fn execute_from(
    plan: &Plan,
    srcs: &Sources<'_>,
    members: &[PathBuf],
    opts: &WriteOptions<'_>,
) -> Result<()> {
    refuse_overwriting_sources(plan, members)?;
    // Checked before anything is written (and again at each rename, for links planted while
    // the plan runs), so a refusal leaves nothing behind.
    let manifest = plan.targets.first().and_then(|t| t.path.parent()).map(|d| d.join(crate::manifest::MANIFEST_NAME));
    let manifest = manifest.filter(|_| opts.checksums);
    for out in plan.targets.iter().map(|t| &t.path).chain(plan.trailers.iter().map(|(p, _)| p)).chain(&manifest) {
        refuse_planted_link(out, plan)?;
    }
    // A folder the plan creates is built under a temporary name and renamed into place once
    // everything in it is complete, so a failure or a kill never leaves half of one behind.
    let stage = Stage::new(plan)?;
    let mut temps = TempSet::default();
    for t in &plan.targets {
        let path = stage.place(&t.path);
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).at(dir)?;
        }
        temps.create(&path)?;
    }
    // Every CRC-covered record the plan reads is checked while the bytes are copied, in parallel
    // pieces beside the copies: a damaged source is refused before anything is committed (the
    // temporaries are removed), and the hashing is not a phase of its own before the copies.
    let copies = plan.targets.iter().flat_map(|t| t.copies.iter().map(|c| (c.src, c.src_off, c.len)));
    let gathered = plan.targets.iter().flat_map(|t| t.gathers.iter().flat_map(|g| g.tensor.extents()));
    let extents: Vec<(usize, u64, u64)> = copies.chain(gathered).collect();
    let (checked, copied) = rayon::join(|| srcs.check_extents(extents), || copy_and_gather(plan, srcs, &temps, opts));
    checked?;
    copied?;
    plan.targets.par_iter().zip(&temps.files).try_for_each(|(t, (p, f))| match &t.seal {
        Some(s) => s.seal(f, p),
        None => Ok(()),
    })?;
    temps.files.par_iter().try_for_each(|(p, f)| f.sync_all().at(p))?;
    let mut trailers = plan.trailers.clone();
    if opts.checksums {
        let sums: Vec<(String, String)> = plan
            .targets
            .par_iter()
            .zip(&temps.files)
            .map(|(t, (p, _))| Ok((file_name(&t.path), crate::manifest::sha256_file(p)?)))
            .collect::<Result<_>>()?;
        let path = manifest.clone().unwrap_or_else(|| PathBuf::from(crate::manifest::MANIFEST_NAME));
        // The manifest goes before the index: the index stays the last thing written.
        trailers.insert(0, (path, crate::manifest::render(&sums).into_bytes()));
    }

    // A previous checkpoint in the output folder stays whole until the new index replaces its
    // index in one rename, and its files that nothing replaced go last. Its index goes first
    // only where it could otherwise describe a mixed set: when a new file takes the name of one
    // of its files, or when no new index replaces it (a sharded set becoming one file). A kill
    // then leaves no index rather than a wrong one.
    let placed: std::collections::HashSet<PathBuf> = plan.targets.iter().map(|t| stage.place(&t.path)).collect();
    let replaced: std::collections::HashSet<&PathBuf> = trailers.iter().map(|(p, _)| p).collect();
    let collides = plan.stale.files.iter().any(|f| placed.contains(f));
    for m in plan.stale.markers.iter().filter(|m| collides || !replaced.contains(m)) {
        remove_if_there(m)?;
    }
    for (t, (tmp, _)) in plan.targets.iter().zip(&temps.files) {
        let path = stage.place(&t.path);
        refuse_planted_link(&path, plan)?;
        std::fs::rename(tmp, &path).at(&path)?;
    }
    temps.files.clear();
    // Trailers inside a staged folder are part of it; the ones outside (a `latest` pointer)
    // follow once it is in place, the commit marker last.
    let (inside, outside): (Vec<_>, Vec<_>) = trailers.iter().partition(|(p, _)| stage.contains(p));
    for (path, bytes) in inside {
        write_atomic(&stage.place(path), bytes, plan)?;
    }
    let mut dirs: Vec<PathBuf> =
        plan.targets.iter().filter_map(|t| stage.place(&t.path).parent().map(Path::to_path_buf)).collect();
    dirs.sort();
    dirs.dedup();
    for d in &dirs {
        sync_dir(d)?;
    }
    stage.commit()?;
    for (path, bytes) in outside {
        write_atomic(path, bytes, plan)?;
    }
    for f in plan.stale.files.iter().filter(|f| !placed.contains(*f)) {
        remove_if_there(f)?;
    }
    Ok(())
}

/// A folder that does not exist yet, built as `.<name>.<random>.tmp` beside it.
#[derive(Debug, Default)]
pub(crate) struct Stage {
    /// `(final, temporary)`; `None` when every output folder already exists.
    dirs: Option<(PathBuf, PathBuf)>,
}

impl Stage {
    /// The one topmost missing folder that holds every output, if there is one.
    fn new(plan: &Plan) -> Result<Stage> {
        let outputs =
            plan.targets.iter().map(|t| t.path.as_path()).chain(plan.trailers.iter().map(|(p, _)| p.as_path()));
        let mut missing: Option<PathBuf> = None;
        for out in outputs {
            let mut top = None;
            let mut dir = out.parent();
            while let Some(d) = dir.filter(|d| !d.as_os_str().is_empty()) {
                if std::fs::symlink_metadata(d).is_ok() {
                    break;
                }
                top = Some(d.to_path_buf());
                dir = d.parent();
            }
            match (&missing, top) {
                (_, None) => {}
                (None, Some(t)) => missing = Some(t),
                (Some(m), Some(t)) if *m == t => {}
                // Outputs spread over several new folders: created in place (not staged).
                (Some(_), Some(_)) => return Ok(Stage::default()),
            }
        }
        // Only worth staging when every target is inside it (trailers outside may follow).
        let Some(dir) = missing.filter(|m| plan.targets.iter().all(|t| t.path.starts_with(m))) else {
            return Ok(Stage::default());
        };
        let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).at(parent)?;
        let tmp = parent.join(format!(".{}.{}.tmp", file_name(&dir), random_hex()));
        std::fs::create_dir(&tmp).at(&tmp)?;
        Ok(Stage { dirs: Some((dir, tmp)) })
    }

    /// Stages the new folder `dir` itself, for an operation that fills it piece by piece (a
    /// whole `save_state` folder); refused when `dir` exists.
    pub(crate) fn folder(dir: &Path) -> Result<Stage> {
        if std::fs::symlink_metadata(dir).is_ok() {
            return Err(Error::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::AlreadyExists, "already exists"),
            });
        }
        let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).at(parent)?;
        let tmp = parent.join(format!(".{}.{}.tmp", file_name(dir), random_hex()));
        std::fs::create_dir(&tmp).at(&tmp)?;
        Ok(Stage { dirs: Some((dir.to_path_buf(), tmp)) })
    }

    /// The temporary folder, for a stage made by [`Stage::folder`].
    pub(crate) fn path(&self) -> &Path {
        self.dirs.as_ref().map_or(Path::new("."), |(_, tmp)| tmp.as_path())
    }

    fn contains(&self, path: &Path) -> bool {
        self.dirs.as_ref().is_some_and(|(dir, _)| path.starts_with(dir))
    }

    /// Where `path` is written while the plan runs.
    fn place(&self, path: &Path) -> PathBuf {
        match &self.dirs {
            Some((dir, tmp)) => path.strip_prefix(dir).map_or_else(|_| path.to_path_buf(), |rest| tmp.join(rest)),
            None => path.to_path_buf(),
        }
    }

    /// Renames the finished folder into place (refusing if something appeared there meanwhile).
    pub(crate) fn commit(mut self) -> Result<()> {
        let Some((dir, tmp)) = self.dirs.take() else { return Ok(()) };
        sync_dir(&tmp)?;
        if std::fs::symlink_metadata(&dir).is_ok() {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(Error::Io {
                path: dir,
                source: std::io::Error::new(std::io::ErrorKind::AlreadyExists, "appeared while the output was written"),
            });
        }
        std::fs::rename(&tmp, &dir).at(&dir)?;
        sync_dir(dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        if let Some((_, tmp)) = self.dirs.take() {
            let _ = std::fs::remove_dir_all(tmp);
        }
    }
}

/// Refuses to rename over a symlink the user did not name as the output: someone who can write
/// to the output folder could plant one there to make us replace a file elsewhere's name.
fn refuse_planted_link(path: &Path, plan: &Plan) -> Result<()> {
    let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if is_link && !plan.named.iter().any(|n| n == path) {
        return Err(Error::PlantedLink { path: path.to_path_buf() });
    }
    Ok(())
}

/// 64 random bits as hex, from the kernel: temporary names nobody can predict.
pub(crate) fn random_hex() -> String {
    let mut b = [0u8; 8];
    let ok = File::open("/dev/urandom").and_then(|f| std::io::Read::read_exact(&mut &f, &mut b)).is_ok();
    if !ok {
        // No /dev/urandom (a sandbox): std's per-process random hash keys still differ per run.
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        b = h.finish().to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Reads a gathered tensor run by run into a bounded window, casts each full window and writes
/// it out; the source pages it touched are dropped as it goes.
fn gather(
    srcs: &Sources,
    g: &Gather,
    dst: &File,
    dst_path: &Path,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<()> {
    let t = &g.tensor;
    if let Some(c) = &g.compute {
        let mut at = g.dst_off;
        return crate::blockscale::run(srcs, t, g.to, c, |out| {
            dst.write_all_at(out, at).at(dst_path)?;
            sys::start_writeback(dst, at, out.len() as u64);
            at += out.len() as u64;
            if let Some(p) = progress {
                p(out.len() as u64);
            }
            Ok(())
        });
    }
    let in_elem = (t.stored.bits() / 8).max(1) as usize;
    let threads = rayon::current_num_threads().max(1) as u64;
    let budget = (GATHER_BUDGET / threads).clamp(MIN_WINDOW, WINDOW) as usize;
    // A window holds whole elements, so a cast never splits one.
    let window = (budget / in_elem).max(1) * in_elem;
    let mut inbuf: Vec<u8> = Vec::with_capacity(window);
    let mut outbuf: Vec<u8> = Vec::new();
    let mut at = g.dst_off;
    // The source span each file was read in since the last flush; released at each flush, so
    // the pages held stay about one window's worth however the runs interleave.
    let mut touched: Vec<(usize, u64, u64)> = Vec::new();
    let mut flush = |inbuf: &mut Vec<u8>, at: &mut u64, touched: &mut Vec<(usize, u64, u64)>| -> Result<()> {
        let out: &[u8] = if t.stored == g.to {
            inbuf
        } else {
            outbuf.clear();
            cast_into(inbuf, t.stored, g.to, &mut outbuf);
            &outbuf
        };
        dst.write_all_at(out, *at).at(dst_path)?;
        sys::start_writeback(dst, *at, out.len() as u64);
        *at += out.len() as u64;
        if let Some(p) = progress {
            p(out.len() as u64);
        }
        inbuf.clear();
        for (f, lo, hi) in touched.drain(..) {
            srcs.release(f, lo, hi - lo);
        }
        Ok(())
    };
    let (from, to) = g.range.as_ref().map_or((0, u64::MAX), |r| (r.start, r.end));
    let mut pos = 0u64;
    for (file, off, len) in t.runs() {
        if pos >= to {
            break;
        }
        // The part of this run inside the wanted range.
        let (lo, hi) = (pos.max(from), (pos + len).min(to));
        let run_start = pos;
        pos += len;
        if lo >= hi {
            continue;
        }
        let (off, len) = (off + (lo - run_start), hi - lo);
        let mapped = len < PREAD_MIN;
        if mapped {
            match touched.iter_mut().find(|(f, ..)| *f == file) {
                Some((_, a, b)) => {
                    *a = (*a).min(off);
                    *b = (*b).max(off + len);
                }
                None => touched.push((file, off, off + len)),
            }
        }
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min((window - inbuf.len()) as u64);
            if mapped {
                inbuf.extend_from_slice(srcs.read(file, off + done, n)?);
            } else {
                let at = inbuf.len();
                inbuf.resize(at + n as usize, 0);
                srcs.read_into(file, off + done, &mut inbuf[at..])?;
            }
            done += n;
            if inbuf.len() == window {
                flush(&mut inbuf, &mut at, &mut touched)?;
            }
        }
    }
    if !inbuf.is_empty() || !touched.is_empty() {
        flush(&mut inbuf, &mut at, &mut touched)?;
    }
    Ok(())
}

/// Sizes each target, writes its header, and fills its data: the range copies, then the
/// gathers, each in parallel pieces.
fn copy_and_gather(plan: &Plan, srcs: &Sources<'_>, temps: &TempSet, opts: &WriteOptions<'_>) -> Result<()> {
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
        let (dst_path, dst) = &temps.files[*ti];
        // Bytes held in memory (a torch file's numpy arrays, the caller's buffers) are not in a
        // file: written from where they are.
        let copied = if kernel_ok.load(Ordering::Relaxed) && !srcs.in_memory(c.src, c.src_off) {
            let (src, src_path) = srcs.file(c.src)?;
            kernel_copy(src, src_path, dst, dst_path, c, &kernel_ok)?
        } else {
            0
        };
        if let (Some(p), true) = (opts.progress, copied > 0) {
            p(copied);
        }
        if copied < c.len {
            let rest =
                RangeCopy { src: c.src, src_off: c.src_off + copied, dst_off: c.dst_off + copied, len: c.len - copied };
            mapped_copy(srcs, dst, dst_path, &rest, opts.progress)?;
        }
        sys::start_writeback(dst, c.dst_off, c.len);
        Ok::<(), Error>(())
    })?;
    let gathers: Vec<(usize, &Gather)> =
        plan.targets.iter().enumerate().flat_map(|(ti, t)| t.gathers.iter().map(move |g| (ti, g))).collect();
    gathers.par_iter().try_for_each(|(ti, g)| {
        let (p, f) = &temps.files[*ti];
        gather(srcs, g, f, p, opts.progress)
    })?;
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
            Ok(0) => return Err(crate::error::short_source(src_path, c.src_off + done)),
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
    srcs: &Sources,
    dst: &File,
    dst_path: &Path,
    c: &RangeCopy,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<()> {
    let mut done = 0;
    while done < c.len {
        let len = (c.len - done).min(WINDOW);
        let bytes = srcs.read(c.src, c.src_off + done, len)?;
        dst.write_all_at(bytes, c.dst_off + done).at(dst_path)?;
        srcs.release(c.src, c.src_off + done, len);
        done += len;
        if let Some(p) = progress {
            p(len);
        }
    }
    Ok(())
}

/// Refuses a plan that would write, replace or delete any file of its source: writing a
/// checkpoint over its own files would destroy them mid-read. Paths are compared after
/// resolving links.
fn refuse_overwriting_sources(plan: &Plan, members: &[PathBuf]) -> Result<()> {
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    let read: std::collections::HashSet<PathBuf> =
        members.iter().chain(&plan.protected).filter_map(|p| canon(p)).collect();
    let written =
        plan.targets.iter().map(|t| &t.path).chain(plan.stale.all()).chain(plan.trailers.iter().map(|(p, _)| p));
    for out in written {
        if canon(out).is_some_and(|c| read.contains(&c)) {
            return Err(Error::OutputIsSource { path: out.clone() });
        }
    }
    Ok(())
}

/// A previous checkpoint's files in `dir`: the names `managed` accepts, split into its commit
/// markers (`marker`: the index or metadata) and the rest.
pub(crate) fn stale_files(dir: &Path, managed: impl Fn(&str) -> bool, marker: impl Fn(&str) -> bool) -> Result<Stale> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Stale::default()),
        Err(e) => return Err(Error::Io { path: dir.to_path_buf(), source: e }),
    };
    let mut stale = Stale::default();
    for entry in entries {
        let entry = entry.at(dir)?;
        // A folder is nobody's shard: not ours to remove.
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        if managed(&name) {
            match marker(&name) {
                true => stale.markers.push(dir.join(name)),
                false => stale.files.push(dir.join(name)),
            }
        }
    }
    stale.markers.sort();
    stale.files.sort();
    Ok(stale)
}

fn remove_if_there(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::Io { path: path.to_path_buf(), source: e }),
    }
}

/// Writes `bytes` to `path` atomically: temp beside it, fsync, rename, fsync the folder.
fn write_atomic(path: &Path, bytes: &[u8], plan: &Plan) -> Result<()> {
    let mut temps = TempSet::default();
    temps.create(path)?;
    let (tmp, f) = &mut temps.files[0];
    let tmp = tmp.clone();
    f.write_all(bytes).at(&tmp)?;
    f.sync_all().at(&tmp)?;
    refuse_planted_link(path, plan)?;
    std::fs::rename(&tmp, path).at(path)?;
    temps.files.clear();
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    Ok(())
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
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
    /// Creates `.<name>.<random>.tmp` beside `target`, exclusively and without following a
    /// link: a name nobody can predict, and nothing planted there is ever written through. The
    /// leading dot and the `.tmp` suffix keep it from ever matching a checkpoint file name.
    fn create(&mut self, target: &Path) -> Result<()> {
        let name = file_name(target);
        let mut last = None;
        for _ in 0..8 {
            let tmp = target.with_file_name(format!(".{name}.{}.tmp", random_hex()));
            // Readable too: finishing a target may read back what was copied (torch CRCs).
            let opened = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .mode(0o644)
                .open(&tmp);
            match opened {
                Ok(f) => {
                    self.files.push((tmp, f));
                    return Ok(());
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some((tmp, e)),
                Err(e) => return Err(Error::Io { path: tmp, source: e }),
            }
        }
        let (path, source) = last.unwrap_or_else(|| (target.to_path_buf(), std::io::ErrorKind::AlreadyExists.into()));
        Err(Error::Io { path, source })
    }
}

impl Drop for TempSet {
    fn drop(&mut self) {
        for (p, _) in self.files.drain(..) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Copies `src` to the new file `dst` (which must not exist) and makes it durable: for
/// the world-size-independent files of a folder being built in a stage.
pub(crate) fn copy_durable(src: &Path, dst: &Path) -> Result<()> {
    let mut from = crate::io::open(src)?;
    let mut to = create_new(dst)?;
    std::io::copy(&mut from, &mut to).at(dst)?;
    to.sync_all().at(dst)
}

/// Creates the new file `path` for writing, refusing one that exists (or a link there).
pub(crate) fn create_new(path: &Path) -> Result<File> {
    OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).open(path).at(path)
}

/// Writes the small new file `path` (which must not exist) and makes it durable.
pub(crate) fn write_small(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut to = create_new(path)?;
    to.write_all(bytes).at(path)?;
    to.sync_all().at(path)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A one-tensor checkpoint to read from, written by the `safetensors` crate.
    fn source(dir: &Path) -> Checkpoint {
        let data = vec![7u8; 64];
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![64], &data).unwrap();
        let path = dir.join("src.safetensors");
        safetensors::serialize_to_file([("t", view)], None, &path).unwrap();
        Checkpoint::open(path.to_str().unwrap()).unwrap()
    }

    #[test]
    fn a_new_folder_appears_complete_or_not_at_all() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = source(tmp.path());
        let out = tmp.path().join("new/deeper");
        let mut plan = Plan::default();
        let mut good = TargetFile::new(out.join("a.bin"), b"head".to_vec(), 68);
        let (_, at) = ck.tensors()[0].location().unwrap();
        good.copies.push(RangeCopy { src: 0, src_off: at, dst_off: 4, len: 64 });
        // The second file reads past the end of its source: the copy fails midway.
        let mut bad = TargetFile::new(out.join("b.bin"), Vec::new(), 64);
        bad.copies.push(RangeCopy { src: 0, src_off: 1 << 20, dst_off: 0, len: 64 });
        plan.targets = vec![good, bad];
        plan.trailers.push((out.join("index.json"), b"{}".to_vec()));
        let err = execute(&plan, &ck, &WriteOptions::default()).unwrap_err();
        assert!(err.to_string().contains("while copying"), "{err}");
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("src.safetensors")], "no folder, no temporary left");

        // The same plan without the bad file: the folder appears whole.
        plan.targets.pop();
        execute(&plan, &ck, &WriteOptions::default()).unwrap();
        assert_eq!(std::fs::read(out.join("a.bin")).unwrap(), [b"head".as_slice(), &[7u8; 64]].concat());
        assert_eq!(std::fs::read(out.join("index.json")).unwrap(), b"{}");
        let mut names: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["a.bin", "index.json"].map(std::ffi::OsString::from));
    }

    #[test]
    fn temporaries_are_unpredictable_and_never_follow_a_link() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("x.bin");
        let mut a = TempSet::default();
        a.create(&target).unwrap();
        a.create(&target).unwrap();
        let (p0, p1) = (&a.files[0].0, &a.files[1].0);
        assert_ne!(p0, p1, "two temporaries of one target never share a name");
        let name = p0.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(".x.bin.") && name.ends_with(".tmp") && name.len() == ".x.bin.".len() + 16 + 4);
        drop(a);
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "dropped temporaries are removed");
    }
}
