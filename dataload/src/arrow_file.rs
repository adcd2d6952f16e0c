//! Arrow IPC files and streams, memory-mapped, as a table of rows.
//!
//! # On disk
//!
//! Both forms are a sequence of encapsulated messages (a `0xFFFFFFFF` continuation marker, a
//! 4-byte little-endian length, a flatbuffer `Message`, then the message body holding the
//! column buffers at 8-byte aligned offsets). The first message is the schema; then come
//! dictionary batches and record batches.
//!
//! * The *file* form (`.arrow`, `.feather` v2, `.ipc`) is framed by the magic `ARROW1` (padded
//!   to 8 bytes) at the start and `ARROW1` at the end, just after a flatbuffer `Footer` and
//!   its 4-byte length. The footer repeats the schema and lists each record batch's block
//!   (offset, metadata length, body length), which is what gives random access.
//! * The *stream* form (`.arrows`) has no footer: messages follow one another until an
//!   end-of-stream marker (or the end of the file). It is read once, message by message.
//!
//! Either way the record batches are decoded when the dataset is opened, and decoding is
//! zero-copy: the columns point into the memory map. Opening therefore costs the metadata,
//! not the data; a batch of rows is then gathered from the record batches it touches.
//!
//! A record batch whose body is compressed (LZ4 frame or zstd, `BodyCompression` in its
//! message) cannot be viewed in place. In the file form it stays packed: its row count comes
//! from the message header, and it is decompressed when rows of it are read, the last few kept
//! (memory is a few record batches, not the file). A stream has no footer to find its record
//! batches by, so a compressed stream is decompressed whole when opened.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use arrow_ipc::convert::try_fb_to_schema;
use arrow_ipc::reader::{read_footer_length, FileDecoder, StreamDecoder};
use arrow_ipc::Block;
use arrow_schema::SchemaRef;

use crate::error::{DataloadError, Result};
use crate::mmap::{map_file, FileGuard};
use crate::source::{resolve_files, DataFile, FileFingerprint, Fingerprint, ShardIndex, Source};
use crate::table::{check_same_schema, gather_rows, resolve_columns};

const FILE_MAGIC: &[u8] = b"ARROW1";
/// Decompressed record batches kept for reuse.
const PACKED_CACHE: usize = 4;
/// A compressed body may declare at most this many times its own size once decompressed (and
/// always [`MIN_DECLARED`]): arrow allocates what a buffer declares before decompressing it, so
/// an unchecked 8-byte length in a tiny file would ask for exabytes.
const MAX_RATIO: u64 = 256;
const MIN_DECLARED: u64 = 64 << 20;

/// Rows of one or more Arrow IPC files or streams (see the module docs).
#[derive(Debug, Clone)]
pub struct ArrowDataset {
    schema: SchemaRef,
    /// Every record batch of every file, in dataset order.
    batches: Vec<Unit>,
    /// The last compressed record batches decoded, by index in `batches`, newest last.
    unpacked: Arc<Mutex<Vec<(usize, RecordBatch)>>>,
    /// Rows per record batch.
    index: ShardIndex,
    fingerprint: Fingerprint,
    /// The files, in dataset order, with the address and length of their memory maps.
    files: Vec<MappedFile>,
    /// The file (index in `files`) of each record batch.
    batch_file: Vec<usize>,
}

/// One record batch: decoded in place, or compressed and decoded when read.
#[derive(Debug, Clone)]
enum Unit {
    Viewed(RecordBatch),
    Packed(Arc<Packed>),
}

/// A compressed record batch of an IPC file: its block in the memory map and the file's
/// decoder (schema, projection, dictionaries).
#[derive(Debug)]
struct Packed {
    decoder: Arc<FileDecoder>,
    block: Block,
    data: Buffer,
    rows: usize,
    path: PathBuf,
    first_row: u64,
}

impl Unit {
    fn num_rows(&self) -> usize {
        match self {
            Unit::Viewed(b) => b.num_rows(),
            Unit::Packed(p) => p.rows,
        }
    }
}

/// One file of an [`ArrowDataset`] and where its memory map lies (the record batches keep the
/// map alive, so the range stays valid as long as the dataset).
#[derive(Debug, Clone)]
struct MappedFile {
    path: PathBuf,
    addr: usize,
    len: usize,
    guard: Option<FileGuard>,
}

