//! Committing a whole folder: built under a temporary name beside its place, made durable,
//! renamed into place, and only then named by a link such as `latest`.
//!
//! The one way a folder is staged: the plan executor's stage (`stage.rs`: a new folder, or a
//! checkpoint's folder replaced whole; every output, [`crate::save_sharded`]'s included) builds
//! on it, and it is open to callers that fill a folder piece by piece themselves (a training
//! loop's `step-N/`).

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};
use crate::write::{random_hex, sync_dir, temp_name};

/// A folder being built under a temporary name beside `target`; removed with everything in it
/// when dropped uncommitted.
///
/// # The protocol, and why no kill loses the link
///
/// 1. [`StagedFolder::new`] creates `.<name>.<random>.tmp` beside the target: 64 random bits
///    from the kernel, created exclusively (nothing planted there is written through), a name
///    that no reader mistakes for a checkpoint.
/// 2. The caller fills it. [`StagedFolder::commit`] fsyncs every file and folder in it.
/// 3. The temporary takes the target's name. When no folder has that name, one `rename`.
///    When one does (a training run saving again a step it resumed from), the two are swapped
///    with `renameat2(RENAME_EXCHANGE)`: the target name goes from the old complete folder to
///    the new complete one in one step, and the old one is left under the temporary name.
/// 4. The link is made under a temporary name and renamed over the old one (one step again).
/// 5. The old folder, if any, is removed; a kill before that leaves it under its temporary
///    name, for [`StagedFolder::sweep`].
///
/// A folder appears under a committed name only by the rename of a complete, durable
/// temporary, and disappears from it only by a rename ([`StagedFolder::discard`]), so a
/// committed name never holds a partial folder. Each step that changes what the link resolves
/// to is one rename, and the parent folder is fsynced after each, so they reach the disk in
/// order: at every moment the link names the previous complete folder or the new one.
///
/// Where the filesystem cannot swap (NFS, an old kernel), replacing a folder takes two renames
/// (old away, new in), between which the name is missing. If the link names that folder, it is
/// first pointed at `interim`, another complete folder the caller gives (the previous
/// checkpoint), and back once the new folder is in place; without an interim the commit is
/// refused and the old folder stays, rather than leave a moment where the link dangles.
///
/// ```no_run
/// let stage = ckpt::StagedFolder::new("run/step-0000040")?;
/// stage.write_file("state.json", b"{}")?;
/// stage.commit_and_link("latest", None)?; // run/latest -> step-0000040
/// # Ok::<(), ckpt::Error>(())
/// ```
#[derive(Debug)]
pub struct StagedFolder {
    target: PathBuf,
    /// `None` once committed.
    tmp: Option<PathBuf>,
}

