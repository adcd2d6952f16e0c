//! Running a copy plan: on one process, or over the ranks of a [`crate::Job`].
//!
//! The plan's types, the copies and the staging folder are `write`'s; this is the protocol
//! around them. Every rank checks the plan and writes its share of it ([`crate::plan::shares`]),
//! and rank 0 commits once every share is durable. One process is the job of one rank: the
//! same steps, each agreement trivial.

use std::fs::{File, OpenOptions};
use std::hash::{Hash, Hasher};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::error::{Error, IoContext, Result};
use crate::plan::shares::Share;
use crate::read::catalog::Checkpoint;
use crate::read::crc_pass::PassCheck;
use crate::read::io::Sources;
use crate::write::fault::{self, Phase};
use crate::write::job::{agree, Job};
use crate::write::stage::Stage;
use crate::write::staged::is_temp_of;
use crate::write::sys;
use crate::write::{
    file_name, gather, kernel_copy, mapped_copy, refuse_overwriting_sources, refuse_planted_link, remove_if_there,
    retire, sync_dir, temp_name, write_atomic, CopyMethod, Gather, Plan, RangeCopy, Stale, TargetFile, TempSet,
    WriteOptions, PIECE,
};

/// Runs `plan`, reading from the files of `source`. On error, no target or temporary is left
/// behind and nothing that existed before is touched.
pub(crate) fn execute(plan: &Plan, source: &Checkpoint, opts: &WriteOptions<'_>) -> Result<()> {
    execute_from(plan, &Sources::of(source.files())?, source.members(), opts)
}

/// Runs `plan`, reading from `srcs` (open files, or the caller's memory: [`Sources::memory`]),
/// refusing to write, replace or delete any of `members` (the files the sources are part of)
/// or of the plan's protected files. As [`execute`] on error.
///
/// With [`WriteOptions::job`], every rank of the job runs this with the same plan and writes its
/// share of it ([`crate::plan::shares`]); rank 0 commits once every rank's part is durable. The
/// protocol, each step closed by an [`agree`]ment so that a failure anywhere stops everyone
/// before the commit:
/// 1. every rank checks the plan (sources, planted links) and its fingerprint against rank 0's;
///    rank 0 removes a killed run's leftovers, makes the staging folder and names the token
///    the temporaries are called by;
/// 2. each target's owner creates its temporary (sized, with its header);
/// 3. every rank fills its parts (checking the CRCs of what it reads) and fsyncs them;
/// 4. owners seal their targets (torch's CRCs), fsync them, and hash them for a manifest;
/// 5. rank 0 renames everything into place, the index last, exactly as one process does.
///
/// A rank that fails before it gets here (while planning) is heard in step 1's first exchange:
/// it ended the operation instead ([`Job::operation`]), and the others return
/// [`Error::OtherRank`].
pub(crate) fn execute_from(
    plan: &Plan,
    srcs: &Sources<'_>,
    members: &[PathBuf],
    opts: &WriteOptions<'_>,
) -> Result<()> {
    let solo = Job::solo();
    let job = opts.job.unwrap_or(&solo);
    let (rank, n) = (job.rank(), job.world_size());
    let shares = crate::plan::shares::deal(plan, n);
    job.record(plan, &shares);
    if job.is_dry_run() {
        return Ok(());
    }
    let mine = &shares[rank as usize];
    let at = plan.outputs().first().cloned().unwrap_or_default();
    fault::at(Phase::Plan, rank, &at)?;
    let manifest =
        plan.targets.first().and_then(|t| t.path.parent()).map(|d| d.join(crate::write::manifest::MANIFEST_NAME));
    let manifest = manifest.filter(|_| opts.checksums);
    let gathered = |bytes: Vec<u8>| job.exchange(&at, bytes);

    // 1. Checks on every rank (cheap, and the same everywhere); the stage from rank 0.
    let fingerprints = gathered(fingerprint(plan).to_le_bytes().to_vec())?;
    let checked =
        check(plan, members, manifest.as_ref()).and_then(|()| fault::at(Phase::Stage, rank, &at)).and_then(|()| {
            match fingerprints.iter().all(|f| *f == fingerprints[0]) || fingerprints[rank as usize] == fingerprints[0] {
                true => Ok(()),
                false => Err(Error::PlanMismatch { path: at.clone(), rank }),
            }
        });
    // A folder the plan creates (or replaces whole) is built under a temporary name and put in
    // place once everything in it is complete, so a failure or a kill never leaves half of one
    // behind (see `stage.rs`).
    let staged = match (rank, &checked) {
        (0, Ok(())) => Stage::new(plan, manifest.as_deref()).inspect(|s| sweep_leftovers(plan, s)),
        _ => Ok(Stage::default()),
    };
    let said = staged.as_ref().map(Stage::said).unwrap_or_default();
    let said = from_root(job, &at, said)?;
    let staged = agree(job, &at, checked.and(staged))?;
    let stage = if rank == 0 { staged } else { Stage::heard(&said) };
    let temp = |t: &TargetFile| temp_name(&stage.place(&t.path), &stage.token);

    // 2. Owners create their targets' temporaries: sized, with the header.
    let created = create_owned(plan, mine, &temp).and_then(|t| fault::at(Phase::Create, rank, &at).map(|()| t));
    let mut owned = agree(job, &at, created)?;

    // 3. Every rank fills its parts and makes them durable. One rank shows the whole job's
    // progress, from the blocks the temporaries hold, until every rank is done.
    let watched: Vec<PathBuf> = plan.targets.iter().map(&temp).collect();
    let progress = if n == 1 { opts.progress } else { None };
    watch_progress(n > 1 && rank == 0, opts.progress, &watched, plan, || {
        let filled = fill_share(plan, mine, &owned, &temp, srcs, opts.copy, progress);
        agree(job, &at, filled)
    })?;

    // 4. Owners seal, make durable and hash their targets.
    let sealed = seal_owned(plan, &owned, opts.checksums).and_then(|s| fault::at(Phase::Seal, rank, &at).map(|()| s));
    let sums = agree(job, &at, sealed)?;
    let sums = gathered(sums.iter().flat_map(|(ti, s)| format!("{ti} {s}\n").into_bytes()).collect())?;

    // 5. Rank 0 commits; every rank keeps its temporaries until it has renamed them (after a
    // failed commit, each removes those of its own still there).
    let committed = match rank {
        0 => fault::at(Phase::Commit, rank, &at).and_then(|()| commit(plan, &stage, opts, manifest, &sums)),
        _ => Ok(()),
    };
    let committed = agree(job, &at, committed);
    if committed.is_ok() {
        owned.forget();
    }
    committed
}

