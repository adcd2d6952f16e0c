//! Executing a copy plan: streaming, parallel, atomic.
//!
//! A plan is a list of target files, each an encoded header followed by range copies from source
//! files. Every target is written under a temporary name in its own folder, filled by kernel copies
//! (`copy_file_range`) or, where the kernel refuses, from a memory map in windows whose pages are
//! dropped once written; bytes whose CRC32 is still to be checked go through a buffer that is
//! hashed on the way (`crc_pass.rs`). Then each target is fsynced. Only when every target is
//! complete are the temporaries renamed into place, and the index written last with the same
//! temp-fsync-rename dance; a previous checkpoint's files that nothing replaced are retired after
//! that ([`retire`]). A `kill -9` at any point leaves the previous checkpoint or the new one, plus
//! at worst `.tmp` files of ours, which every reader and `verify` ignore and the next run removes.
//!
//! The previous set's extra shards cannot go before the index rename (the old checkpoint must stay
//! whole until then), and no single call removes several files, so a kill just after the rename
//! leaves some of them beside the committed set. That window is made as short as the filesystem
//! allows and harmless: once the index's rename is durable (its folder fsynced: a power loss must
//! not keep a shard's retirement and lose the index that stopped naming it), each is renamed to a
//! temporary of ours (a metadata update of microseconds, where an unlink frees the file's blocks
//! and can take long), and only then removed; a shard still under its own name is one the committed
//! index does not reference, so `verify` and every reader that goes by the index see only the new
//! set, and the next run into the folder counts it (and our temporaries of such names) as the
//! previous set's ([`stale_files`]).
//! One case cannot be atomic without replacing the whole folder: when new files take old files'
//! names (or a sharded set becomes one file), the old index is removed before the renames, so a
//! kill in between leaves no index, never an index that describes a mixed set. That is the path for
//! a folder that also holds files of others: a folder holding only the previous checkpoint is
//! replaced whole instead, by a swap (`stage.rs`).

pub(crate) mod claim;
pub(crate) mod execute;
pub(crate) mod fault;
pub(crate) mod job;
pub(crate) mod manifest;
pub(crate) mod stage;
pub(crate) mod staged;
pub(crate) mod sys;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, IoContext, Result};
use crate::map::cast::cast_into;
use crate::read::catalog::{TensorData, TensorInfo};
use crate::read::dtype::Dtype;
use crate::read::io::{fs_error, Sources};

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
    pub compute: Option<crate::map::blockscale::SharedCompute>,
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
    /// The one rank that can write this target, when its bytes are in that rank's memory alone
    /// (a rank's file of [`crate::save_sharded`]); `None`: any rank, as the plan is dealt.
    pub owner: Option<u64>,
}

impl TargetFile {
    pub(crate) fn new(path: PathBuf, head: Vec<u8>, len: u64) -> TargetFile {
        TargetFile { path, head, len, copies: Vec::new(), gathers: Vec::new(), seal: None, owner: None }
    }