/// Rows `start..start + len` of an [`ArrowDataset`] that lie in one record batch: that batch
/// sliced (no copy), and for each column where its values lie in the file (see
/// [`ArrowDataset::contiguous_rows`]).
#[derive(Debug, Clone)]
pub struct ContiguousRows {
    /// The rows, sliced out of their record batch.
    pub batch: RecordBatch,
    /// Per column: `(file index, byte offset in the file)` of the first row's value, when the
    /// column's values can be read straight from the file.
    pub in_file: Vec<Option<(usize, usize)>>,
}

impl ArrowDataset {
    /// Opens a file, a directory of `.arrow`/`.arrows`/`.ipc`/`.feather` files, or a glob,
    /// keeping only `columns` (in that order) when given.
    pub fn open(spec: impl AsRef<Path>, columns: Option<&[String]>) -> Result<Self> {
        let files = resolve_files(spec.as_ref(), &[".arrow", ".arrows", ".ipc", ".feather"])?;
        let mut schema: Option<(SchemaRef, PathBuf)> = None;
        let mut batches = Vec::new();
        let mut fps = Vec::new();
        let mut mapped = Vec::new();
        let mut batch_file = Vec::new();
        let mut total = 0u64;
        for file in &files {
            let (file_schema, file_batches, size, addr, guard) = read_file(file, columns)?;
            batch_file.extend(std::iter::repeat_n(mapped.len(), file_batches.len()));
            let len = usize::try_from(size).unwrap_or(0);
            mapped.push(MappedFile { path: file.path.clone(), addr, len, guard: Some(guard) });
            match &schema {
                None => schema = Some((file_schema, file.path.clone())),
                Some((first, first_path)) => check_same_schema(first, first_path, &file_schema, &file.path)?,
            }
            let rows: u64 = file_batches.iter().map(|b| b.num_rows() as u64).sum();
            total = total.checked_add(rows).filter(|&t| t <= crate::source::MAX_SAMPLES).ok_or_else(|| {
                bad(&file.path, format!("{rows} rows bring the dataset past {} rows", crate::source::MAX_SAMPLES))
            })?;
            fps.push(FileFingerprint { name: file.name.clone(), size, rows });
            batches.extend(file_batches);
        }
        let (schema, _) = schema.ok_or(DataloadError::Worker { reason: "no files".into() })?;
        let options = columns.map(|c| format!("columns={}", c.join(","))).unwrap_or_default();
        Ok(Self {
            index: ShardIndex::new(batches.iter().map(|b| b.num_rows() as u64)),
            schema,
            batches,
            unpacked: Arc::new(Mutex::new(Vec::new())),
            fingerprint: Fingerprint { format: "arrow", options, files: fps },
            files: mapped,
            batch_file,
        })
    }

    /// The paths of the files, in dataset order (the file indices of [`ContiguousRows`]).
    pub fn file_paths(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }

    /// Rows `start..start + len` when they lie in one record batch (`None` otherwise, or when
    /// `len` is 0). A column's values are located in the file when it is a fixed-width
    /// primitive without nulls whose value buffer lies in the file's memory map (an
    /// uncompressed IPC file: a compressed one is decoded into fresh memory) at an offset
    /// aligned to the value width.
    pub fn contiguous_rows(&self, start: u64, len: u64) -> Result<Option<ContiguousRows>> {
        if len == 0 {
            return Ok(None);
        }
        let end =
            start.checked_add(len - 1).ok_or(DataloadError::IndexOutOfRange { index: u64::MAX, len: self.len() })?;
        let (unit, row) = self.index.locate(start)?;
        let (last_unit, _) = self.index.locate(end)?;
        if unit != last_unit {
            return Ok(None);
        }
        let (row, n) = (usize::try_from(row).unwrap_or(usize::MAX), usize::try_from(len).unwrap_or(usize::MAX));
        let batch = self.batch(unit)?.slice(row, n);
        let file = &self.files[self.batch_file[unit]];
        let in_file = batch
            .columns()
            .iter()
            .map(|col| {
                let width = col.data_type().primitive_width()?;
                let data = col.to_data();
                if col.null_count() > 0 || !data.child_data().is_empty() || data.buffers().len() != 1 {
                    return None;
                }
                let addr = (data.buffers()[0].as_ptr() as usize).checked_add(data.offset().checked_mul(width)?)?;
                let offset = addr.checked_sub(file.addr)?;
                let fits = offset.checked_add(n.checked_mul(width)?).is_some_and(|e| e <= file.len);
                (fits && offset % width == 0).then_some((self.batch_file[unit], offset))
            })
            .collect();
        Ok(Some(ContiguousRows { batch, in_file }))
    }

