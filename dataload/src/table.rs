//! What the Arrow and Parquet sources share: column selection, shard schema checks, and the
//! collation of rows from several record batches into one.

use std::path::{Path, PathBuf};

use arrow_array::RecordBatch;
use arrow_schema::{Schema, SchemaRef};
use arrow_select::interleave::interleave_record_batch;

use crate::error::{DataloadError, Result};
use crate::source::ShardIndex;

/// Indices in `schema` of the `columns` asked for (all columns when `None`), in the order
/// asked for.
pub(crate) fn resolve_columns(schema: &Schema, columns: Option<&[String]>, path: &Path) -> Result<Vec<usize>> {
    match columns {
        None => Ok((0..schema.fields().len()).collect()),
        Some(cols) => cols
            .iter()
            .map(|c| {
                schema.index_of(c).map_err(|_| DataloadError::MissingColumn {
                    path: path.to_owned(),
                    column: c.clone(),
                    available: schema.fields().iter().map(|f| f.name().as_str()).collect::<Vec<_>>().join(", "),
                })
            })
            .collect(),
    }
}

/// Refuses a shard whose (selected) schema differs from the first shard's in names or types.
pub(crate) fn check_same_schema(first: &Schema, first_path: &Path, other: &Schema, path: &Path) -> Result<()> {
    let mismatch =
        |reason: String| DataloadError::SchemaMismatch { path: path.to_owned(), first: first_path.to_owned(), reason };
    if first.fields().len() != other.fields().len() {
        return Err(mismatch(format!("{} columns, not {}", other.fields().len(), first.fields().len())));
    }
    for (a, b) in first.fields().iter().zip(other.fields()) {
        if a.name() != b.name() {
            return Err(mismatch(format!("column `{}` where `{}` was expected", b.name(), a.name())));
        }
        if a.data_type() != b.data_type() {
            return Err(mismatch(format!("column `{}` is {}, not {}", a.name(), b.data_type(), a.data_type())));
        }
    }
    Ok(())
}

/// Collates `rows` — `(unit, row in unit)` pairs, `unit` indexing `units` — into one record
/// batch with `schema`, the rows in the order given. `units` holds only the units the rows
/// touch; every buffer of the result is allocated once.
fn collate(schema: &SchemaRef, units: &[RecordBatch], rows: &[(usize, usize)]) -> Result<RecordBatch> {
    if rows.is_empty() {
        return Ok(RecordBatch::new_empty(schema.clone()));
    }
    let refs: Vec<&RecordBatch> = units.iter().collect();
    interleave_record_batch(&refs, rows).map_err(|e| DataloadError::BadRecord {
        path: PathBuf::from("<batch>"),
        row: 0,
        column: "*".into(),
        reason: e.to_string(),
    })
}

/// The rows at global `indices` of a dataset made of record-batch units (Arrow record batches,
/// Parquet row groups), collated in order; each unit a batch touches is fetched once, by `unit`.
pub(crate) fn gather_rows(
    schema: &SchemaRef,
    index: &ShardIndex,
    indices: &[u64],
    unit: impl Fn(usize) -> Result<RecordBatch>,
) -> Result<RecordBatch> {
    let located = indices.iter().map(|&i| index.locate(i)).collect::<Result<Vec<_>>>()?;
    let units: Vec<usize> = located.iter().map(|(u, _)| *u).collect();
    let (distinct, slots) = distinct_units(&units);
    let touched = distinct.into_iter().map(unit).collect::<Result<Vec<_>>>()?;
    let rows: Vec<(usize, usize)> = slots.iter().zip(&located).map(|(&s, &(_, r))| (s, r as usize)).collect();
    collate(schema, &touched, &rows)
}

/// The distinct units among `wanted` (sorted), and for each entry of `wanted` its position in
/// that list: what [`collate`] needs to be given only the units a batch touches.
fn distinct_units(wanted: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let mut distinct = wanted.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let slots = wanted.iter().map(|u| distinct.binary_search(u).unwrap_or(0)).collect();
    (distinct, slots)
}
