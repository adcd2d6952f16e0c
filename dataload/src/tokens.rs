//! Token files and fixed-length windows over them.
//!
//! # On disk
//!
//! * `.bin`: nanoGPT's format, the tokens of a whole corpus as one flat array of
//!   little-endian `uint16` (or `uint32` for vocabularies past 65 535) with no header; the
//!   element type is not in the file and must be given ([`TokenDtype`]).
//! * `.npy`: numpy's format (see [`crate::npy`]'s header), one-dimensional, holding
//!   `uint8`, `uint16`, `uint32`, `int32` or `int64` tokens, little-endian. The header says
//!   the type and the length, and both are checked against the file.
//!
//! Files are read with `pread`, window by window, and a token is decoded (widened to `i64`)
//! only when a batch is collated. They are not memory-mapped: a token file is the kind of file
//! a preprocessing job may still be writing or rewriting, and a read past the end of a map of
//! a file truncated after it was opened kills the process with `SIGBUS`, where a `pread` is
//! a short read, refused as [`DataloadError::FileChanged`]. A concurrent writer can still
//! change the tokens a window reads (bytes rewritten in place are read as they are), never
//! crash the reader. Only regular files are opened: a FIFO or a device in place of a token
//! file is refused by name.
//!
//! # Windows
//!
//! [`TokenWindows`] cuts each file into non-overlapping windows of `block_size` input tokens:
//! window `i` of a file reads tokens `[i·T, i·T + T + 1)`, the input being the first `T` and
//! the target the last `T` (the input shifted by one). A file of `n` tokens gives
//! `(n - 1) / T` windows; a window never crosses a file boundary. Windows of several files
//! are numbered file after file (see [`crate::Source`]). Which tokens a window holds depends
//! only on its index, so any sampler can shuffle windows.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use crate::error::{DataloadError, Result};
use crate::npy::parse_header;
use crate::source::{resolve_files, DataFile, FileFingerprint, Fingerprint, ShardIndex, Source};

/// Element type of a token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenDtype {
    /// `uint8`.
    U8,
    /// `uint16` (nanoGPT's `.bin`).
    U16,
    /// `uint32`.
    U32,
    /// `int32`.
    I32,
    /// `int64`.
    I64,
}

const ACCEPTED: &str = "`<u2`, `<u4`, `<i4`, `<i8`, `|u1`";

impl TokenDtype {
    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::U16 => 2,
            Self::U32 | Self::I32 => 4,
            Self::I64 => 8,
        }
    }

    fn from_descr(descr: &str) -> Option<Self> {
        Some(match descr {
            "|u1" | "<u1" => Self::U8,
            "<u2" => Self::U16,
            "<u4" => Self::U32,
            "<i4" => Self::I32,
            "<i8" => Self::I64,
            _ => return None,
        })
    }

    /// Decodes `bytes` (exactly `out.len()` tokens) into `out`.
    fn decode(self, bytes: &[u8], out: &mut [i64]) {
        macro_rules! widen {
            ($t:ty, $n:literal) => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact($n)) {
                    let mut a = [0u8; $n];
                    a.copy_from_slice(c);
                    *o = i64::from(<$t>::from_le_bytes(a));
                }
            };
        }
        match self {
            Self::U8 => out.iter_mut().zip(bytes).for_each(|(o, b)| *o = i64::from(*b)),
            Self::U16 => widen!(u16, 2),
            Self::U32 => widen!(u32, 4),
            Self::I32 => widen!(i32, 4),
            Self::I64 => widen!(i64, 8),
        }
    }
}

/// One token file, read with `pread` (see the module docs).
#[derive(Debug, Clone)]
pub struct TokenFile {
    file: DataFile,
    fd: Arc<File>,
    size: u64,
    offset: usize,
    dtype: TokenDtype,
    len: u64,
}

/// The first bytes of a `.npy` file that can hold its header (numpy's are a few hundred bytes;
/// [`crate::npy`] refuses anything over 1 MiB).
const NPY_HEAD: u64 = 12 + (1 << 20);

impl TokenFile {
    /// Opens a `.npy` (type and length from its header) or any other file as a flat array
    /// of `bin_dtype`. Only a regular file is opened.
    pub fn open(path: impl AsRef<Path>, bin_dtype: TokenDtype) -> Result<Self> {
        let path = path.as_ref();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Self::open_file(DataFile { path: path.to_path_buf(), name }, bin_dtype)
    }

    fn open_file(file: DataFile, bin_dtype: TokenDtype) -> Result<Self> {
        let fd = crate::fs::open_regular(&file.path)?;
        let size = fd.metadata().map_err(|e| DataloadError::io(&file.path, e))?.len();
        let shown = file.path.clone();
        let (offset, dtype, len) = if file.path.extension().is_some_and(|e| e == "npy") {
            let mut head = vec![0u8; usize::try_from(size.min(NPY_HEAD)).unwrap_or(0)];
            fd.read_exact_at(&mut head, 0).map_err(|e| DataloadError::io(&file.path, e))?;
            let header = parse_header(&head, &shown)?;
            let dtype = TokenDtype::from_descr(&header.descr).ok_or_else(|| DataloadError::WrongDtype {
                path: shown.clone(),
                found: header.descr.clone(),
                expected: ACCEPTED,
            })?;
            let body = size - header.data_offset as u64;
            let expected = header.len.checked_mul(dtype.size() as u64).ok_or_else(|| DataloadError::BadFormat {
                path: shown.clone(),
                format: "npy",
                reason: format!("shape ({},) overflows", header.len),
            })?;
            if body < expected {
                return Err(DataloadError::Truncated {
                    path: shown,
                    expected: header.data_offset as u64 + expected,
                    found: size,
                });
            }
            if body > expected {
                return Err(DataloadError::BadFormat {
                    path: shown,
                    format: "npy",
                    reason: format!("{} bytes after the {} tokens the header announces", body - expected, header.len),
                });
            }
            (header.data_offset, dtype, header.len)
        } else {
            let tsize = bin_dtype.size() as u64;
            if !size.is_multiple_of(tsize) {
                return Err(DataloadError::Truncated {
                    path: shown,
                    expected: size.div_ceil(tsize) * tsize,
                    found: size,
                });
            }
            (0, bin_dtype, size / tsize)
        };
        Ok(Self { file, fd: Arc::new(fd), size, offset, dtype, len })
    }

