//! One writer per destination: an advisory lock that two processes writing the same output
//! (two jobs, two Python processes, a launcher that started one process per rank of a build
//! without MPI) cannot both hold.
//!
//! The lock is a file beside the destination, `.<name>.lock`, in the destination's own parent
//! folder; a missing parent folder is made first (in place, and taken back when the lock goes
//! while it is still empty). The place depends on nothing but the name, so a run killed after it
//! made the folder and the next run lock the same file. It is held with `flock`, which the kernel
//! drops when its holder ends however it ends, so a lock file left by a killed process is simply
//! taken over: there is no staleness to guess from a pid or an age. The pid inside is for the
//! message the next writer is refused with, never for deciding anything.
//!
//! The file is created exclusively without following a link, or an existing one opened only
//! when it is a regular file, never through a link. Its holder removes it when it is done, while
//! still holding the lock; a process that opened the old file just before that takes a lock on
//! a file nobody will see again, so after locking it checks that the path still names the file
//! it holds, and starts over when it does not.
//!
//! The name never matches a temporary's (`.<name>.<16 hex>.tmp`), so no sweep of leftovers
//! removes a live lock.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, FileKind, Result};
use crate::folders::NewFolders;

/// The first line of every lock file; a file at the lock's name without it is somebody else's,
/// and is neither taken over nor removed.
const HEADER: &str = "statekit destination lock\n";

/// How many times the path may be replaced under us before we give up (each replacement is
/// another process finishing or starting: it settles within a few rounds).
const TRIES: usize = 16;

/// The lock file that guards `dest`: `.<name>.lock` in its parent folder; `None` when `dest`
/// names no file (`/`).
pub fn lock_path(dest: &Path) -> Option<PathBuf> {
    let dest = named(dest)?;
    let mut file = std::ffi::OsString::from(".");
    file.push(dest.file_name()?);
    file.push(".lock");
    Some(dest.with_file_name(file))
}

/// `path`, or where it resolves when it ends in `.` or `..` (which name no entry of their own:
/// `ckpt split src .` locks the current folder under its name in its parent).
fn named(path: &Path) -> Option<PathBuf> {
    match path.components().next_back() {
        Some(Component::Normal(_)) => Some(path.to_path_buf()),
        _ => std::fs::canonicalize(path).ok().filter(|p| p.file_name().is_some()),
    }
}

/// The lock on one destination, held until dropped; dropping it removes the lock file and
/// releases the lock.
#[derive(Debug)]
pub struct DestLock {
    path: PathBuf,
    /// Dropped after the lock file is removed: the lock goes with it.
    file: File,
    /// The folders made for the lock file, taken back (while empty) after the lock is gone.
    _folders: NewFolders,
}

