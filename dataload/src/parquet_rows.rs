//! Parquet files as a table of rows, read by row through their row groups.
//!
//! # On disk
//!
//! A Parquet file is `PAR1`, the row groups, a Thrift-encoded `FileMetaData` footer, the
//! footer's 4-byte little-endian length, and `PAR1` again. Each row group holds one *column
//! chunk* per leaf column: pages of encoded (and usually compressed: snappy by default in
//! pyarrow, zstd here too) values plus definition levels for nulls. The footer lists, per row
//! group, its row count and where each column chunk sits. Nothing smaller than a page can be
//! decoded on its own, and pages only make sense in order from the start of their chunk.
//!
//! # Random access
//!
//! Opening a file reads only its footer. The row counts give a row-group index (prefix sums,
//! over all files of the dataset), so row `i` is found by binary search. Reading a row decodes
//! its whole row group — only the selected columns (a projection mask, so unselected column
//! chunks are never read) — into one record batch, kept in a small bounded LRU cache shared
//! by the loader's workers: a batch of sequential rows decodes each row group once, and a
//! shuffled batch touches at most `batch size` of them. The cache holds row groups, not
//! bytes: row groups of a few hundred MB need a small cache.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{RecordBatch, RecordBatchReader};
use arrow_schema::SchemaRef;
use arrow_select::concat::concat_batches;
use bytes::Bytes;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder};
use parquet::arrow::ProjectionMask;

use crate::error::{DataloadError, Result};
use crate::mmap::{map_file, FileGuard};
use crate::source::{resolve_files, DataFile, FileFingerprint, Fingerprint, ShardIndex, Source, UnitCache};
use crate::table::{check_same_schema, gather_rows, resolve_columns};

/// Row groups kept decoded by default.
pub const DEFAULT_ROW_GROUP_CACHE: usize = 8;

#[derive(Debug)]
struct ParquetFile {
    file: DataFile,
    bytes: Bytes,
    guard: FileGuard,
    metadata: ArrowReaderMetadata,
    /// Selected root columns, in file order.
    roots: Vec<usize>,
    /// Where each selected column (in the order asked for) sits in a decoded batch.
    order: Vec<usize>,
}

/// Rows of one or more Parquet files (see the module docs).
#[derive(Debug)]
pub struct ParquetDataset {
    files: Vec<ParquetFile>,
    schema: SchemaRef,
    /// `(file, row group, its first row in the file)` of each row group of the dataset.
    groups: Vec<(usize, usize, u64)>,
    /// Rows per row group.
    index: ShardIndex,
    cache: UnitCache<RecordBatch>,
    fingerprint: Fingerprint,
}

impl ParquetDataset {
    /// Opens a file, a directory of `.parquet` files, or a glob, keeping only `columns` (in
    /// that order) when given, with a cache of `cache_row_groups` decoded row groups.
    pub fn open(spec: impl AsRef<Path>, columns: Option<&[String]>, cache_row_groups: usize) -> Result<Self> {
        let mut files = Vec::new();
        let mut schema: Option<(SchemaRef, PathBuf)> = None;
        let mut groups = Vec::new();
        let mut counts = Vec::new();
        let mut fps = Vec::new();
        let mut total = 0u64;
        for file in resolve_files(spec.as_ref(), &[".parquet", ".pq"])? {
            let path = file.path.clone();
            let (bytes, guard) = map_file(&file.path)?;
            let metadata = ArrowReaderMetadata::load(&bytes, ArrowReaderOptions::new()).map_err(|e| {
                DataloadError::BadFormat { path: path.clone(), format: "parquet", reason: e.to_string() }
            })?;
            let full = metadata.schema().clone();
            let wanted = resolve_columns(&full, columns, &path)?;
            let selected = Arc::new(full.project(&wanted).map_err(|e| DataloadError::BadFormat {
                path: path.clone(),
                format: "parquet",
                reason: e.to_string(),
            })?);
            match &schema {
                None => schema = Some((selected, path.clone())),
                Some((first, first_path)) => check_same_schema(first, first_path, &selected, &path)?,
            }
            let mut roots = wanted.clone();
            roots.sort_unstable();
            let order = wanted.iter().map(|w| roots.binary_search(w).unwrap_or(0)).collect();
            let meta = metadata.metadata();
            let mut rows = 0u64;
            for g in 0..meta.num_row_groups() {
                let n = row_group_rows(meta.row_group(g), g, &path)?;
                groups.push((files.len(), g, rows));
                counts.push(n);
                rows += n;
                total = total.checked_add(n).filter(|&t| t <= crate::source::MAX_SAMPLES).ok_or_else(|| {
                    DataloadError::BadFormat {
                        path: path.clone(),
                        format: "parquet",
                        reason: format!(
                            "row group {g} declares {n} rows, which brings the dataset past {} rows",
                            crate::source::MAX_SAMPLES
                        ),
                    }
                })?;
            }
            fps.push(FileFingerprint { name: file.name.clone(), size: bytes.len() as u64, rows });
            files.push(ParquetFile { file, bytes, guard, metadata, roots, order });
        }
        let (schema, _) = schema.ok_or(DataloadError::Worker { reason: "no files".into() })?;
        let options = columns.map(|c| format!("columns={}", c.join(","))).unwrap_or_default();
        Ok(Self {
            files,
            schema,
            groups,
            index: ShardIndex::new(counts),
            cache: UnitCache::new(cache_row_groups),
            fingerprint: Fingerprint { format: "parquet", options, files: fps },
        })
    }