    /// Record batch `u`, decompressed first if it is packed, once its file is checked to be as
    /// long as when it was mapped (see [`crate::mmap`]).
    fn batch(&self, u: usize) -> Result<RecordBatch> {
        let file = &self.files[self.batch_file[u]];
        if let Some(guard) = &file.guard {
            guard.check(&file.path)?;
        }
        let packed = match &self.batches[u] {
            Unit::Viewed(b) => return Ok(b.clone()),
            Unit::Packed(p) => p,
        };
        let mut cache = self.unpacked.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(i) = cache.iter().position(|(k, _)| *k == u) {
            let hit = cache.remove(i);
            let b = hit.1.clone();
            cache.push(hit);
            return Ok(b);
        }
        let b = unpanicked(&packed.path, || packed.decoder.read_record_batch(&packed.block, &packed.data))?
            .map_err(|e| DataloadError::BadRecord {
                path: packed.path.clone(),
                row: packed.first_row,
                column: "*".into(),
                reason: e.to_string(),
            })?
            .ok_or_else(|| bad(&packed.path, "record batch block holds no record batch"))?;
        if b.num_rows() != packed.rows {
            return Err(bad(
                &packed.path,
                format!("a record batch of {} rows whose header says {}", b.num_rows(), packed.rows),
            ));
        }
        if cache.len() >= PACKED_CACHE {
            cache.remove(0);
        }
        cache.push((u, b.clone()));
        Ok(b)
    }

    /// Schema of the rows (after column selection).
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Number of record batches, over all files.
    pub fn num_record_batches(&self) -> usize {
        self.batches.len()
    }
}

impl Source for ArrowDataset {
    type Batch = RecordBatch;

    fn len(&self) -> u64 {
        self.index.total()
    }

    fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    fn read_batch(&self, indices: &[u64]) -> Result<RecordBatch> {
        gather_rows(&self.schema, &self.index, indices, |u| self.batch(u))
    }
}

/// The (selected) schema, the record batches, the size of one file, the address of its map and
/// its guard.
fn read_file(file: &DataFile, columns: Option<&[String]>) -> Result<(SchemaRef, Vec<Unit>, u64, usize, FileGuard)> {
    let (bytes, guard) = map_file(&file.path)?;
    let size = bytes.len() as u64;
    let addr = bytes.as_ptr() as usize;
    let (schema, batches) = read_buffer(Buffer::from(bytes), columns, &file.path)?;
    Ok((schema, batches, size, addr, guard))
}

/// The schema and record batches of the IPC file or stream `buffer` (the bytes of `path`).
fn read_buffer(buffer: Buffer, columns: Option<&[String]>, path: &Path) -> Result<(SchemaRef, Vec<Unit>)> {
    unpanicked(path, || {
        if buffer.starts_with(FILE_MAGIC) {
            read_ipc_file(&buffer, columns, path)
        } else {
            let (schema, batches) = read_ipc_stream(buffer, columns, path)?;
            Ok((schema, batches.into_iter().map(Unit::Viewed).collect()))
        }
    })?
}

/// Runs `f`, a call into arrow's decoders, turning a panic into an error naming `path`.
///
/// Every offset and length a message declares is checked before arrow sees it
/// ([`check_message`]), which is what keeps arrow's own slicing from panicking; this is the
/// last line behind those checks, for a combination they do not foresee: a malformed file is
/// an error, never an abort of the process (or a `PanicException` in Python).
fn unpanicked<T>(path: &Path, f: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        bad(path, format!("arrow's decoder failed on it ({})", crate::error::panic_message(&*payload)))
    })
}

