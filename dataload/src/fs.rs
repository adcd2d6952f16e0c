//! The crate's two ways of touching the file system: opening a data file for reading, and
//! writing a file (a line index) atomically.
//!
//! * [`open_regular`] opens only a regular file (after links). The file is opened without
//!   blocking and its type is checked on the opened descriptor, so a FIFO (which would block
//!   the open, or a read, forever), a socket or a device such as `/dev/zero` (which reads
//!   without end, or has no size) planted in place of a data file is refused by name, with no
//!   window between the check and the open.
//! * [`write_atomic`] writes a new file beside its target under a name nobody can predict
//!   (64 random bits from the kernel), created exclusively (`O_EXCL`, `O_NOFOLLOW`: nothing
//!   planted there, a link to a victim file least of all, is ever written through), fsyncs it,
//!   renames it over the target and fsyncs the directory. It is the same protocol as `ckpt`'s
//!   write engine, which this crate does not depend on.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{DataloadError, Result};

/// What kind of file `meta` describes, for a refusal ("a FIFO", "a device").
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading when it is a regular file (after links); anything else is refused
/// with [`DataloadError::NotARegularFile`] before a byte is read (see the module docs).
pub(crate) fn open_regular(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| DataloadError::io(path, e))?;
    let meta = file.metadata().map_err(|e| DataloadError::io(path, e))?;
    if !meta.is_file() {
        return Err(DataloadError::NotARegularFile { path: path.to_owned(), kind: kind_of(&meta) });
    }
    Ok(file)
}

/// The whole of the regular file `path`, refused (unread) when it is longer than `max` bytes.
pub(crate) fn read_regular(path: &Path, max: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let file = open_regular(path)?;
    let len = file.metadata().map_err(|e| DataloadError::io(path, e))?.len();
    if len > max {
        let reason = format!("{len} bytes, more than the {max} it may hold");
        return Err(DataloadError::io(path, std::io::Error::new(std::io::ErrorKind::InvalidData, reason)));
    }
    let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(max.saturating_add(1)).read_to_end(&mut out).map_err(|e| DataloadError::io(path, e))?;
    Ok(out)
}

/// 64 random bits as hex, from the kernel: a temporary name nobody can predict.
fn random_hex() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 8];
    File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Creates `.<name>.<random>.tmp` beside `target`, exclusively and without following a link.
fn create_temp(target: &Path) -> std::io::Result<(PathBuf, File)> {
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut last = None;
    for _ in 0..8 {
        let tmp = target.with_file_name(format!(".{name}.{}.tmp", random_hex()?));
        let opened = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .mode(0o644)
            .open(&tmp);
        match opened {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::ErrorKind::AlreadyExists.into()))
}

/// Writes `bytes` as `target`, atomically (see the module docs): a reader sees the old file
/// or the new one, never a part; nothing but a new temporary and `target` itself is written.
pub(crate) fn write_atomic(target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let (tmp, mut file) = create_temp(target)?;
    let result = (|| {
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, target)?;
        let dir = target.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_planted_link_at_any_temporary_name_is_never_written_through() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let target = tmp.path().join("data.jsonl.lines.idx");
        // The name the index was once written through, and a few more guesses.
        for guess in [format!("data.jsonl.lines.idx.tmp{}", std::process::id()), ".data.jsonl.lines.idx.tmp".into()] {
            std::os::unix::fs::symlink(&victim, tmp.path().join(guess)).unwrap();
        }
        write_atomic(&target, b"index").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"index");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp") && !n.starts_with(".data.jsonl.lines.idx.tmp"))
            .collect();
        assert!(left.is_empty(), "no temporary is left behind: {left:?}");
    }

    #[test]
    fn only_regular_files_are_opened() {
        let err = open_regular(Path::new("/dev/zero")).unwrap_err();
        assert_eq!(err.to_string(), "`/dev/zero`: is a device, not a regular file; refusing to read it");
        let tmp = tempfile::tempdir().unwrap();
        let err = open_regular(tmp.path()).unwrap_err();
        assert!(matches!(err, DataloadError::NotARegularFile { kind: "a directory", .. }), "{err}");
    }
}