impl StagedFolder {
    /// Creates the temporary folder beside `target` (and `target`'s parent if missing).
    /// `target` may exist: committing replaces it whole.
    pub fn new(target: impl AsRef<Path>) -> Result<StagedFolder> {
        let target = target.as_ref().to_path_buf();
        let Some(name) = target.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            let source = std::io::Error::new(std::io::ErrorKind::InvalidInput, "names no folder");
            return Err(Error::Io { path: target, source });
        };
        let parent = parent_of(&target);
        std::fs::create_dir_all(parent).at(parent)?;
        let tmp = fresh_temp(parent, &name);
        std::fs::create_dir(&tmp).at(&tmp)?;
        Ok(StagedFolder { target, tmp: Some(tmp) })
    }

    /// The temporary folder, to fill.
    pub fn path(&self) -> &Path {
        self.tmp.as_deref().unwrap_or(&self.target)
    }

    /// The folder's final path.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Writes the new file `name` inside the folder (refusing one that exists, or a link there)
    /// and makes it durable. Returns its path in the temporary folder.
    pub fn write_file(&self, name: &str, bytes: &[u8]) -> Result<PathBuf> {
        let path = self.path().join(name);
        crate::write::write_small(&path, bytes)?;
        Ok(path)
    }

    /// Makes everything inside durable and renames the folder into place, replacing a folder
    /// of the same name whole (see the type's doc). Returns the final path.
    pub fn commit(self) -> Result<PathBuf> {
        self.commit_inner(None, true)
    }

    /// [`commit`](Self::commit), then points the link `link` (a name beside the folder) at
    /// it, replacing the link in one rename. `interim` (a complete folder beside it) is what
    /// the link names meanwhile where the filesystem cannot swap folders and the link names
    /// the folder being replaced; see the type's doc.
    pub fn commit_and_link(self, link: &str, interim: Option<&str>) -> Result<PathBuf> {
        self.commit_inner(Some((link, interim)), true)
    }

    /// [`commit`](Self::commit) of a folder that must be new: refused, and the stage removed,
    /// when something took the target's name meanwhile.
    pub(crate) fn commit_new(self) -> Result<PathBuf> {
        if std::fs::symlink_metadata(&self.target).is_ok() {
            return Err(Error::Io {
                path: self.target.clone(),
                source: std::io::Error::new(std::io::ErrorKind::AlreadyExists, "appeared while the output was written"),
            });
        }
        self.commit_inner(None, true)
    }

    /// Whether this filesystem swaps folders in one step: asked by swapping the (empty) stage
    /// with another empty temporary of ours beside it, which is then removed (a kill meanwhile
    /// leaves it for [`StagedFolder::sweep`]).
    pub(crate) fn can_swap(&self) -> bool {
        let Some(tmp) = &self.tmp else { return false };
        let probe = fresh_temp(parent_of(&self.target), &file_name(&self.target));
        if std::fs::create_dir(&probe).is_err() {
            return false;
        }
        let swapped = crate::write::sys::exchange(tmp, &probe).is_ok();
        let _ = std::fs::remove_dir(&probe);
        swapped
    }

    fn commit_inner(mut self, link: Option<(&str, Option<&str>)>, swap: bool) -> Result<PathBuf> {
        let tmp = self.tmp.clone().unwrap_or_else(|| self.target.clone());
        sync_tree(&tmp)?;
        let parent = parent_of(&self.target).to_path_buf();
        let name = file_name(&self.target);
        let old = match std::fs::symlink_metadata(&self.target) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::rename(&tmp, &self.target).at(&self.target)?;
                None
            }
            Err(e) => return Err(Error::Io { path: self.target.clone(), source: e }),
            Ok(m) if !m.file_type().is_dir() => {
                let source =
                    std::io::Error::new(std::io::ErrorKind::AlreadyExists, "not a folder; refusing to replace it");
                return Err(Error::Io { path: self.target.clone(), source });
            }
            Ok(_) => Some(self.replace(&tmp, link, swap)?),
        };
        self.tmp = None;
        sync_dir(&parent)?;
        if let Some((link, _)) = link {
            point(&parent, link, &name)?;
        }
        // Committed: the old folder is only a leftover now, which `sweep` finds if this fails.
        if let Some(old) = old {
            let _ = std::fs::remove_dir_all(old);
        }
        Ok(self.target.clone())
    }

    /// Puts `tmp` in place of the existing folder `target`; returns where the old one went.
    fn replace(&self, tmp: &Path, link: Option<(&str, Option<&str>)>, swap: bool) -> Result<PathBuf> {
        let parent = parent_of(&self.target);
        let name = file_name(&self.target);
        if swap {
            match crate::write::sys::exchange(tmp, &self.target) {
                Ok(()) => return Ok(tmp.to_path_buf()),
                Err(e) if crate::write::sys::exchange_unsupported(&e) => {}
                Err(e) => return Err(Error::Io { path: self.target.clone(), source: e }),
            }
        }
        if let Some((link, interim)) = link {
            let names_target = std::fs::read_link(parent.join(link)).is_ok_and(|t| t == Path::new(&name));
            if names_target {
                let interim = interim.filter(|i| *i != name && parent.join(i).is_dir()).ok_or_else(|| {
                    let why = format!(
                        "`{link}` names this folder, the filesystem cannot swap folders in one step, and no \
                         other complete folder was given for `{link}` to name meanwhile; refusing to replace it"
                    );
                    Error::Io {
                        path: self.target.clone(),
                        source: std::io::Error::new(std::io::ErrorKind::Unsupported, why),
                    }
                })?;
                point(parent, link, interim)?;
            }
        }
        let old = fresh_temp(parent, &name);
        std::fs::rename(&self.target, &old).at(&self.target)?;
        if let Err(e) = std::fs::rename(tmp, &self.target) {
            // Put the old folder back rather than leave the name empty.
            let _ = std::fs::rename(&old, &self.target);
            return Err(Error::Io { path: self.target.clone(), source: e });
        }
        Ok(old)
    }

    /// Removes the committed folder `dir` so that it never appears partial under its name:
    /// renamed to a temporary name first (one step), then deleted.
    pub fn discard(dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let trash = fresh_temp(parent_of(dir), &file_name(dir));
        std::fs::rename(dir, &trash).at(dir)?;
        sync_dir(parent_of(dir))?;
        std::fs::remove_dir_all(&trash).at(&trash)
    }

    /// Removes what killed stages of folders named `prefix…` left in `parent` (their
    /// temporaries, and folders a commit replaced but did not get to delete). Call it only
    /// while no such stage is being built. Returns the removed paths.
    pub fn sweep(parent: impl AsRef<Path>, prefix: &str) -> Result<Vec<PathBuf>> {
        let parent = parent.as_ref();
        let mut removed = Vec::new();
        for entry in std::fs::read_dir(parent).at(parent)? {
            let entry = entry.at(parent)?;
            let n = entry.file_name().to_string_lossy().into_owned();
            let ours = n.strip_prefix('.').is_some_and(|r| r.starts_with(prefix)) && n.ends_with(".tmp");
            // A link is nobody's stage (stages are made with `create_dir`): never followed.
            if ours && entry.file_type().at(entry.path())?.is_dir() {
                std::fs::remove_dir_all(entry.path()).at(entry.path())?;
                removed.push(entry.path());
            }
        }
        Ok(removed)
    }
}