    /// Number of tokens.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file holds no token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element type.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.file.path
    }

    /// Byte offset of the first token in the file (after a `.npy` header): token `k` is at
    /// `data_offset() + k * dtype().size()`. Lets a caller map a window without copying it.
    pub fn data_offset(&self) -> usize {
        self.offset
    }

    /// Decodes tokens `[start, start + out.len())` into `out`.
    ///
    /// The bytes are read with `pread`: a file a concurrent writer truncated is an error
    /// ([`DataloadError::FileChanged`]), never a fault; bytes it rewrote in place are read as
    /// they are now.
    pub fn read_into(&self, start: u64, out: &mut [i64]) -> Result<()> {
        let size = self.dtype.size();
        let end = start.checked_add(out.len() as u64).filter(|&e| e <= self.len);
        let at = end.and_then(|_| (self.offset as u64).checked_add(start.checked_mul(size as u64)?));
        let n = out.len().checked_mul(size);
        let (Some(at), Some(n)) = (at, n) else {
            return Err(DataloadError::IndexOutOfRange {
                index: start.saturating_add(out.len() as u64),
                len: self.len,
            });
        };
        let mut bytes = vec![0u8; n];
        self.fd.read_exact_at(&mut bytes, at).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => DataloadError::FileChanged { path: self.file.path.clone() },
            _ => DataloadError::io(&self.file.path, e),
        })?;
        self.dtype.decode(&bytes, out);
        Ok(())
    }
}

/// A batch of windows: `inputs` and `targets`, each `[batch, block_size]` row-major `i64`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBatch {
    /// Rows.
    pub batch: usize,
    /// Tokens per row.
    pub block_size: usize,
    /// Input tokens, `batch × block_size`.
    pub inputs: Vec<i64>,
    /// Target tokens (inputs shifted by one), `batch × block_size`.
    pub targets: Vec<i64>,
}

impl TokenBatch {
    /// Row `r` of the inputs.
    pub fn input(&self, r: usize) -> &[i64] {
        &self.inputs[r * self.block_size..(r + 1) * self.block_size]
    }

    /// Row `r` of the targets.
    pub fn target(&self, r: usize) -> &[i64] {
        &self.targets[r * self.block_size..(r + 1) * self.block_size]
    }
}

/// Fixed-length windows over one or more token files (see the module docs).
#[derive(Debug, Clone)]
pub struct TokenWindows {
    files: Vec<TokenFile>,
    block_size: usize,
    index: ShardIndex,
    fingerprint: Fingerprint,
}

impl TokenWindows {
    /// Opens a file, a directory of `.bin`/`.npy` files, or a glob; `bin_dtype` is the type of
    /// `.bin` files (`.npy` files carry theirs).
    pub fn open(spec: impl AsRef<Path>, block_size: usize, bin_dtype: TokenDtype) -> Result<Self> {
        if block_size == 0 {
            return Err(DataloadError::InvalidValue {
                field: "block_size",
                value: "0".into(),
                reason: "a window needs at least one token",
            });
        }
        let files = resolve_files(spec.as_ref(), &[".bin", ".npy"])?
            .into_iter()
            .map(|f| TokenFile::open_file(f, bin_dtype))
            .collect::<Result<Vec<_>>>()?;
        let t = block_size as u64;
        let counts: Vec<u64> = files.iter().map(|f| f.len.saturating_sub(1) / t).collect();
        let fingerprint = Fingerprint {
            format: "tokens",
            options: format!("block_size={block_size}"),
            files: files
                .iter()
                .zip(&counts)
                .map(|(f, &rows)| FileFingerprint { name: f.file.name.clone(), size: f.size, rows })
                .collect(),
        };
        Ok(Self { index: ShardIndex::new(counts), files, block_size, fingerprint })
    }

    /// Input tokens per window.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The files, in dataset order.
    pub fn files(&self) -> &[TokenFile] {
        &self.files
    }

    /// The file of window `i` and the window's index within it: its `block_size + 1` tokens
    /// (inputs, and targets shifted by one) start at token `row * block_size` of that file.
    pub fn locate(&self, i: u64) -> Result<(usize, u64)> {
        self.index.locate(i)
    }
}

impl Source for TokenWindows {
    type Batch = TokenBatch;

    fn len(&self) -> u64 {
        self.index.total()
    }

    fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    fn read_batch(&self, indices: &[u64]) -> Result<TokenBatch> {
        let t = self.block_size;
        let mut inputs = vec![0i64; indices.len() * t];
        let mut targets = vec![0i64; indices.len() * t];
        let mut window = vec![0i64; t + 1];
        for ((&i, input), target) in indices.iter().zip(inputs.chunks_exact_mut(t)).zip(targets.chunks_exact_mut(t)) {
            let (k, w) = self.index.locate(i)?;
            let file = &self.files[k];
            // One read per window: its inputs and, shifted by one, its targets.
            file.read_into(w * t as u64, &mut window)?;
            input.copy_from_slice(&window[..t]);
            target.copy_from_slice(&window[1..]);
        }
        Ok(TokenBatch { batch: indices.len(), block_size: t, inputs, targets })
    }
}
