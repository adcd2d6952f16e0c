//! Where a plan's outputs are built before they are committed: a [`Stage`].
//!
//! A file the user named (a merge or a convert into one file, with the optimizer's file beside
//! it) is written as a temporary in its own folder and renamed over its name: one rename is
//! atomic by itself, so nothing is staged, and nothing outside that folder is created, renamed
//! or removed. The folder keeps its inode, and the user needs write permission on it alone. A
//! missing folder on its path is made in place, and taken back if the write fails.
//!
//! A folder of outputs (a sharded set and its index, a DCP or Hugging Face folder) cannot be
//! replaced by one rename of a file, so two cases take the whole folder through a
//! [`StagedFolder`] beside it, so that a kill leaves the old folder or the new one and never a
//! mix:
//!
//! - the outputs go into a folder that does not exist yet: it is built under a temporary name
//!   and renamed into place once complete;
//! - the outputs replace a previous checkpoint in a folder that holds nothing else (a resplit,
//!   a merge into the same shards folder): the new set is built in a staged folder and swapped
//!   in with `renameat2(RENAME_EXCHANGE)`, then the old folder is removed. A kill before the
//!   swap leaves the old folder whole, after it the new one; the swapped-out old folder, left
//!   under its temporary name by a kill right after the swap, is swept by the next run.
//!
//! A folder that also holds anything the plan does not manage (a user's notes, a subfolder,
//! the source itself) is not swapped: its other entries would have to be moved or copied into
//! the new folder, and a run killed mid-move could then lose a file that was never ours, while
//! copying arbitrary content is neither cheap nor ours to decide. Such a folder, a link to a
//! folder, a mount point, and a filesystem that cannot swap keep the in-place commit: the new
//! files renamed in, the index last, the old set's leftovers removed after (see `write.rs`).
//!
//! Otherwise the outputs are written in place, under temporary names of their own. Every
//! temporary is named by one token of 64 random bits from rank 0, which every rank hears.

use std::cell::Cell;
use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};
use crate::write::staged::{is_temp_of, StagedFolder};
use crate::write::{file_name, random_hex, Plan};

/// The folder a plan's outputs are staged in, if any, and the token the plan's temporaries are
/// named by.
#[derive(Default)]
pub(crate) struct Stage {
    /// `(final, temporary)`; `None` when the outputs are written in place.
    pub(crate) dirs: Option<(PathBuf, PathBuf)>,
    /// 64 random bits as hex: the temporaries' names.
    pub(crate) token: String,
    /// The staged folder on the rank that made it (rank 0), removed unless committed; `None`
    /// on the ranks that only heard of it and once committed.
    folder: Cell<Option<StagedFolder>>,
    /// Whether committing replaces an existing folder whole (swapped in).
    replaces: bool,
    /// Folders a named file's path lacked, made in place on the rank that made the stage and
    /// removed unless committed.
    made: Cell<Vec<durable::NewFolders>>,
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage").field("dirs", &self.dirs).field("replaces", &self.replaces).finish()
    }
}

impl Stage {
    /// The one topmost missing folder that holds every output, made under a temporary name; or
    /// else the existing folder of a checkpoint the plan replaces whole, where it can be swapped
    /// (see the module docs); or else no folder. `manifest` is a file the commit adds beside
    /// the targets (a `SHA256SUMS`), which the plan manages too.
    pub(crate) fn new(plan: &Plan, manifest: Option<&Path>) -> Result<Stage> {
        let token = random_hex();
        if plan.writes_named_file() {
            return Stage::in_own_folder(plan, token);
        }
        if let Some(dir) = missing_folder(plan) {
            return Stage::make(&dir, token, false);
        }
        if let Some(dir) = replaceable_folder(plan, manifest) {
            let stage = Stage::make(&dir, token.clone(), true)?;
            if stage.can_swap() {
                return Ok(stage);
            }
        }
        Ok(Stage { token, ..Stage::default() })
    }

    fn make(dir: &Path, token: String, replaces: bool) -> Result<Stage> {
        let folder = StagedFolder::new(dir)?;
        let dirs = Some((dir.to_path_buf(), folder.path().to_path_buf()));
        Ok(Stage { dirs, token, folder: Cell::new(Some(folder)), replaces, ..Stage::default() })
    }

