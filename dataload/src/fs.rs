//! The crate's two ways of touching the file system, both `durable`'s (the one file-system
//! seam of the workspace, shared with `ckpt`, `train` and the Python package):
//!
//! * [`open_regular`] opens only a regular file (after links): a FIFO (which would block the
//!   open, or a read, forever), a socket or a device such as `/dev/zero` (which reads without
//!   end, or has no size) planted in place of a data file is refused by name, its type checked
//!   on the opened descriptor too, so nothing swapped in between is read.
//! * [`write_atomic`] writes a new file beside its target under a name nobody can predict,
//!   created exclusively and without following a link, fsyncs it, renames it over the target
//!   and fsyncs the directory.
//!
//! [`fs_error`] maps `durable`'s error to this crate's variants and words at the edge.

use std::fs::File;
use std::path::Path;

use crate::error::{DataloadError, Result};

/// A `durable` error as this crate's: the variants and words `dataload` has always used (an
/// over-long file is an I/O error of kind `InvalidData`).
fn fs_error(e: durable::Error) -> DataloadError {
    match e {
        durable::Error::Io { path, source } => DataloadError::Io { path, source },
        durable::Error::NotARegularFile { path, kind } => DataloadError::NotARegularFile { path, kind: kind.noun() },
        durable::Error::TooLarge { path, size, limit } => {
            let reason = format!("{size} bytes, more than the {limit} it may hold");
            DataloadError::io(&path, std::io::Error::new(std::io::ErrorKind::InvalidData, reason))
        }
        other => DataloadError::io(other.path(), std::io::Error::other(other.to_string())),
    }
}

/// Opens `path` for reading when it is a regular file (after links); anything else is refused
/// with [`DataloadError::NotARegularFile`] before a byte is read: how every data file is opened
/// (the Python package maps the files it views through this too).
pub fn open_regular(path: &Path) -> Result<File> {
    durable::open_regular(path).map_err(fs_error)
}

/// The whole of the regular file `path`, refused (unread) when it is longer than `max` bytes.
pub(crate) fn read_regular(path: &Path, max: u64) -> Result<Vec<u8>> {
    durable::read_capped(path, max).map_err(fs_error)
}

/// Writes `bytes` as `target`, atomically (see the module docs): a reader sees the old file
/// or the new one, never a part; nothing but a new temporary and `target` itself is written.
pub(crate) fn write_atomic(target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    durable::write_atomic(target, bytes).map_err(std::io::Error::other)
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
