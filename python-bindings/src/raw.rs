//! Borrowing the memory of a Python buffer (a numpy array, a torch CPU tensor) by address.
//!
//! abi3 for Python 3.9 has no buffer protocol, so the Python layer passes the address and length
//! of a C-contiguous buffer it keeps alive (and does not resize) for the whole call, as `ctypes`
//! does. This is the only `unsafe` of the crate.
#![allow(unsafe_code)]

/// A read-only byte range of a live Python buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawBuf {
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

impl RawBuf {
    /// The bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the Python layer (`statekit._buffers`) passes the address and length of a
        // C-contiguous buffer it holds a reference to until the native call returns.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// The bytes, to be filled. Only for buffers the Python layer allocated for this call.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn bytes_mut(&self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as above; the buffer is a fresh writable array that nothing else references
        // while the call runs.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}