/// The checks every rank makes before anything is written: no source file is written, replaced
/// or deleted, and no output is a link someone planted (checked again at each rename, for links
/// planted while the plan runs).
fn check(plan: &Plan, members: &[PathBuf], manifest: Option<&PathBuf>) -> Result<()> {
    refuse_overwriting_sources(plan, members)?;
    // A manifest names plain files of its own folder: an output spread over folders would get
    // one listing bare names of files elsewhere, which no checker could find, so it is refused
    // before anything is written.
    if let Some(m) = manifest {
        if let Some(t) = plan.targets.iter().find(|t| t.path.parent() != m.parent()) {
            // Named under the manifest's folder where it is inside it (that folder may be a
            // staging folder's temporary name, which means nothing to the user).
            let folder = t.path.parent().unwrap_or(Path::new(""));
            let folder = m.parent().and_then(|d| folder.strip_prefix(d).ok()).unwrap_or(folder).to_path_buf();
            let misuse = crate::Misuse::ChecksumsSpanFolders { folder };
            return Err(Error::Misuse { path: m.parent().map(Path::to_path_buf).unwrap_or_default(), misuse });
        }
    }
    for out in plan.outputs().iter().chain(manifest) {
        refuse_planted_link(out, plan)?;
    }
    Ok(())
}

/// Step 2: the temporaries of the targets `mine` owns, sized, with their headers written.
fn create_owned(plan: &Plan, mine: &Share, temp: &dyn Fn(&TargetFile) -> PathBuf) -> Result<TempSet> {
    let mut temps = TempSet::default();
    for &ti in &mine.owned {
        let t = &plan.targets[ti];
        let path = temp(t);
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).at(dir)?;
        }
        let f = temps.create_at(path.clone(), ti)?;
        f.set_len(t.len).at(&path)?;
        f.write_all_at(&t.head, 0).at(&path)?;
    }
    Ok(temps)
}