/// The fuzz target's reader ([`crate::fuzz::arrow_ipc`]): `data` as an IPC file or stream,
/// then every record batch read, decompressed when packed, and a few rows gathered.
pub(crate) fn fuzz_read(data: &[u8]) {
    let path = Path::new("fuzz.arrow");
    // Copied into arrow's own (64-byte aligned) memory, as a memory map is page-aligned.
    let Ok((schema, batches)) = read_buffer(Buffer::from_slice_ref(data), None, path) else { return };
    let index = ShardIndex::new(batches.iter().map(|b| b.num_rows() as u64));
    let files = vec![MappedFile { path: path.to_owned(), addr: 0, len: 0, guard: None }];
    let ds = ArrowDataset {
        batch_file: vec![0; batches.len()],
        schema,
        batches,
        unpacked: Arc::new(Mutex::new(Vec::new())),
        index,
        fingerprint: Fingerprint { format: "arrow", options: String::new(), files: Vec::new() },
        files,
    };
    let n = ds.len();
    if n > 0 {
        let _ = ds.read_batch(&[0, n - 1, n / 2]);
    }
    for u in 0..ds.num_record_batches().min(64) {
        let _ = ds.batch(u);
    }
}

fn bad(path: &Path, reason: impl ToString) -> DataloadError {
    DataloadError::BadFormat { path: path.to_owned(), format: "arrow ipc", reason: reason.to_string() }
}

fn read_ipc_file(buffer: &Buffer, columns: Option<&[String]>, path: &Path) -> Result<(SchemaRef, Vec<Unit>)> {
    let len = buffer.len();
    let trailer: [u8; 10] = len
        .checked_sub(10)
        .and_then(|s| buffer.get(s..))
        .and_then(|t| t.try_into().ok())
        .ok_or(DataloadError::Truncated { path: path.to_owned(), expected: 18, found: len as u64 })?;
    let footer_len = read_footer_length(trailer).map_err(|e| bad(path, e))?;
    let footer_start = (len - 10)
        .checked_sub(footer_len)
        .filter(|&s| s >= 8)
        .ok_or_else(|| bad(path, format!("footer of {footer_len} bytes does not fit in {len} bytes")))?;
    let footer = arrow_ipc::root_as_footer(&buffer[footer_start..len - 10]).map_err(|e| bad(path, e))?;
    let full = footer.schema().ok_or_else(|| bad(path, "footer has no schema"))?;
    let full = Arc::new(try_fb_to_schema(full).map_err(|e| bad(path, e))?);
    let projection = resolve_columns(&full, columns, path)?;
    let schema = Arc::new(full.project(&projection).map_err(|e| bad(path, e))?);
    let mut decoder = FileDecoder::new(full, footer.version()).with_projection(projection);
    let block_data = |offset: i64, meta: i32, body: i64| -> Result<Buffer> {
        let start = usize::try_from(offset).ok();
        let block_len = usize::try_from(meta).ok().zip(usize::try_from(body).ok()).and_then(|(m, b)| m.checked_add(b));
        match (start, block_len) {
            (Some(s), Some(l)) if s.checked_add(l).is_some_and(|e| e <= len) => Ok(buffer.slice_with_length(s, l)),
            _ => Err(bad(path, format!("block at offset {offset} ({meta} + {body} bytes) is outside the file"))),
        }
    };
    for block in footer.dictionaries().iter().flatten() {
        let data = block_data(block.offset(), block.metaDataLength(), block.bodyLength())?;
        check_block(&data, block.metaDataLength(), path)?;
        decoder.read_dictionary(block, &data).map_err(|e| bad(path, e))?;
    }
    let decoder = Arc::new(decoder);
    let mut batches = Vec::new();
    let mut row = 0u64;
    for block in footer.recordBatches().iter().flatten() {
        let data = block_data(block.offset(), block.metaDataLength(), block.bodyLength())?;
        if let Some(rows) = check_block(&data, block.metaDataLength(), path)? {
            let packed = Packed {
                decoder: Arc::clone(&decoder),
                block: *block,
                data,
                rows,
                path: path.to_owned(),
                first_row: row,
            };
            row += rows as u64;
            batches.push(Unit::Packed(Arc::new(packed)));
            continue;
        }
        let batch = decoder
            .read_record_batch(block, &data)
            .map_err(|e| DataloadError::BadRecord {
                path: path.to_owned(),
                row,
                column: "*".into(),
                reason: e.to_string(),
            })?
            .ok_or_else(|| bad(path, "record batch block holds no record batch"))?;
        row += batch.num_rows() as u64;
        batches.push(Unit::Viewed(batch));
    }
    Ok((schema, batches))
}