    /// Schema of the rows (after column selection).
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Number of row groups, over all files.
    pub fn num_row_groups(&self) -> usize {
        self.groups.len()
    }

    /// Decodes row group `g` of the dataset (its selected columns).
    fn row_group(&self, g: usize) -> Result<RecordBatch> {
        self.cache.get_or_load(g, || {
            let (f, rg, first_row) = self.groups[g];
            let file = &self.files[f];
            file.guard.check(&file.file.path)?;
            decode(file, rg, &file.roots)
                .map_err(|reason| {
                    // Name the column: decode the selected columns one by one.
                    let column = file
                        .roots
                        .iter()
                        .find(|&&c| decode(file, rg, &[c]).is_err())
                        .map(|&c| file.metadata.schema().field(c).name().clone())
                        .unwrap_or_else(|| "*".into());
                    DataloadError::BadRecord { path: file.file.path.clone(), row: first_row, column, reason }
                })
                .and_then(|batch| {
                    batch.project(&file.order).map_err(|e| DataloadError::BadRecord {
                        path: file.file.path.clone(),
                        row: first_row,
                        column: "*".into(),
                        reason: e.to_string(),
                    })
                })
        })
    }
}

/// The most rows the Parquet reader is asked to decode at once.
const MAX_BATCH_ROWS: usize = 1 << 20;

/// The rows row group `g` of the file at `path` declares, once checked: never negative, and
/// never more than any of its column chunks holds values (each row has at least one value, a
/// null or an empty list included, in every column), so a footer cannot announce rows its
/// column chunks do not have.
fn row_group_rows(rg: &parquet::file::metadata::RowGroupMetaData, g: usize, path: &Path) -> Result<u64> {
    let bad = |reason: String| DataloadError::BadFormat { path: path.to_owned(), format: "parquet", reason };
    let n = rg.num_rows();
    let rows = u64::try_from(n).map_err(|_| bad(format!("row group {g} declares {n} rows")))?;
    for c in rg.columns() {
        if c.num_values() < n {
            return Err(bad(format!(
                "row group {g} declares {n} rows, but its column `{}` holds {} values",
                c.column_path(),
                c.num_values()
            )));
        }
    }
    Ok(rows)
}

/// Decodes the root columns `roots` of row group `rg` into one batch. The footer checks come
/// first; behind them, a panic in parquet's decoder (a combination they do not foresee) is an
/// error naming the file's defect, never an abort of the process, as for Arrow files.
fn decode(file: &ParquetFile, rg: usize, roots: &[usize]) -> std::result::Result<RecordBatch, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode_unguarded(file, rg, roots))).unwrap_or_else(
        |payload| Err(format!("parquet's decoder failed on it ({})", crate::error::panic_message(&*payload))),
    )
}

fn decode_unguarded(file: &ParquetFile, rg: usize, roots: &[usize]) -> std::result::Result<RecordBatch, String> {
    // The row count was checked against the column chunks when the file was opened, but those
    // are declarations too: the reader is asked for batches of at most a million rows, so that
    // what it reserves up front stays bounded whatever a footer says.
    let rows = usize::try_from(file.metadata.metadata().row_group(rg).num_rows()).unwrap_or(0).min(MAX_BATCH_ROWS);
    let mask = ProjectionMask::roots(file.metadata.metadata().file_metadata().schema_descr(), roots.iter().copied());
    let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(file.bytes.clone(), file.metadata.clone())
        .with_row_groups(vec![rg])
        .with_projection(mask)
        .with_batch_size(rows.max(1))
        .build()
        .map_err(|e| e.to_string())?;
    let schema = reader.schema();
    let parts = reader.collect::<std::result::Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
    match parts.len() {
        1 => Ok(parts.into_iter().next().unwrap_or_else(|| RecordBatch::new_empty(schema))),
        _ => concat_batches(&schema, &parts).map_err(|e| e.to_string()),
    }
}

impl Source for ParquetDataset {
    type Batch = RecordBatch;

    fn len(&self) -> u64 {
        self.index.total()
    }

    fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    fn read_batch(&self, indices: &[u64]) -> Result<RecordBatch> {
        gather_rows(&self.schema, &self.index, indices, |g| self.row_group(g))
    }
}
