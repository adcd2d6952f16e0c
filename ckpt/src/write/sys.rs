//! The only module with `unsafe`: the kernel copy call, the memory map, the folder swap, and the
//! open-file limit.
//!
//! Both exist to move tensor bytes without holding them: `copy_file_range` copies inside the
//! kernel (and can share extents on filesystems that support it); where the kernel refuses, we
//! copy out of a read-only memory map in windows and drop each window's pages once written, so
//! resident memory stays at a window per thread whatever the checkpoint size.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use memmap2::{Mmap, UncheckedAdvice};

/// Copies up to `len` bytes from `src` at `src_off` to `dst` at `dst_off` inside the kernel.
/// Returns the number of bytes copied, which may be less than `len`; 0 means end of `src`.
pub(crate) fn copy_file_range(src: &File, src_off: u64, dst: &File, dst_off: u64, len: u64) -> io::Result<u64> {
    let mut off_in = i64::try_from(src_off).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut off_out = i64::try_from(dst_off).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // The kernel caps a single call well below usize::MAX anyway; 1 GiB keeps each call short.
    let want = len.min(1 << 30) as usize;
    // SAFETY: both descriptors are open for the duration of the call (borrowed `File`s), and the
    // offset pointers point at live, properly aligned i64s on this stack frame. With explicit
    // offsets the call does not touch the files' shared positions, so it is safe to run
    // concurrently on the same descriptors.
    let n = unsafe { libc::copy_file_range(src.as_raw_fd(), &mut off_in, dst.as_raw_fd(), &mut off_out, want, 0) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as u64)
    }
}

/// Starts write-back of `[off, off + len)` of `file` without waiting for it
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`), so that the final fsync finds little left to
/// write: copying and flushing then overlap instead of running one after the other. A hint
/// only; errors are ignored, the fsync that follows is what makes the data durable.
pub(crate) fn start_writeback(file: &File, off: u64, len: u64) {
    let (Ok(off), Ok(len)) = (i64::try_from(off), i64::try_from(len)) else { return };
    // SAFETY: the descriptor is open for the duration of the call (a borrowed `File`); the call
    // takes plain integers and touches no memory of ours.
    let _ = unsafe { libc::sync_file_range(file.as_raw_fd(), off, len, libc::SYNC_FILE_RANGE_WRITE) };
}

/// True for the errors that mean "this kernel or filesystem pair cannot do it", after which a
/// user-space copy is the right answer.
pub(crate) fn copy_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EXDEV | libc::ENOSYS | libc::EOPNOTSUPP | libc::EINVAL | libc::EBADF | libc::EPERM)
    )
}

/// Swaps the two existing paths `a` and `b` in one step (`renameat2(RENAME_EXCHANGE)`): at no
/// moment is either name missing. Errors as the kernel gives them; [`exchange_unsupported`] tells
/// the ones that mean this kernel or filesystem cannot swap.
pub(crate) fn exchange(a: &std::path::Path, b: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let a = std::ffi::CString::new(a.as_os_str().as_bytes())?;
    let b = std::ffi::CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: both pointers are NUL-terminated strings owned by this frame that outlive the
    // call; the kernel only reads them. `AT_FDCWD` resolves relative paths as `rename` does.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// True for the errors of [`exchange`] that mean "this kernel or filesystem cannot swap" (an
/// old kernel, NFS, some FUSE filesystems), after which the caller takes the slower path.
pub(crate) fn exchange_unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP))
}

/// A read-only memory map of a whole source file.
#[derive(Debug)]
pub(crate) struct MappedFile {
    map: Mmap,
}

impl MappedFile {
    pub(crate) fn open(file: &File) -> io::Result<MappedFile> {
        // SAFETY: the map is read-only. A checkpoint being modified by another process while we
        // read it is outside what any reader can guard against (torch and safetensors map the
        // same way); we never hand out references that outlive `self`.
        let map = unsafe { Mmap::map(file)? };
        Ok(MappedFile { map })
    }

    /// The bytes at `[off, off + len)`, or `None` when out of bounds.
    pub(crate) fn get(&self, off: u64, len: u64) -> Option<&[u8]> {
        let start = usize::try_from(off).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        self.map.get(start..end)
    }

    /// Drops the resident pages of `[off, off + len)`; they are re-read from the file if touched
    /// again.
    pub(crate) fn release(&self, off: u64, len: u64) {
        let (Ok(off), Ok(len)) = (usize::try_from(off), usize::try_from(len)) else {
            return;
        };
        // SAFETY: MADV_DONTNEED on a private read-only file mapping discards only clean page-cache
        // backed pages; later reads fault them back in from the file with identical contents. No
        // slice borrowed from the map is alive across this call in our callers (they release a
        // window only after writing it out).
        let _ = unsafe { self.map.unchecked_advise_range(UncheckedAdvice::DontNeed, off, len) };
    }
}

/// Raises this process's soft limit on open files to its hard limit (once; best effort: a
/// failure leaves the limit as it was, and opening a file past it is then an error that names
/// the file).
pub(crate) fn raise_open_file_limit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: `lim` is a valid, writable rlimit for the call to fill.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 && lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            // SAFETY: `raised` is a valid rlimit; the call only reads it.
            let _ = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) };
        }
    });
}

#[cfg(test)]
mod limit_tests {
    #[test]
    fn the_soft_open_file_limit_is_raised_to_the_hard_one() {
        let mut before = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: a valid rlimit to fill.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut before) }, 0);
        super::raise_open_file_limit();
        let mut after = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut after) }, 0);
        assert_eq!(after.rlim_cur, before.rlim_max);
    }
}