/// Step 3: this rank's parts, written into the temporaries (its own, and the others' it shares a
/// range of), each CRC-covered record it reads checked as the copies pass its bytes or in parallel
/// pieces beside them (a
/// damaged source is refused before anything is committed); then fsynced.
fn fill_share(
    plan: &Plan,
    mine: &Share,
    owned: &TempSet,
    temp: &dyn Fn(&TargetFile) -> PathBuf,
    srcs: &Sources<'_>,
    copy: CopyMethod,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<()> {
    let mut files: Vec<Option<(PathBuf, File)>> = (0..plan.targets.len()).map(|_| None).collect();
    for (path, f, ti) in &owned.files {
        files[*ti] = Some((path.clone(), f.try_clone().at(path)?));
    }
    for p in &mine.parts {
        if files[p.target].is_some() {
            continue;
        }
        let path = temp(&plan.targets[p.target]);
        let f =
            OpenOptions::new().write(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(&path).at(&path)?;
        files[p.target] = Some((path, f));
    }
    let copies = mine.parts.iter().flat_map(|p| p.copies.iter().map(|c| (c.src, c.src_off, c.len)));
    let gathered = mine.parts.iter().flat_map(|p| p.gathers.iter().flat_map(|g| g.tensor.extents()));
    let copies: Vec<(usize, u64, u64)> = copies.collect();
    let pass = PassCheck::new(srcs, &copies)?;
    let rest = pass.rest(copies.iter().copied().chain(gathered));
    let (checked, copied) =
        rayon::join(|| srcs.check_extents(rest), || fill(mine, srcs, &files, copy, &pass, progress));
    checked?;
    pass.finish()?;
    copied?;
    files
        .par_iter()
        .flatten()
        .try_for_each(|(p, f)| f.sync_all().at(p).and_then(|()| fault::at(Phase::Fsync, mine.rank, p)))
}

/// Step 4: the owned targets sealed (torch's CRCs, from the bytes every rank wrote) and made
/// durable, and with `checksums` their SHA-256s, by target.
fn seal_owned(plan: &Plan, owned: &TempSet, checksums: bool) -> Result<Vec<(usize, String)>> {
    owned.files.par_iter().try_for_each(|(p, f, ti)| {
        if let Some(s) = &plan.targets[*ti].seal {
            s.seal(f, p)?;
            f.sync_all().at(p)?;
        }
        Ok::<(), Error>(())
    })?;
    if !checksums {
        return Ok(Vec::new());
    }
    owned.files.par_iter().map(|(p, _, ti)| Ok((*ti, crate::write::manifest::sha256_file(p)?))).collect()
}

/// Fills this rank's parts of the plan's targets (open in `files`, by target): the range
/// copies, then the gathers, each in parallel pieces.
fn fill(
    mine: &Share,
    srcs: &Sources<'_>,
    files: &[Option<(PathBuf, File)>],
    copy: CopyMethod,
    pass: &PassCheck<'_>,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<()> {
    let file = |ti: usize| -> Result<&(PathBuf, File)> {
        files[ti]
            .as_ref()
            .ok_or_else(|| Error::Io { path: PathBuf::new(), source: std::io::ErrorKind::NotFound.into() })
    };
    let parts = &mine.parts;
    let mut pieces = Vec::new();
    for p in parts {
        for c in &p.copies {
            let mut done = 0;
            while done < c.len {
                let len = (c.len - done).min(PIECE);
                pieces.push((
                    p.target,
                    RangeCopy { src: c.src, src_off: c.src_off + done, dst_off: c.dst_off + done, len },
                ));
                done += len;
            }
        }
    }
    let kernel_ok = AtomicBool::new(copy == CopyMethod::Auto);
    pieces.par_iter().try_for_each(|(ti, c)| {
        let (dst_path, dst) = file(*ti)?;
        fault::at(Phase::Copy, mine.rank, dst_path)?;
        if pass.copy(dst, dst_path, c, progress)? {
            sys::start_writeback(dst, c.dst_off, c.len);
            return Ok(());
        }
        // Bytes held in memory (a torch file's numpy arrays, the caller's buffers) are not in a
        // file: written from where they are.
        let copied = if kernel_ok.load(Ordering::Relaxed) && !srcs.in_memory(c.src, c.src_off) {
            let (src, src_path) = srcs.file(c.src)?;
            kernel_copy(src, src_path, dst, dst_path, c, &kernel_ok)?
        } else {
            0
        };
        if let (Some(p), true) = (progress, copied > 0) {
            p(copied);
        }
        if copied < c.len {
            let rest =
                RangeCopy { src: c.src, src_off: c.src_off + copied, dst_off: c.dst_off + copied, len: c.len - copied };
            mapped_copy(srcs, dst, dst_path, &rest, progress)?;
        }
        sys::start_writeback(dst, c.dst_off, c.len);
        Ok::<(), Error>(())
    })?;
    let gathers: Vec<(usize, &Gather)> =
        parts.iter().flat_map(|p| p.gathers.iter().map(move |g| (p.target, g))).collect();
    gathers.par_iter().try_for_each(|(ti, g)| {
        let (p, f) = file(*ti)?;
        gather(srcs, g, f, p, progress)
    })?;
    Ok(())
}

/// Rank 0's commit: the manifest, then everything renamed into place, the index last (see the
/// module docs); `sums` are every rank's `"{target} {sha256}"` lines.
fn commit(
    plan: &Plan,
    stage: &Stage,
    opts: &WriteOptions<'_>,
    manifest: Option<PathBuf>,
    sums: &[Vec<u8>],
) -> Result<()> {
    let mut trailers = plan.trailers.clone();
    if opts.checksums {
        let mut by_target: Vec<(usize, String)> = sums
            .iter()
            .flat_map(|s| String::from_utf8_lossy(s).lines().map(str::to_owned).collect::<Vec<_>>())
            .filter_map(|l| l.split_once(' ').and_then(|(t, s)| Some((t.parse().ok()?, s.to_owned()))))
            .collect();
        by_target.sort();
        let sums: Vec<(String, String)> =
            by_target.into_iter().map(|(ti, s)| (file_name(&plan.targets[ti].path), s)).collect();
        let path = manifest.unwrap_or_else(|| PathBuf::from(crate::write::manifest::MANIFEST_NAME));
        // The manifest goes before the index: the index stays the last thing written.
        trailers.insert(0, (path, crate::write::manifest::render(&sums).into_bytes()));
    }

    // A previous checkpoint in the output folder stays whole until the new index replaces its
    // index in one rename, and its files that nothing replaced go last. Its index goes first
    // only where it could otherwise describe a mixed set: when a new file takes the name of one
    // of its files, or when no new index replaces it (a sharded set becoming one file). A kill
    // then leaves no index rather than a wrong one.
    // A folder replaced whole takes the previous checkpoint with it: none of its files is
    // touched before the swap, nor removed by name after it.
    let placed: std::collections::HashSet<PathBuf> = plan.targets.iter().map(|t| stage.place(&t.path)).collect();
    let replaced: std::collections::HashSet<&PathBuf> = trailers.iter().map(|(p, _)| p).collect();
    let gone = Stale::default();
    let stale = if stage.replaces() { &gone } else { &plan.stale };
    let collides = stale.files.iter().any(|f| placed.contains(f));
    for m in stale.markers.iter().filter(|m| collides || !replaced.contains(m)) {
        remove_if_there(m)?;
    }
    for t in &plan.targets {
        let path = stage.place(&t.path);
        refuse_planted_link(&path, plan)?;
        std::fs::rename(temp_name(&path, &stage.token), &path).at(&path)?;
    }
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
    stage.commit_ref()?;
    for (path, bytes) in outside {
        write_atomic(path, bytes, plan)?;
    }
    // The window between the index and this is what `write.rs`'s module docs discuss.
    retire(stale.files.iter().filter(|f| !placed.contains(*f)), &stage.token)
}

/// Removes what a killed run of this plan left behind: temporaries of its targets and trailers,
/// and staging folders of its new folder. Only names of ours for exactly these outputs.
fn sweep_leftovers(plan: &Plan, stage: &Stage) {
    let mut outs: Vec<PathBuf> = plan.outputs();
    if let Some((dir, _)) = &stage.dirs {
        outs.push(dir.clone());
    }
    // The folder a previous run swapped out may be left beside the targets' folder even when
    // this run writes in place (something unmanaged appeared in it since). Not for a named
    // file: nothing outside its own folder is ours to touch.
    let folder = plan.targets.first().and_then(|t| t.path.parent()).filter(|d| !d.as_os_str().is_empty());
    let folder = folder.filter(|_| !plan.writes_named_file());
    if let Some(folder) = folder.filter(|f| plan.targets.iter().all(|t| t.path.parent() == Some(*f))) {
        if !outs.iter().any(|o| o == folder) && folder.file_name().is_some() {
            outs.push(folder.to_path_buf());
        }
    }
    for out in outs {
        let (Some(dir), name) = (out.parent(), file_name(&out)) else { continue };
        let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        for e in entries.flatten() {
            let found = e.file_name().to_string_lossy().into_owned();
            if !is_temp_of(&found, &name) || stage.dirs.as_ref().is_some_and(|(_, tmp)| *tmp == e.path()) {
                continue;
            }
            let _ = match e.file_type().is_ok_and(|t| t.is_dir()) {
                true => std::fs::remove_dir_all(e.path()),
                false => std::fs::remove_file(e.path()),
            };
        }
    }
}

/// Runs `work`; meanwhile, when `on`, calls `progress` with the bytes the temporaries at
/// `paths` have gained (their allocated blocks: the whole job's, whichever rank wrote them, the
/// owners' headers included: other ranks may be writing before this one looks first).
fn watch_progress<T>(
    on: bool,
    progress: Option<&(dyn Fn(u64) + Sync)>,
    paths: &[PathBuf],
    plan: &Plan,
    work: impl FnOnce() -> T,
) -> T {
    let Some(progress) = progress.filter(|_| on) else { return work() };
    use std::os::unix::fs::MetadataExt;
    let total: u64 = plan.targets.iter().map(|t| t.len).sum();
    let held = || paths.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.blocks() * 512).sum::<u64>();
    let done = AtomicBool::new(false);
    let shown = std::sync::atomic::AtomicU64::new(0);
    let out = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let now = held().min(total);
                let before = shown.fetch_max(now, Ordering::Relaxed);
                if now > before {
                    progress(now - before);
                }
            }
        });
        let out = work();
        done.store(true, Ordering::Relaxed);
        out
    });
    // What the last poll did not see (a short job ends before the first).
    let now = held().min(total);
    let shown = shown.load(Ordering::Relaxed);
    if now > shown {
        progress(now - shown);
    }
    out
}

