//! The crate's one error type.

use std::path::{Path, PathBuf};

/// A file-system call of this crate that failed, naming the file it was about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The operating system refused a call: opening, reading, writing, syncing, renaming or
    /// removing `path`.
    #[error("{path}: {source}", path = path.display())]
    Io {
        /// The file or folder the call was about.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// The path (after links) is not a regular file: refused before a byte is read.
    #[error("{path}: is {kind}, not a regular file; refusing to read it", path = path.display(), kind = kind.noun())]
    NotARegularFile {
        /// The path given.
        path: PathBuf,
        /// What it is instead.
        kind: FileKind,
    },
    /// A file is larger than the caller allows (checked before it is read, and again after).
    #[error("{path}: {size} bytes, more than the {limit} it may hold", path = path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (or, when it grew while read, the bytes read).
        size: u64,
        /// The cap.
        limit: u64,
    },
    /// Another process holds the lock of a destination ([`crate::DestLock`]): it is writing it.
    #[error(
        "{dest}: another process{} is writing it now (it holds `{lock}`); nothing was written",
        pid.map(|p| format!(" (pid {p})")).unwrap_or_default(),
        dest = dest.display(),
        lock = lock.display()
    )]
    Locked {
        /// The destination.
        dest: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// The holder's process id, as it wrote it into the lock file (`None`: not written).
        pid: Option<u32>,
    },
}

impl Error {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            Error::Io { path, .. } | Error::NotARegularFile { path, .. } | Error::TooLarge { path, .. } => path,
            Error::Locked { dest, .. } => dest,
        }
    }

    /// The error `source` of a call about `path`.
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io { path: path.to_path_buf(), source }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a path that is not a regular file is instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FileKind {
    /// A directory.
    Directory,
    /// A named pipe: opening or reading it could block forever.
    Fifo,
    /// A Unix socket.
    Socket,
    /// A block or character device: it may read without end, or have no size.
    Device,
    /// Anything else the system reports.
    Other,
}

impl FileKind {
    /// The kind of `t`, or `None` for a regular file.
    pub(crate) fn of(t: std::fs::FileType) -> Option<FileKind> {
        use std::os::unix::fs::FileTypeExt;
        Some(if t.is_file() {
            return None;
        } else if t.is_dir() {
            FileKind::Directory
        } else if t.is_fifo() {
            FileKind::Fifo
        } else if t.is_socket() {
            FileKind::Socket
        } else if t.is_block_device() || t.is_char_device() {
            FileKind::Device
        } else {
            FileKind::Other
        })
    }

    /// The kind in words, as a refusal says it (`a FIFO`, `a device`, `a directory`).
    pub fn noun(self) -> &'static str {
        match self {
            FileKind::Directory => "a directory",
            FileKind::Fifo => "a FIFO",
            FileKind::Socket => "a socket",
            FileKind::Device => "a device",
            FileKind::Other => "not a regular file",
        }
    }
}