impl Drop for StagedFolder {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            let _ = std::fs::remove_dir_all(tmp);
        }
    }
}

/// Points the link `parent/link` at `target`: a new link under a temporary name, renamed over
/// the old one, then the folder fsynced.
fn point(parent: &Path, link: &str, target: &str) -> Result<()> {
    let tmp = fresh_temp(parent, link);
    std::os::unix::fs::symlink(target, &tmp).at(&tmp)?;
    if let Err(e) = std::fs::rename(&tmp, parent.join(link)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::Io { path: parent.join(link), source: e });
    }
    sync_dir(parent)
}

/// Fsyncs every regular file and folder under `dir` (links are not followed), `dir` last.
fn sync_tree(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).at(dir)? {
        let entry = entry.at(dir)?;
        let path = entry.path();
        let kind = entry.file_type().at(&path)?;
        if kind.is_dir() {
            sync_tree(&path)?;
        } else if kind.is_file() {
            File::open(&path).and_then(|f| f.sync_all()).at(&path)?;
        }
    }
    sync_dir(dir)
}

/// Whether `name` is a temporary of ours for `target` (`.<target>.<16 hex>.tmp`): a staged
/// folder, a folder a swap replaced, or a file being written.
pub(crate) fn is_temp_of(name: &str, target: &str) -> bool {
    let Some(rest) = name.strip_prefix('.').and_then(|n| n.strip_prefix(target)) else { return false };
    let Some(hex) = rest.strip_prefix('.').and_then(|r| r.strip_suffix(".tmp")) else { return false };
    hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A new temporary name for `name` in `parent`, in `temp_name`'s form with a fresh token: what
/// `is_temp_of` and [`StagedFolder::sweep`] recognise.
fn fresh_temp(parent: &Path, name: &str) -> PathBuf {
    temp_name(&parent.join(name), &random_hex())
}

fn parent_of(p: &Path) -> &Path {
    p.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
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

    fn staged(target: &Path, content: &[u8]) -> StagedFolder {
        let s = StagedFolder::new(target).unwrap();
        std::fs::create_dir(s.path().join("sub")).unwrap();
        s.write_file("a.json", content).unwrap();
        s
    }

    #[test]
    fn a_new_folder_appears_whole_and_the_link_follows() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("step-1");
        let s = staged(&target, b"one");
        let t = s.path().to_path_buf();
        let name = t.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(".step-1.") && name.ends_with(".tmp") && name.len() == ".step-1.".len() + 20);
        assert!(!target.exists());
        assert_eq!(s.commit_and_link("latest", None).unwrap(), target);
        assert_eq!(std::fs::read(tmp.path().join("latest/a.json")).unwrap(), b"one");
        assert_eq!(std::fs::read_link(tmp.path().join("latest")).unwrap(), Path::new("step-1"));
        assert_eq!(names(tmp.path()), ["latest", "step-1"]);
    }

    #[test]
    fn a_dropped_stage_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        drop(staged(&tmp.path().join("step-1"), b"x"));
        assert!(names(tmp.path()).is_empty());
    }

    /// A re-save of the folder `latest` names: swapped in one step, or (where the filesystem
    /// cannot swap) with `latest` on the interim folder in between; `latest` always resolves.
    #[test]
    fn replacing_the_linked_folder_keeps_the_link_on_a_complete_folder() {
        for swap in [true, false] {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path();
            staged(&dir.join("step-1"), b"one").commit().unwrap();
            staged(&dir.join("step-2"), b"old").commit_and_link("latest", None).unwrap();
            staged(&dir.join("step-2"), b"new").commit_inner(Some(("latest", Some("step-1"))), swap).unwrap();
            assert_eq!(std::fs::read(dir.join("latest/a.json")).unwrap(), b"new", "swap: {swap}");
            assert_eq!(std::fs::read_link(dir.join("latest")).unwrap(), Path::new("step-2"));
            assert_eq!(names(dir), ["latest", "step-1", "step-2"], "swap: {swap}");
        }
    }

    #[test]
    fn without_a_swap_or_an_interim_the_linked_folder_is_not_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        staged(&dir.join("step-2"), b"old").commit_and_link("latest", None).unwrap();
        let err = staged(&dir.join("step-2"), b"new").commit_inner(Some(("latest", None)), false).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}: `latest` names this folder, the filesystem cannot swap folders in one step, and no other \
                 complete folder was given for `latest` to name meanwhile; refusing to replace it",
                dir.join("step-2").display()
            )
        );
        assert_eq!(std::fs::read(dir.join("latest/a.json")).unwrap(), b"old");
        assert_eq!(names(dir), ["latest", "step-2"], "the refused stage is removed");
        // A folder the link does not name is replaced without an interim.
        staged(&dir.join("step-3"), b"3").commit().unwrap();
        staged(&dir.join("step-3"), b"3 again").commit_inner(Some(("latest", None)), false).unwrap();
        assert_eq!(std::fs::read_link(dir.join("latest")).unwrap(), Path::new("step-3"));
        assert_eq!(std::fs::read(dir.join("latest/a.json")).unwrap(), b"3 again");
    }

    #[test]
    fn discard_and_sweep_remove_only_what_they_name() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        staged(&dir.join("step-1"), b"1").commit().unwrap();
        staged(&dir.join("step-2"), b"2").commit().unwrap();
        let left = staged(&dir.join("step-3"), b"3");
        let left_path = left.path().to_path_buf();
        std::mem::forget(left); // a killed stage
        std::os::unix::fs::symlink(dir.join("step-1"), dir.join(".step-9.planted.tmp")).unwrap();
        std::fs::create_dir(dir.join(".other.x.tmp")).unwrap();
        StagedFolder::discard(dir.join("step-1")).unwrap();
        assert_eq!(StagedFolder::sweep(dir, "step-").unwrap(), [left_path]);
        assert_eq!(names(dir), [".other.x.tmp", ".step-9.planted.tmp", "step-2"]);
    }

    #[test]
    fn a_file_or_link_in_the_folders_place_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("step-1"), b"x").unwrap();
        let err = staged(&tmp.path().join("step-1"), b"1").commit().unwrap_err();
        assert!(err.to_string().ends_with("step-1: not a folder; refusing to replace it"), "{err}");
        assert_eq!(names(tmp.path()), ["step-1"]);
    }
}