    /// No staging for a named file: the folders of its outputs (the optimizer's file goes
    /// beside it) are made where they are missing, before any rank creates a temporary there.
    fn in_own_folder(plan: &Plan, token: String) -> Result<Stage> {
        let mut dirs: Vec<PathBuf> = plan.outputs().iter().filter_map(|p| p.parent().map(Path::to_path_buf)).collect();
        dirs.sort();
        dirs.dedup();
        let made = dirs
            .iter()
            .map(|d| durable::NewFolders::make(d).map_err(crate::read::io::fs_error))
            .collect::<Result<_>>()?;
        Ok(Stage { token, made: Cell::new(made), ..Stage::default() })
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
        Stage::make(dir, random_hex(), false)
    }

    /// Whether the staged folder can be swapped with the folder it replaces: the filesystem is
    /// asked with a swap of two empty temporaries of ours, so nothing of the user's ever moves
    /// in the asking. The folder's permissions are carried over meanwhile.
    fn can_swap(&self) -> bool {
        let (Some((dir, _)), Some(folder)) = (&self.dirs, self.folder.take()) else { return false };
        let ok = folder.can_swap()
            && std::fs::metadata(dir).is_ok_and(|m| std::fs::set_permissions(folder.path(), m.permissions()).is_ok());
        self.folder.set(Some(folder));
        ok
    }

    /// Whether committing replaces an existing folder whole: the previous checkpoint's files go
    /// with it, and nothing of them is removed by name.
    pub(crate) fn replaces(&self) -> bool {
        self.replaces
    }

    /// What the other ranks need to know of this stage: the token, and the folders.
    pub(crate) fn said(&self) -> Vec<u8> {
        use std::os::unix::ffi::OsStrExt;
        let mut b = self.token.clone().into_bytes();
        if let Some((dir, tmp)) = &self.dirs {
            for p in [dir, tmp] {
                b.push(0);
                b.extend_from_slice(p.as_os_str().as_bytes());
            }
        }
        b
    }

    /// The stage rank 0 [`said`](Stage::said), on another rank (which neither removes nor
    /// commits it).
    pub(crate) fn heard(said: &[u8]) -> Stage {
        use std::os::unix::ffi::OsStrExt;
        let mut parts = said.split(|&b| b == 0);
        let token = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
        let path = |b: &[u8]| PathBuf::from(std::ffi::OsStr::from_bytes(b));
        let dirs = match (parts.next(), parts.next()) {
            (Some(d), Some(t)) => Some((path(d), path(t))),
            _ => None,
        };
        Stage { dirs, token, ..Stage::default() }
    }

    /// The temporary folder, for a stage made by [`Stage::folder`].
    pub(crate) fn path(&self) -> &Path {
        self.dirs.as_ref().map_or(Path::new("."), |(_, tmp)| tmp.as_path())
    }

    pub(crate) fn contains(&self, path: &Path) -> bool {
        self.dirs.as_ref().is_some_and(|(dir, _)| path.starts_with(dir))
    }

    /// Where `path` is written while the plan runs.
    pub(crate) fn place(&self, path: &Path) -> PathBuf {
        match &self.dirs {
            Some((dir, tmp)) => path.strip_prefix(dir).map_or_else(|_| path.to_path_buf(), |rest| tmp.join(rest)),
            None => path.to_path_buf(),
        }
    }

    /// Commits the finished folder, on the rank that made it: renamed into place (refusing if
    /// something appeared there meanwhile), or swapped with the folder it replaces, which is
    /// then removed. Nothing on the other ranks.
    pub(crate) fn commit_ref(&self) -> Result<()> {
        self.made.take().into_iter().for_each(durable::NewFolders::keep);
        let Some(folder) = self.folder.take() else { return Ok(()) };
        match self.replaces {
            true => folder.commit(),
            false => folder.commit_new(),
        }
        .map(|_| ())
    }
}

/// The one topmost missing folder that holds every target (trailers outside it may follow),
/// if the outputs need exactly one.
fn missing_folder(plan: &Plan) -> Option<PathBuf> {
    let outputs = plan.targets.iter().map(|t| t.path.as_path()).chain(plan.trailers.iter().map(|(p, _)| p.as_path()));
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
            (Some(_), Some(_)) => return None,
        }
    }
    missing.filter(|m| plan.targets.iter().all(|t| t.path.starts_with(m)))
}