/// A fingerprint of what a plan's ranks write: the same on every rank that planned the same
/// output.
/// (std's `DefaultHasher` has fixed keys, so every process of one build agrees.)
pub(crate) fn fingerprint(plan: &Plan) -> u64 {
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    for t in &plan.targets {
        t.path.hash(&mut h);
        t.len.hash(&mut h);
        t.head.hash(&mut h);
        t.owner.hash(&mut h);
        for c in &t.copies {
            (c.src, c.src_off, c.dst_off, c.len).hash(&mut h);
        }
        for g in &t.gathers {
            (&g.tensor.name, g.to.torch_name(), g.dst_off, &g.range, g.compute.is_some()).hash(&mut h);
        }
    }
    // Trailers by name only: rank 0 writes them, and some carry a fresh id (DCP's `save_id`).
    for (p, _) in &plan.trailers {
        p.hash(&mut h);
    }
    plan.stale.markers.hash(&mut h);
    plan.stale.files.hash(&mut h);
    h.finish()
}

/// [`Stage::folder`] for a job: rank 0 makes the staging folder of the new folder `dir` and the
/// other ranks are told its name (only rank 0 removes or commits it).
pub(crate) fn stage_folder(job: Option<&Job<'_>>, dir: &Path) -> Result<Stage> {
    let Some(job) = job.filter(|j| j.world_size() > 1) else { return Stage::folder(dir) };
    let made = if job.rank() == 0 { Stage::folder(dir) } else { Ok(Stage::default()) };
    let said = made.as_ref().map(Stage::said).unwrap_or_default();
    let said = from_root(job, dir, said)?;
    let made = agree(job, dir, made)?;
    Ok(if job.rank() == 0 { made } else { Stage::heard(&said) })
}

