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

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use arrow_ipc::convert::try_fb_to_schema;
use arrow_ipc::reader::{read_footer_length, FileDecoder, StreamDecoder};
use arrow_schema::SchemaRef;

use crate::error::{DataloadError, Result};
use crate::mmap::map_file;
use crate::source::{resolve_files, DataFile, FileFingerprint, Fingerprint, ShardIndex, Source};
use crate::table::{check_same_schema, gather_rows, resolve_columns};

const FILE_MAGIC: &[u8] = b"ARROW1";

/// Rows of one or more Arrow IPC files or streams (see the module docs).
#[derive(Debug, Clone)]
pub struct ArrowDataset {
    schema: SchemaRef,
    /// Every record batch of every file, in dataset order.
    batches: Vec<RecordBatch>,
    /// Rows per record batch.
    index: ShardIndex,
    fingerprint: Fingerprint,
    /// The files, in dataset order, with the address and length of their memory maps.
    files: Vec<MappedFile>,
    /// The file (index in `files`) of each record batch.
    batch_file: Vec<usize>,
}

/// One file of an [`ArrowDataset`] and where its memory map lies (the record batches keep the
/// map alive, so the range stays valid as long as the dataset).
#[derive(Debug, Clone)]
struct MappedFile {
    path: PathBuf,
    addr: usize,
    len: usize,
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
        for file in &files {
            let (file_schema, file_batches, size, addr) = read_file(file, columns)?;
            batch_file.extend(std::iter::repeat_n(mapped.len(), file_batches.len()));
            mapped.push(MappedFile { path: file.path.clone(), addr, len: usize::try_from(size).unwrap_or(0) });
            match &schema {
                None => schema = Some((file_schema, file.path.clone())),
                Some((first, first_path)) => check_same_schema(first, first_path, &file_schema, &file.path)?,
            }
            let rows = file_batches.iter().map(|b| b.num_rows() as u64).sum();
            fps.push(FileFingerprint { name: file.name.clone(), size, rows });
            batches.extend(file_batches);
        }
        let (schema, _) = schema.ok_or(DataloadError::Worker { reason: "no files".into() })?;
        let options = columns.map(|c| format!("columns={}", c.join(","))).unwrap_or_default();
        Ok(Self {
            index: ShardIndex::new(batches.iter().map(|b| b.num_rows() as u64)),
            schema,
            batches,
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
        let batch = self.batches[unit].slice(row, n);
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
        gather_rows(&self.schema, &self.index, indices, |u| Ok(self.batches[u].clone()))
    }
}

/// The (selected) schema, the record batches, the size of one file and the address of its map.
fn read_file(file: &DataFile, columns: Option<&[String]>) -> Result<(SchemaRef, Vec<RecordBatch>, u64, usize)> {
    let bytes = map_file(&file.path)?;
    let size = bytes.len() as u64;
    let addr = bytes.as_ptr() as usize;
    let path = file.path.clone();
    let buffer = Buffer::from(bytes);
    let (schema, batches) = if buffer.starts_with(FILE_MAGIC) {
        read_ipc_file(&buffer, columns, &path)?
    } else {
        read_ipc_stream(buffer, columns, &path)?
    };
    Ok((schema, batches, size, addr))
}

fn bad(path: &Path, reason: impl ToString) -> DataloadError {
    DataloadError::BadFormat { path: path.to_owned(), format: "arrow ipc", reason: reason.to_string() }
}

fn read_ipc_file(buffer: &Buffer, columns: Option<&[String]>, path: &Path) -> Result<(SchemaRef, Vec<RecordBatch>)> {
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
        decoder.read_dictionary(block, &data).map_err(|e| bad(path, e))?;
    }
    let mut batches = Vec::new();
    let mut row = 0u64;
    for block in footer.recordBatches().iter().flatten() {
        let data = block_data(block.offset(), block.metaDataLength(), block.bodyLength())?;
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
        batches.push(batch);
    }
    Ok((schema, batches))
}

fn read_ipc_stream(
    mut buffer: Buffer,
    columns: Option<&[String]>,
    path: &Path,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
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
