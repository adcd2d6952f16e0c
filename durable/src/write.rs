//! Writing files so that a crash leaves the old one or the new one, never a part.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::open::open_regular;

/// 64 random bits as hex, from the kernel: temporary names nobody can predict.
pub fn random_hex() -> String {
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

/// The temporary `path` is written as: `.<name>.<token>.tmp` beside it. The leading dot and the
/// `.tmp` suffix keep it from ever matching a checkpoint's or a data set's file name.
pub fn temp_name(path: &Path, token: &str) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.{token}.tmp"))
}

/// Creates `path` exclusively, never through a link planted there.
fn open_new(path: &Path, options: &mut OpenOptions) -> Result<File> {
    options
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(path, e))
}

/// Creates the new file `path` for writing, refusing one that exists (or a link there).
pub fn create_new(path: &Path) -> Result<File> {
    open_new(path, &mut OpenOptions::new())
}

/// Creates the temporary `path` (see [`temp_name`]) for reading and writing, as
/// [`create_new`] does, readable by all: finishing a file may read back what was written (a
/// checksum), and the file keeps that mode once renamed into place.
pub fn create_temp(path: &Path) -> Result<File> {
    open_new(path, OpenOptions::new().read(true).mode(0o644))
}

/// Writes the small new file `path` (which must not exist) and makes it durable: for a file
/// inside a folder that is itself renamed into place once complete.
pub fn write_new(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut to = create_new(path)?;
    to.write_all(bytes).map_err(|e| Error::io(path, e))?;
    to.sync_all().map_err(|e| Error::io(path, e))
}

/// Copies the regular file `src` to the new file `dst` (which must not exist) and makes it
/// durable, as [`write_new`] does.
pub fn copy_new(src: &Path, dst: &Path) -> Result<()> {
    let mut from = open_regular(src)?;
    let mut to = create_new(dst)?;
    std::io::copy(&mut from, &mut to).map_err(|e| Error::io(dst, e))?;
    to.sync_all().map_err(|e| Error::io(dst, e))
}

/// Makes the entries of `dir` (a rename, a new file) durable; the empty path is the current
/// folder.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, e))
}

