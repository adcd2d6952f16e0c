//! The one place statekit touches files for their safety: opening a file to read it, and
//! writing a file so that a crash leaves the old one or the new one, never a part.
//!
//! `ckpt`, `dataload` and `train` (and, through `statekit._native`, the Python package) read
//! and write through this crate, so that the rules below hold everywhere at once:
//!
//! * [`open_regular`] opens only a regular file (after links). The path is looked at before
//!   it is opened, so a device is never opened at all, and the opened descriptor is checked
//!   again, so nothing swapped in between is read: a FIFO (which would block the open or a
//!   read forever), a socket or a device such as `/dev/zero` (which reads without end) planted
//!   in place of a data file is refused by name ([`Error::NotARegularFile`]).
//! * [`read_capped`] reads a whole small file, refusing one larger than a cap before reading
//!   it and one that grows past it while read.
//! * [`write_atomic`] (and [`AtomicWrite`], for a caller that checks something between the
//!   write and the rename) writes a new file beside its target under a name nobody can predict
//!   (64 random bits from the kernel), created exclusively and without following a link
//!   (`O_EXCL`, `O_NOFOLLOW`: nothing planted there, a link to a victim file least of all, is
//!   ever written through), fsyncs it, renames it over the target and fsyncs the folder. A
//!   failure on the way removes the temporary and leaves the target as it was.
//! * [`create_new`], [`write_new`] and [`copy_new`] make a file that must not exist yet (inside
//!   a folder that is itself staged and renamed into place); [`sync_dir`], [`remove_if_there`],
//!   [`temp_name`] and [`random_hex`] are the steps the callers' own protocols share.
//! * [`NewFolders`] makes the folders a new file needs where they are missing, and takes them
//!   back (while empty) when the file never lands.
//! * [`DestLock`] is the one writer of a destination at a time: an advisory lock beside it
//!   that a second writer is refused by, naming the holder's pid ([`Error::Locked`]), and that
//!   a killed holder leaves for the next one to take over.
//!
//! Every error names the file it is about; callers map [`Error`] into their own error enum at
//! their edge.

#![warn(missing_docs, unreachable_pub)]

mod error;
mod folders;
mod lock;
mod open;
mod write;

pub use error::{Error, FileKind, Result};
pub use folders::NewFolders;
pub use lock::{lock_path, DestLock};
pub use open::{open_regular, read_capped};
pub use write::{
    copy_new, create_new, create_temp, random_hex, remove_if_there, sync_dir, temp_name, write_atomic, write_new,
    AtomicWrite,
};
