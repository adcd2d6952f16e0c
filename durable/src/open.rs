//! Opening files to read them: only regular files, and small ones under a cap.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::error::{Error, FileKind, Result};

/// Refuses `path` unless `meta` is a regular file's.
fn regular(path: &Path, meta: &std::fs::Metadata) -> Result<()> {
    match FileKind::of(meta.file_type()) {
        None => Ok(()),
        Some(kind) => Err(Error::NotARegularFile { path: path.to_path_buf(), kind }),
    }
}

/// Opens `path` for reading when it is a regular file (after links); anything else is refused
/// with [`Error::NotARegularFile`] before a byte is read.
///
/// The path is looked at first, so a device or socket is refused without being opened (opening
/// some devices does something; a socket cannot be opened at all). The open itself does not
/// block (`O_NONBLOCK`, which changes nothing for a regular file) and the opened descriptor is
/// checked again, so a FIFO swapped in after the first look is refused too, never waited on.
pub fn open_regular(path: &Path) -> Result<File> {
    regular(path, &std::fs::metadata(path).map_err(|e| Error::io(path, e))?)?;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    regular(path, &file.metadata().map_err(|e| Error::io(path, e))?)?;
    Ok(file)
}

/// The whole of the regular file `path`, refused ([`Error::TooLarge`]) when it is longer
/// than `max` bytes: before reading it, and when it grows past `max` while read.
pub fn read_capped(path: &Path, max: u64) -> Result<Vec<u8>> {
    let file = open_regular(path)?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len > max {
        return Err(Error::TooLarge { path: path.to_path_buf(), size: len, limit: max });
    }
    let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    // `take` keeps a file that grows while we read within the cap too.
    file.take(max.saturating_add(1)).read_to_end(&mut out).map_err(|e| Error::io(path, e))?;
    if out.len() as u64 > max {
        return Err(Error::TooLarge { path: path.to_path_buf(), size: out.len() as u64, limit: max });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn mkfifo(path: &Path) {
        let status = std::process::Command::new("mkfifo").arg(path).status().unwrap();
        assert!(status.success());
    }

    #[test]
    fn only_regular_files_are_opened() {
        let err = open_regular(Path::new("/dev/zero")).unwrap_err();
        assert_eq!(err.to_string(), "/dev/zero: is a device, not a regular file; refusing to read it");
        let tmp = tempfile::tempdir().unwrap();
        let err = open_regular(tmp.path()).unwrap_err();
        assert!(matches!(err, Error::NotARegularFile { kind: FileKind::Directory, .. }), "{err}");
        // A FIFO has no writer: opening it blocking would hang this test.
        let fifo = tmp.path().join("fifo");
        mkfifo(&fifo);
        let err = open_regular(&fifo).unwrap_err();
        assert!(matches!(&err, Error::NotARegularFile { kind: FileKind::Fifo, path } if *path == fifo), "{err}");
        let sock_path = tmp.path().join("sock");
        let _sock = std::os::unix::net::UnixListener::bind(&sock_path).unwrap();
        let err = open_regular(&sock_path).unwrap_err();
        assert!(matches!(err, Error::NotARegularFile { kind: FileKind::Socket, .. }), "{err}");
    }

    #[test]
    fn a_link_to_a_regular_file_is_followed_and_one_to_a_fifo_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        std::fs::write(&data, b"bytes").unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&data, &link).unwrap();
        let mut s = String::new();
        open_regular(&link).unwrap().read_to_string(&mut s).unwrap();
        assert_eq!(s, "bytes");
        let fifo = tmp.path().join("fifo");
        mkfifo(&fifo);
        let to_fifo = tmp.path().join("to-fifo");
        std::os::unix::fs::symlink(&fifo, &to_fifo).unwrap();
        let err = open_regular(&to_fifo).unwrap_err();
        assert!(matches!(&err, Error::NotARegularFile { kind: FileKind::Fifo, path } if *path == to_fifo), "{err}");
    }

    #[test]
    fn a_missing_file_is_an_io_error_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let missing = tmp.path().join("missing");
        let err = open_regular(&missing).unwrap_err();
        assert!(matches!(&err, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound), "{err}");
        assert_eq!(err.path(), missing);
    }

    #[test]
    fn reads_are_capped_before_reading() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("small");
        std::fs::write(&path, b"0123456789").unwrap();
        assert_eq!(read_capped(&path, 10).unwrap(), b"0123456789");
        let err = read_capped(&path, 9).unwrap_err();
        assert!(matches!(err, Error::TooLarge { size: 10, limit: 9, .. }), "{err}");
        assert_eq!(err.to_string(), format!("{}: 10 bytes, more than the 9 it may hold", path.display()));
        let err = read_capped(Path::new("/dev/zero"), 9).unwrap_err();
        assert!(matches!(err, Error::NotARegularFile { kind: FileKind::Device, .. }), "{err}");
    }
}