/// Removes the file `path`; one already gone is no error.
pub fn remove_if_there(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// A file written and fsynced under a temporary name beside its target, waiting to be renamed
/// over it ([`AtomicWrite::commit`]); dropped uncommitted, the temporary is removed and the
/// target left as it was.
///
/// The two steps are apart so that a caller can check something between them (`ckpt` refuses
/// to rename over a link planted at the target).
#[derive(Debug)]
pub struct AtomicWrite {
    target: PathBuf,
    /// The temporary, until it is renamed into place.
    temp: Option<PathBuf>,
}

impl AtomicWrite {
    /// Writes `bytes` to a new temporary beside `target`, created exclusively under a name
    /// nobody can predict (see [`temp_name`], [`create_temp`]), and fsyncs it.
    pub fn prepare(target: &Path, bytes: &[u8]) -> Result<AtomicWrite> {
        let (temp, mut file) = create_temp_beside(target)?;
        let pending = AtomicWrite { target: target.to_path_buf(), temp: Some(temp.clone()) };
        file.write_all(bytes).map_err(|e| Error::io(&temp, e))?;
        file.sync_all().map_err(|e| Error::io(&temp, e))?;
        Ok(pending)
    }

    /// The temporary the bytes are in.
    pub fn temp(&self) -> &Path {
        self.temp.as_deref().unwrap_or(&self.target)
    }

    /// Renames the temporary over the target and makes the rename durable (fsyncs the folder).
    pub fn commit(mut self) -> Result<()> {
        let Some(temp) = &self.temp else { return Ok(()) };
        std::fs::rename(temp, &self.target).map_err(|e| Error::io(&self.target, e))?;
        self.temp = None;
        sync_dir(self.target.parent().unwrap_or(Path::new(".")))
    }
}

impl Drop for AtomicWrite {
    fn drop(&mut self) {
        if let Some(temp) = self.temp.take() {
            let _ = std::fs::remove_file(temp);
        }
    }
}

/// Creates a new temporary beside `target` (a few tries: a name taken by chance is skipped).
fn create_temp_beside(target: &Path) -> Result<(PathBuf, File)> {
    let mut last = None;
    for _ in 0..8 {
        let temp = temp_name(target, &random_hex());
        match create_temp(&temp) {
            Ok(f) => return Ok((temp, f)),
            Err(Error::Io { path, source }) if source.kind() == std::io::ErrorKind::AlreadyExists => {
                last = Some(Error::Io { path, source })
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| Error::io(target, std::io::ErrorKind::AlreadyExists.into())))
}

/// Writes `bytes` as `target` atomically and durably: a reader, or the system after a crash,
/// sees the old file or the new one, never a part; nothing but a new temporary and `target`
/// itself is written. See [`AtomicWrite`] for the steps.
pub fn write_atomic(target: &Path, bytes: &[u8]) -> Result<()> {
    AtomicWrite::prepare(target, bytes)?.commit()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// What is in `dir`, by name, sorted: what a write left behind.
    fn names(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            out.push(entry.unwrap().file_name().into_string().unwrap());
        }
        out.sort();
        out
    }

    #[test]
    fn temporaries_are_unpredictable_and_removed_unless_committed() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("x.bin");
        let a = AtomicWrite::prepare(&target, b"a").unwrap();
        let b = AtomicWrite::prepare(&target, b"b").unwrap();
        assert_ne!(a.temp(), b.temp(), "two temporaries of one target never share a name");
        let name = a.temp().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(".x.bin.") && name.ends_with(".tmp") && name.len() == ".x.bin.".len() + 16 + 4);
        assert_eq!(std::fs::read(a.temp()).unwrap(), b"a", "the bytes are in the temporary before the rename");
        drop((a, b));
        assert!(names(tmp.path()).is_empty(), "dropped temporaries are removed");
    }

    #[test]
    fn a_write_replaces_the_file_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("index.json");
        std::fs::write(&target, b"old").unwrap();
        write_atomic(&target, b"new contents").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new contents");
        assert_eq!(names(tmp.path()), ["index.json"], "no temporary is left behind");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("index.json");
        std::fs::write(&target, b"old").unwrap();
        // Stopped between the write and the rename (the caller's check refused it).
        drop(AtomicWrite::prepare(&target, b"new").unwrap());
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
        assert_eq!(names(tmp.path()), ["index.json"]);
        // The rename fails: a non-empty folder is in the target's place.
        let folder = tmp.path().join("folder");
        std::fs::create_dir(&folder).unwrap();
        std::fs::write(folder.join("inside"), b"kept").unwrap();
        let err = write_atomic(&folder, b"new").unwrap_err();
        assert!(matches!(&err, Error::Io { path, .. } if *path == folder), "{err}");
        assert_eq!(std::fs::read(folder.join("inside")).unwrap(), b"kept");
        assert_eq!(names(tmp.path()), ["folder", "index.json"], "the temporary is removed");
        // The temporary cannot be created: the folder does not exist.
        let nowhere = tmp.path().join("missing").join("index.json");
        let err = write_atomic(&nowhere, b"new").unwrap_err();
        assert!(err.path().starts_with(tmp.path().join("missing")), "{err}");
    }

    #[test]
    fn a_planted_link_at_a_new_file_is_never_written_through() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let planted = tmp.path().join("latest");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        let err = write_new(&planted, b"evil").unwrap_err();
        assert!(matches!(&err, Error::Io { path, .. } if *path == planted), "{err}");
        let err = copy_new(&victim, &planted).unwrap_err();
        assert!(matches!(&err, Error::Io { path, .. } if *path == planted), "{err}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        // A link at the target itself is replaced by the rename, never written through.
        write_atomic(&planted, b"new").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::read(&planted).unwrap(), b"new");
        assert!(!std::fs::symlink_metadata(&planted).unwrap().file_type().is_symlink());
    }

    #[test]
    fn new_files_are_written_copied_and_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let a = tmp.path().join("a");
        write_new(&a, b"bytes").unwrap();
        let err = write_new(&a, b"again").unwrap_err();
        assert!(matches!(&err, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::AlreadyExists));
        let b = tmp.path().join("b");
        copy_new(&a, &b).unwrap();
        assert_eq!(std::fs::read(&b).unwrap(), b"bytes");
        let err = copy_new(Path::new("/dev/zero"), &tmp.path().join("c")).unwrap_err();
        assert!(matches!(err, Error::NotARegularFile { .. }), "{err}");
        remove_if_there(&b).unwrap();
        remove_if_there(&b).unwrap();
        sync_dir(tmp.path()).unwrap();
        sync_dir(Path::new("")).unwrap();
        assert_eq!(names(tmp.path()), ["a"]);
    }

    #[test]
    fn temp_names_sit_beside_their_target() {
        assert_eq!(temp_name(Path::new("out/model.safetensors"), "ab12"), Path::new("out/.model.safetensors.ab12.tmp"));
        let hex = random_hex();
        assert!(hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()), "{hex}");
        assert_ne!(random_hex(), hex);
    }
}