/// Checks the message of a block (a record batch or a dictionary batch) against the block
/// before arrow decodes it ([`check_message`]), and returns the row count of a record batch
/// whose body is compressed, from its message header (`None` for an uncompressed one, decoded
/// in place), once the sizes its buffers declare are checked too. `meta_len` is the block's
/// metadata length, prefix included: the body follows it.
fn check_block(data: &Buffer, meta_len: i32, path: &Path) -> Result<Option<usize>> {
    let meta_len = usize::try_from(meta_len).ok().filter(|&m| m <= data.len());
    let (prefix, declared) = match data.get(..4) {
        Some([0xff, 0xff, 0xff, 0xff]) => (8, data.get(4..8)),
        Some(w) => (4, Some(w)),
        None => (4, None),
    };
    let declared = declared.map(|w| i32::from_le_bytes([w[0], w[1], w[2], w[3]]));
    let (Some(meta_len), Some(declared)) = (meta_len, declared) else {
        return Err(bad(path, "a block shorter than its message prefix"));
    };
    // The flatbuffer is the metadata the prefix announces, inside the block's metadata.
    let fb_end = usize::try_from(declared).ok().and_then(|d| d.checked_add(prefix)).filter(|&e| e <= meta_len);
    let meta = fb_end.and_then(|e| data.get(prefix..e)).ok_or_else(|| {
        bad(path, format!("a message of {declared} bytes does not fit the block's {meta_len} bytes of metadata"))
    })?;
    let message = arrow_ipc::root_as_message(meta).map_err(|e| bad(path, e))?;
    let body = data.get(meta_len..).unwrap_or_default();
    let batch = match (message.header_as_record_batch(), message.header_as_dictionary_batch()) {
        (Some(b), _) => b,
        (None, Some(d)) => match d.data() {
            Some(b) => b,
            None => return Ok(None),
        },
        (None, None) => return Ok(None),
    };
    let body_addr = (data.as_ptr() as usize).wrapping_add(meta_len);
    check_message(&batch, message.bodyLength(), body.len() as u64, body_addr, path)?;
    if !check_declared_sizes(&batch, body, path)? {
        return Ok(None);
    }
    usize::try_from(batch.length())
        .map(Some)
        .map_err(|_| bad(path, format!("a record batch of {} rows", batch.length())))
}

/// Checks every count, offset and length a record batch message declares, before arrow slices
/// buffers by them: the row count and each field node's length and null count are not negative
/// (nor more nulls than values), the message's body is no longer than the `body_len` bytes
/// there are, and each buffer lies inside that body (no negative offset or length, no offset
/// plus length that wraps or passes its end) at an 8-byte aligned address (`body_addr` is where
/// the body is in memory). Arrow panics on a buffer past the end of its body, or misaligned.
fn check_message(
    batch: &arrow_ipc::RecordBatch<'_>,
    declared_body: i64,
    body_len: u64,
    body_addr: usize,
    path: &Path,
) -> Result<()> {
    let body = u64::try_from(declared_body).ok().filter(|&b| b <= body_len).ok_or_else(|| {
        bad(path, format!("a message declares a body of {declared_body} bytes where its block holds {body_len}"))
    })?;
    if batch.length() < 0 {
        return Err(bad(path, format!("a record batch of {} rows", batch.length())));
    }
    for (k, node) in batch.nodes().into_iter().flatten().enumerate() {
        let (len, nulls) = (node.length(), node.null_count());
        if len < 0 || nulls < 0 || nulls > len {
            return Err(bad(path, format!("field node {k} declares {len} values with {nulls} nulls")));
        }
    }
    for (k, b) in batch.buffers().into_iter().flatten().enumerate() {
        let (offset, len) = (b.offset(), b.length());
        let end = u64::try_from(offset).ok().zip(u64::try_from(len).ok()).and_then(|(o, l)| o.checked_add(l));
        if end.is_none_or(|e| e > body) {
            return Err(bad(
                path,
                format!("buffer {k} at body offset {offset} ({len} bytes) lies outside the {body}-byte body"),
            ));
        }
        // The format aligns every buffer to 8 bytes; arrow's validation reads offsets and
        // values in place, and panics on ones that are not aligned to their type.
        if len > 0 && !body_addr.wrapping_add(offset as usize).is_multiple_of(8) {
            return Err(bad(path, format!("buffer {k} at body offset {offset} is not aligned to 8 bytes")));
        }
    }
    if let Some(counts) = batch.variadicBufferCounts() {
        if let Some(c) = counts.iter().find(|&c| c < 0) {
            return Err(bad(path, format!("a variadic buffer count of {c}")));
        }
    }
    Ok(())
}