/// The existing folder every target goes into directly, when it is a real folder (not a link,
/// not a mount point) with a name, and holds nothing but files the plan writes or replaces and
/// temporaries of ours for them.
fn replaceable_folder(plan: &Plan, manifest: Option<&Path>) -> Option<PathBuf> {
    let dir = plan.targets.first()?.path.parent().filter(|d| !d.as_os_str().is_empty())?;
    if !plan.targets.iter().all(|t| t.path.parent() == Some(dir)) {
        return None;
    }
    if !matches!(dir.components().next_back(), Some(Component::Normal(_))) {
        return None;
    }
    let meta = std::fs::symlink_metadata(dir).ok().filter(|m| m.file_type().is_dir())?;
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if std::fs::metadata(parent).ok()?.dev() != meta.dev() {
        return None;
    }
    let ours: HashSet<PathBuf> =
        plan.outputs().into_iter().chain(plan.stale.all().cloned()).chain(manifest.map(Path::to_path_buf)).collect();
    let names: Vec<String> = ours.iter().map(|p| file_name(p)).collect();
    for entry in std::fs::read_dir(dir).ok()? {
        let entry = entry.ok()?;
        // A folder is never one of ours, whatever its name.
        if entry.file_type().ok()?.is_dir() {
            return None;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        if !ours.contains(&entry.path()) && !names.iter().any(|n| is_temp_of(&name, n)) {
            return None;
        }
    }
    Some(dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::write::TargetFile;

    /// A plan writing `new` into `dir` over a previous checkpoint made of `old`.
    fn plan(dir: &Path, new: &[&str], old: &[&str]) -> Plan {
        let targets = new.iter().map(|n| TargetFile::new(dir.join(n), Vec::new(), 0)).collect();
        let mut plan = Plan { targets, ..Plan::default() };
        plan.trailers.push((dir.join("index.json"), b"{}".to_vec()));
        plan.stale.markers.push(dir.join("index.json"));
        plan.stale.files = old.iter().map(|n| dir.join(n)).collect();
        plan
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn a_folder_of_only_the_previous_checkpoint_is_replaced_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        std::fs::create_dir(&dir).unwrap();
        for n in ["a-1-of-2", "a-2-of-2", "index.json", ".a.0123456789abcdef.tmp"] {
            std::fs::write(dir.join(n), b"old").unwrap();
        }
        let stage = Stage::new(&plan(&dir, &["a"], &["a-1-of-2", "a-2-of-2"]), None).unwrap();
        assert!(stage.replaces());
        let (_, staged) = stage.dirs.clone().unwrap();
        assert!(is_temp_of(&file_name(&staged), "out"), "{staged:?}");
        std::fs::write(stage.place(&dir.join("a")), b"new").unwrap();
        std::fs::write(stage.place(&dir.join("index.json")), b"{}").unwrap();
        // Until the commit the old folder is untouched, and the probe left nothing.
        assert_eq!(names(&dir), [".a.0123456789abcdef.tmp", "a-1-of-2", "a-2-of-2", "index.json"]);
        assert_eq!(names(tmp.path()).len(), 2);
        stage.commit_ref().unwrap();
        assert_eq!(names(&dir), ["a", "index.json"]);
        assert_eq!(names(tmp.path()), ["out"], "the swapped-out folder is removed");
    }

    #[test]
    fn a_folder_holding_anything_else_is_written_in_place() {
        for extra in ["notes.txt", "sub/"] {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("out");
            std::fs::create_dir(&dir).unwrap();
            std::fs::write(dir.join("a-1-of-2"), b"old").unwrap();
            match extra.strip_suffix('/') {
                Some(sub) => std::fs::create_dir(dir.join(sub)).unwrap(),
                None => std::fs::write(dir.join(extra), b"mine").unwrap(),
            }
            let stage = Stage::new(&plan(&dir, &["a"], &["a-1-of-2"]), None).unwrap();
            assert!(stage.dirs.is_none() && !stage.replaces(), "{extra}");
            assert_eq!(names(tmp.path()), ["out"], "{extra}: nothing staged");
        }
    }

    #[test]
    fn a_missing_folder_is_staged_new() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("new/deeper");
        let stage = Stage::new(&plan(&dir, &["a"], &[]), None).unwrap();
        assert!(!stage.replaces());
        assert_eq!(stage.dirs.as_ref().unwrap().0, tmp.path().join("new"));
        std::fs::create_dir_all(stage.place(&dir)).unwrap();
        std::fs::write(stage.place(&dir.join("a")), b"new").unwrap();
        stage.commit_ref().unwrap();
        assert_eq!(names(&dir), ["a"]);
        assert_eq!(names(tmp.path()), ["new"]);
    }
}