/// Rank 0's `said` on every rank (the others' is not read). An exchange rather than a broadcast,
/// so that a rank that left the operation instead is heard ([`Job::exchange`]).
fn from_root(job: &Job<'_>, at: &Path, said: Vec<u8>) -> Result<Vec<u8>> {
    let said = if job.rank() == 0 { said } else { Vec::new() };
    Ok(job.exchange(at, said)?.into_iter().next().unwrap_or_default())
}

/// Runs `f` on rank 0 only (one process's file work between two plans: renames, small files,
/// the commit of a staged folder), and has every rank return whether it succeeded.
pub(crate) fn on_root(job: Option<&Job<'_>>, at: &Path, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let Some(job) = job.filter(|j| j.world_size() > 1) else { return f() };
    let done = if job.rank() == 0 { f() } else { Ok(()) };
    agree(job, at, done)
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
    fn a_named_file_lands_by_one_rename_and_a_failure_takes_back_the_folders_it_made() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = source(tmp.path());
        let out = tmp.path().join("new/deeper/m.bin");
        let (_, at) = ck.tensors()[0].location().unwrap();
        let file = |src_off: u64| {
            let mut t = TargetFile::new(out.clone(), Vec::new(), 64);
            t.copies.push(RangeCopy { src: 0, src_off, dst_off: 0, len: 64 });
            Plan { targets: vec![t], named: vec![out.clone()], ..Plan::default() }
        };
        // Reading past the end of the source fails midway: the folders made for it go too.
        let err = execute(&file(1 << 20), &ck, &WriteOptions::default()).unwrap_err();
        assert!(err.to_string().contains("while copying"), "{err}");
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("src.safetensors")], "no folder, no temporary left");

        execute(&file(at), &ck, &WriteOptions::default()).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), [7u8; 64]);
        let mut left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, ["new", "src.safetensors"].map(std::ffi::OsString::from), "nothing staged beside");
    }
}