/// For a compressed batch, checks what its buffers declare against [`MAX_RATIO`]; returns
/// whether it is compressed.
fn check_declared_sizes(batch: &arrow_ipc::RecordBatch<'_>, body: &[u8], path: &Path) -> Result<bool> {
    if batch.compression().is_none() {
        return Ok(false);
    }
    let mut total = 0u64;
    for b in batch.buffers().into_iter().flatten() {
        if b.length() == 0 {
            continue;
        }
        let head = usize::try_from(b.offset()).ok().and_then(|o| body.get(o..o.checked_add(8)?)).ok_or_else(|| {
            bad(path, format!("a compressed buffer at body offset {} lies outside the body", b.offset()))
        })?;
        let declared = i64::from_le_bytes(head.try_into().unwrap_or([0; 8]));
        let n = match declared {
            -1 => u64::try_from(b.length()).unwrap_or(u64::MAX).saturating_sub(8),
            n => u64::try_from(n).map_err(|_| bad(path, format!("a compressed buffer declares {n} bytes")))?,
        };
        total = total.saturating_add(n);
    }
    let cap = (body.len() as u64).saturating_mul(MAX_RATIO).max(MIN_DECLARED);
    if total > cap {
        return Err(bad(
            path,
            format!(
                "a compressed record batch declares {total} bytes from a {}-byte body (more than {MAX_RATIO} times, or {MIN_DECLARED}): refused",
                body.len()
            ),
        ));
    }
    Ok(true)
}

/// Checks every message of a stream before it is decoded (its offsets and lengths, and the
/// sizes its compressed buffers declare): the stream is read once, whole, so each declared
/// size must be sane before arrow slices or allocates by it.
fn check_stream_sizes(buffer: &[u8], path: &Path) -> Result<()> {
    let mut at = 0usize;
    while at + 4 <= buffer.len() {
        let word = |i: usize| buffer.get(i..i + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let (meta_len, fb_at) = match word(at) {
            Some(0xffff_ffff) => (word(at + 4).unwrap_or(0) as usize, at + 8),
            Some(n) => (n as usize, at + 4),
            None => break,
        };
        if meta_len == 0 {
            break;
        }
        let Some(meta) = fb_at.checked_add(meta_len).and_then(|end| buffer.get(fb_at..end)) else { break };
        let Ok(message) = arrow_ipc::root_as_message(meta) else { break };
        let body_len = usize::try_from(message.bodyLength()).unwrap_or(usize::MAX);
        let body_at = fb_at + meta_len;
        let body = body_at.checked_add(body_len).and_then(|end| buffer.get(body_at..end)).unwrap_or_default();
        let batch =
            message.header_as_record_batch().or_else(|| message.header_as_dictionary_batch().and_then(|d| d.data()));
        if let Some(b) = batch {
            // A stream cut short is arrow's to report (it waits for the rest of the body); what
            // the message declares must fit the body it declares.
            let declared = u64::try_from(message.bodyLength()).unwrap_or(0);
            check_message(&b, message.bodyLength(), declared, (buffer.as_ptr() as usize).wrapping_add(body_at), path)?;
            check_declared_sizes(&b, body, path)?;
        }
        at = body_at.saturating_add(body_len);
    }
    Ok(())
}

fn read_ipc_stream(
    mut buffer: Buffer,
    columns: Option<&[String]>,
    path: &Path,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    check_stream_sizes(&buffer, path)?;
    let mut decoder = StreamDecoder::new();
    let mut batches = Vec::new();
    let mut row = 0u64;
    while !buffer.is_empty() {
        let decoded = decoder.decode(&mut buffer).map_err(|e| DataloadError::BadRecord {
            path: path.to_owned(),
            row,
            column: "*".into(),
            reason: e.to_string(),
        })?;
        if let Some(batch) = decoded {
            row += batch.num_rows() as u64;
            batches.push(batch);
        }
    }
    decoder.finish().map_err(|e| bad(path, e))?;
    let full = decoder.schema().ok_or_else(|| bad(path, "the stream holds no schema message"))?;
    let projection = resolve_columns(&full, columns, path)?;
    let schema = Arc::new(full.project(&projection).map_err(|e| bad(path, e))?);
    let batches = batches.iter().map(|b| b.project(&projection).map_err(|e| bad(path, e))).collect::<Result<_>>()?;
    Ok((schema, batches))
}