    /// Places `tensor`, written as `to`, at `dst_off`: as range copies when its stored bytes
    /// are already what is written (no cast, at most one run per chunk), else as a gather.
    pub(crate) fn place(
        &mut self,
        tensor: &TensorInfo,
        to: Dtype,
        dst_off: u64,
        compute: Option<crate::map::blockscale::SharedCompute>,
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
    pub(crate) fn all(&self) -> impl Iterator<Item = &PathBuf> {
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

    /// Whether the user named a file as the output (not a folder): it is then replaced by one
    /// rename inside its own folder, never by staging a folder (`stage.rs`).
    pub(crate) fn writes_named_file(&self) -> bool {
        !self.named.is_empty()
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
#[derive(Clone, Default)]
pub struct WriteOptions<'a> {
    /// The ranks this operation runs over, each writing its share (see [`crate::Job`]); one
    /// process when `None`.
    pub job: Option<&'a crate::Job<'a>>,
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
            .field("job", &self.job)
            .finish()
    }
}

/// Copies are cut into pieces of at most this size so that one large tensor still spreads over
/// every thread and progress moves smoothly.
pub(crate) const PIECE: u64 = 64 << 20;
/// The user-space copy window: what one thread holds resident at most.
const WINDOW: u64 = 8 << 20;
/// What all gathering threads hold together at most: with many threads each window shrinks,
/// down to [`MIN_WINDOW`], so the peak stays near this whatever the machine.
const GATHER_BUDGET: u64 = 32 << 20;
const MIN_WINDOW: u64 = 1 << 20;
/// Runs at least this long are read into the window with `pread` (no mapped pages to hold or
/// drop); shorter ones, a strided view's elements, come from the map.
const PREAD_MIN: u64 = 1 << 10;

/// The temporary a target at `path` is written as: `.<name>.<token>.tmp` beside it. The token
/// is 64 random bits from rank 0 ([`random_hex`]), so every rank names it alike and nobody can
/// predict it.
pub(crate) use durable::{random_hex, temp_name};

/// Refuses to rename over a symlink the user did not name as the output: someone who can write
/// to the output folder could plant one there to make us replace a file elsewhere's name.
pub(crate) fn refuse_planted_link(path: &Path, plan: &Plan) -> Result<()> {
    let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if is_link && !plan.named.iter().any(|n| n == path) {
        return Err(Error::PlantedLink { path: path.to_path_buf() });
    }
    Ok(())
}

/// Reads a gathered tensor run by run into a bounded window, casts each full window and writes
/// it out; the source pages it touched are dropped as it goes.
pub(crate) fn gather(
    srcs: &Sources,
    g: &Gather,
    dst: &File,
    dst_path: &Path,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<()> {
    let t = &g.tensor;
    if let Some(c) = &g.compute {
        let mut at = g.dst_off;
        return crate::map::blockscale::run(srcs, t, g.to, c, |out| {
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

pub(crate) fn kernel_copy(
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

pub(crate) fn mapped_copy(
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
pub(crate) fn refuse_overwriting_sources(plan: &Plan, members: &[PathBuf]) -> Result<()> {
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
/// markers (`marker`: the index or metadata) and the rest, which also holds our temporaries of
/// such names.
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
        } else if temp_of(&name).is_some_and(&managed) {
            // A killed run's temporary of such a file (one it was writing, or retiring).
            stale.files.push(dir.join(name));
        }
    }
    stale.markers.sort();
    stale.files.sort();
    Ok(stale)
}

/// Retires a previous set's `files` that the committed set does not replace (see the module
/// docs): all renamed to temporaries of ours (named by `token`) first, then removed; one already
/// gone is no error.
pub(crate) fn retire<'a>(files: impl Iterator<Item = &'a PathBuf>, token: &str) -> Result<()> {
    let mut retired = Vec::new();
    for f in files {
        let tmp = temp_name(f, token);
        match std::fs::rename(f, &tmp) {
            Ok(()) => retired.push(tmp),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::Io { path: f.clone(), source: e }),
        }
    }
    retired.iter().try_for_each(|t| remove_if_there(t))
}

/// The name a temporary of ours (`.<name>.<16 hex>.tmp`, [`temp_name`]) stands for.
fn temp_of(name: &str) -> Option<&str> {
    let (inner, hex) = name.strip_prefix('.')?.strip_suffix(".tmp")?.rsplit_once('.')?;
    (hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(inner)
}

/// Removes the file `path`; one already gone is no error.
pub(crate) fn remove_if_there(path: &Path) -> Result<()> {
    durable::remove_if_there(path).map_err(fs_error)
}

/// Writes `bytes` to `path` atomically: temp beside it, fsync, rename, fsync the folder
/// (`durable`'s protocol), refusing to rename over a link the caller did not name.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], plan: &Plan) -> Result<()> {
    let pending = durable::AtomicWrite::prepare(path, bytes).map_err(fs_error)?;
    refuse_planted_link(path, plan)?;
    pending.commit().map_err(fs_error)
}

/// Makes the entries of `dir` durable (the empty path is the current folder).
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    durable::sync_dir(dir).map_err(fs_error)
}

pub(crate) fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Temporary files that are removed unless renamed into place, each with the index of the
/// target it becomes.
#[derive(Default)]
pub(crate) struct TempSet {
    pub(crate) files: Vec<(PathBuf, File, usize)>,
}

impl TempSet {
    /// Creates the temporary `path` (see [`temp_name`]) for target `target`, exclusively and
    /// without following a link: nothing planted there is ever written through.
    pub(crate) fn create_at(&mut self, path: PathBuf, target: usize) -> Result<&File> {
        // Readable too: finishing a target may read back what was copied (torch CRCs).
        let f = durable::create_temp(&path).map_err(fs_error)?;
        self.files.push((path, f, target));
        Ok(&self.files[self.files.len() - 1].1)
    }

    /// Keeps the files: they were renamed into place.
    pub(crate) fn forget(&mut self) {
        self.files.clear();
    }
}

impl Drop for TempSet {
    fn drop(&mut self) {
        for (p, ..) in self.files.drain(..) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Copies `src` to the new file `dst` (which must not exist) and makes it durable: for
/// the world-size-independent files of a folder being built in a stage.
pub(crate) fn copy_durable(src: &Path, dst: &Path) -> Result<()> {
    durable::copy_new(src, dst).map_err(fs_error)
}

/// Creates the new file `path` for writing, refusing one that exists (or a link there).
pub(crate) fn create_new(path: &Path) -> Result<File> {
    durable::create_new(path).map_err(fs_error)
}

/// Writes the small new file `path` (which must not exist) and makes it durable.
pub(crate) fn write_small(path: &Path, bytes: &[u8]) -> Result<()> {
    durable::write_new(path, bytes).map_err(fs_error)
}

/// Writes `dir`'s manifest of `files` (each in `dir`), hashing them as they are on disk now:
/// for an operation that wrote them in separate plans, whose own manifests would each list
/// only their plan's files. (Here rather than in `manifest`, which stays a leaf.)
pub(crate) fn write_manifest(dir: &Path, files: &[PathBuf]) -> Result<()> {
    let entries = files.iter().map(|f| Ok((file_name(f), manifest::sha256_file(f)?))).collect::<Result<Vec<_>>>()?;
    write_atomic(&dir.join(manifest::MANIFEST_NAME), manifest::render(&entries).as_bytes(), &Plan::default())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn a_killed_runs_temporaries_of_a_previous_sets_files_are_stale_and_retired_with_them() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let shard = "model-00001-of-00002.safetensors";
        let retiring = ".model-00002-of-00002.safetensors.0123456789abcdef.tmp";
        let index = "model.safetensors.index.json";
        // A user's file and its temporary, and a name that only looks like a temporary of ours.
        let others = ["notes.txt", ".notes.txt.0123456789abcdef.tmp", ".model-00001-of-00002.safetensors.ab.tmp"];
        for n in [shard, retiring, index].iter().chain(&others) {
            std::fs::write(dir.join(n), b"x").unwrap();
        }
        let stale = stale_files(dir, |n| n.starts_with("model"), |n| n.ends_with(".index.json")).unwrap();
        assert_eq!(stale.markers, [dir.join(index)]);
        assert_eq!(stale.files, [dir.join(retiring), dir.join(shard)]);

        retire(stale.files.iter(), "fedcba9876543210").unwrap();
        let mut left: Vec<String> = others.iter().map(|n| n.to_string()).chain([index.to_string()]).collect();
        left.sort();
        assert_eq!(names(dir), left, "the previous set's files gone, nothing else touched");
        // Retiring what is already gone (a rerun after a kill mid-way) is no error.
        retire(stale.files.iter(), "fedcba9876543210").unwrap();
    }
}