impl DestLock {
    /// Takes the lock of `dest` at once, or refuses: [`Error::Locked`], naming the process that
    /// holds it, when another one does. A lock file whose holder ended (killed) is taken over.
    ///
    /// `Ok(None)` where no lock can be placed: the folder is not writable by us or is on a
    /// read-only filesystem, or the filesystem does not do `flock`. The operation goes on
    /// unguarded there rather than being refused, since writing in place into an existing
    /// folder does not need its parent to be writable, and a folder nobody may create a file
    /// in is not one two writers race over.
    pub fn acquire(dest: &Path) -> Result<Option<DestLock>> {
        let Some(path) = lock_path(dest) else { return Ok(None) };
        let folders = match NewFolders::make(path.parent().unwrap_or(Path::new(""))) {
            Ok(f) => f,
            Err(Error::Io { source, .. }) if unguardable(&source) => return Ok(None),
            Err(e) => return Err(e),
        };
        for _ in 0..TRIES {
            let mut file = match open_lock_file(&path) {
                Ok(f) => f,
                // Removed by its holder between our look and our open: look again.
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => continue,
                Err(Error::Io { source, .. }) if unguardable(&source) => return Ok(None),
                Err(e) => return Err(e),
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    return Err(Error::Locked { dest: dest.to_path_buf(), lock: path.clone(), pid: holder(&mut file) })
                }
                Err(TryLockError::Error(e)) if unguardable(&e) => return Ok(None),
                Err(TryLockError::Error(e)) => return Err(Error::io(&path, e)),
            }
            // The holder before us removed the file after we opened it: what we hold is gone.
            if !same_file(&path, &file) {
                continue;
            }
            claim(&path, &file)?;
            return Ok(Some(DestLock { path, file, _folders: folders }));
        }
        Err(Error::io(&path, std::io::Error::other("the lock file kept being replaced while we tried to take it")))
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DestLock {
    fn drop(&mut self) {
        // Removed while still held (the lock goes with `self.file`, after this), and only while
        // the name is still ours.
        if same_file(&self.path, &self.file) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Writes our pid into the lock file we now hold, after making sure it is a lock file (an
/// empty one is a holder killed before it wrote its pid); somebody else's file is refused and
/// left as it is.
fn claim(path: &Path, file: &File) -> Result<()> {
    let mut before = Vec::new();
    file.take(HEADER.len() as u64 + 1).read_to_end(&mut before).map_err(|e| Error::io(path, e))?;
    if !before.is_empty() && !before.starts_with(HEADER.as_bytes()) {
        let reason = "exists and is not a statekit lock file; refusing to take it over (remove it if it is not yours)";
        return Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::AlreadyExists, reason)));
    }
    let mut f = file;
    f.set_len(0).map_err(|e| Error::io(path, e))?;
    f.rewind().map_err(|e| Error::io(path, e))?;
    f.write_all(format!("{HEADER}pid {}\n", std::process::id()).as_bytes()).map_err(|e| Error::io(path, e))
}

/// Opens the lock file at `path`: created exclusively without following a link, or, when one
/// is there, opened only if it is a regular file (a link, a FIFO or a device planted at the
/// name is refused, never opened through).
fn open_lock_file(path: &Path) -> Result<File> {
    let flags = libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;
    let created = OpenOptions::new().read(true).write(true).create_new(true).mode(0o644).custom_flags(flags).open(path);
    let file = match created {
        Ok(f) => return Ok(f),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = std::fs::symlink_metadata(path).map_err(|e| Error::io(path, e))?;
            refuse_non_regular(path, &meta)?;
            OpenOptions::new().read(true).write(true).custom_flags(flags).open(path).map_err(|e| Error::io(path, e))?
        }
        Err(e) => return Err(Error::io(path, e)),
    };
    // A FIFO or device swapped in between the look and the open (`O_NONBLOCK`: never waited on).
    refuse_non_regular(path, &file.metadata().map_err(|e| Error::io(path, e))?)?;
    Ok(file)
}

fn refuse_non_regular(path: &Path, meta: &std::fs::Metadata) -> Result<()> {
    if meta.file_type().is_symlink() {
        let reason = "is a symbolic link; refusing to use it as a lock file";
        return Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::AlreadyExists, reason)));
    }
    match FileKind::of(meta.file_type()) {
        None => Ok(()),
        Some(kind) => Err(Error::NotARegularFile { path: path.to_path_buf(), kind }),
    }
}

/// Whether `path` still names the file `file` is open on.
fn same_file(path: &Path, file: &File) -> bool {
    match (std::fs::symlink_metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Errors that say no lock can be placed here, rather than that something is wrong.
fn unguardable(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(e.kind(), K::PermissionDenied | K::ReadOnlyFilesystem | K::NotADirectory | K::Unsupported)
        || e.raw_os_error().is_some_and(|c| c == libc::ENOLCK || c == libc::EOPNOTSUPP)
}

/// The pid the holder of `file` wrote into it. A holder writes it right after taking the lock,
/// so an empty file is read again for a moment before the pid is given up as unknown.
fn holder(file: &mut File) -> Option<u32> {
    for _ in 0..20 {
        let mut text = String::new();
        let read = file.rewind().and_then(|()| file.take(256).read_to_string(&mut text));
        let pid = text.strip_prefix(HEADER).and_then(|rest| rest.strip_prefix("pid ")).map(str::trim);
        if let Some(pid) = read.ok().and(pid).and_then(|p| p.parse().ok()) {
            return Some(pid);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_lock_sits_beside_the_destination_in_a_folder_made_for_it() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        assert_eq!(lock_path(&t.join("out")).unwrap(), t.join(".out.lock"));
        assert_eq!(lock_path(&t.join("out/")).unwrap(), t.join(".out.lock"));
        let deep = t.join("new/deeper/model.safetensors");
        assert_eq!(lock_path(&deep).unwrap(), t.join("new/deeper/.model.safetensors.lock"));
        assert_eq!(lock_path(&t.join("new/.")).unwrap(), t.join(".new.lock"));
        assert_eq!(lock_path(Path::new("out")).unwrap(), Path::new(".out.lock"));
        assert_eq!(lock_path(Path::new("/")), None);

        // The missing folder is made for the lock, and taken back with it while still empty; a
        // killed holder's next run finds the lock file in the same place.
        std::fs::create_dir(t.join("new")).unwrap();
        let held = DestLock::acquire(&deep).unwrap().unwrap();
        assert!(t.join("new/deeper/.model.safetensors.lock").is_file());
        drop(held);
        assert!(!t.join("new/deeper").exists(), "the folder made for the lock is gone with it");
        assert!(t.join("new").is_dir(), "a folder that was there stays");
        let held = DestLock::acquire(&deep).unwrap().unwrap();
        std::fs::write(t.join("new/deeper/model.safetensors"), b"written").unwrap();
        drop(held);
        assert!(t.join("new/deeper/model.safetensors").is_file(), "a folder with the output in it stays");
    }

    #[test]
    fn a_second_writer_is_refused_with_the_holders_pid_until_the_first_is_done() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        let held = DestLock::acquire(&dest).unwrap().unwrap();
        let text = std::fs::read_to_string(held.path()).unwrap();
        assert_eq!(text, format!("{HEADER}pid {}\n", std::process::id()));
        // Another open file description: what a second process has.
        let err = DestLock::acquire(&dest).unwrap_err();
        assert!(matches!(&err, Error::Locked { pid: Some(p), .. } if *p == std::process::id()), "{err}");
        let lock = tmp.path().join(".out.lock");
        assert_eq!(
            err.to_string(),
            format!(
                "{}: another process (pid {}) is writing it now (it holds `{}`); nothing was written",
                dest.display(),
                std::process::id(),
                lock.display()
            )
        );
        drop(held);
        assert!(!lock.exists(), "the holder removes its lock file");
        let again = DestLock::acquire(&dest).unwrap().unwrap();
        assert!(lock.exists());
        drop(again);
    }

    #[test]
    fn a_lock_file_nobody_holds_is_taken_over_and_a_foreign_one_is_not() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("model.safetensors");
        let lock = tmp.path().join(".model.safetensors.lock");
        // Left by a killed holder: its pid, no flock; and one killed before it wrote anything.
        for left in [format!("{HEADER}pid 4194304\n"), String::new()] {
            std::fs::write(&lock, left).unwrap();
            let taken = DestLock::acquire(&dest).unwrap().unwrap();
            assert!(std::fs::read_to_string(&lock).unwrap().ends_with(&format!("pid {}\n", std::process::id())));
            drop(taken);
            assert!(!lock.exists());
        }
        std::fs::write(&lock, b"my notes").unwrap();
        let err = DestLock::acquire(&dest).unwrap_err();
        assert!(err.to_string().contains("is not a statekit lock file"), "{err}");
        assert_eq!(std::fs::read(&lock).unwrap(), b"my notes", "somebody else's file is left as it was");
    }

    #[test]
    fn a_link_or_a_fifo_at_the_lock_name_is_never_opened_through() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let lock = tmp.path().join(".out.lock");
        std::os::unix::fs::symlink(&victim, &lock).unwrap();
        let err = DestLock::acquire(&tmp.path().join("out")).unwrap_err();
        assert!(err.to_string().contains("is a symbolic link"), "{err}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        std::fs::remove_file(&lock).unwrap();
        assert!(std::process::Command::new("mkfifo").arg(&lock).status().unwrap().success());
        let err = DestLock::acquire(&tmp.path().join("out")).unwrap_err();
        assert!(matches!(err, Error::NotARegularFile { kind: FileKind::Fifo, .. }), "{err}");
    }

    #[test]
    fn a_lock_file_replaced_after_it_was_opened_is_not_trusted() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        let lock = tmp.path().join(".out.lock");
        let held = DestLock::acquire(&dest).unwrap().unwrap();
        // The file this process holds is unlinked and another created at the name: the name no
        // longer names what `held` locks, so dropping `held` must leave the new file alone.
        std::fs::remove_file(&lock).unwrap();
        let second = DestLock::acquire(&dest).unwrap().unwrap();
        drop(held);
        assert!(lock.exists(), "the earlier holder does not remove a lock file that is not its own");
        drop(second);
        assert!(!lock.exists());
    }
}
