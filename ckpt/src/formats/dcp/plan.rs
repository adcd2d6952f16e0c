//! Writing a DCP folder for M ranks, the way FSDP2 saves one.
//!
//! Each tensor FSDP2 would shard (every tensor of at least one dimension that the source held
//! sharded, or every such tensor when the source is a plain checkpoint) is cut along dim 0 with
//! `torch.chunk` rules ([`fsdp_state::chunk_rows`]); rank r's rows become one item of its file
//! `__r_0.distcp`. Ranks whose slice is empty get no item: torch collapses such chunks into one
//! anyway, and its loader needs only the chunks that hold data. Tensors saved whole (buffers,
//! Adam's `step`, 0-d values) and non-tensor items go to one rank each, the least loaded so far,
//! as DCP's save-plan dedup does.
//!
//! A tensor item is a `torch.save` zip of the chunk, written by our torch writer with its offsets
//! relative to the item's start; its storage bytes are range copies from the source, so nothing
//! is held in memory but headers. Non-tensor items are copied byte for byte: they are complete
//! archives already. The `.metadata` pickle is the trailer, written after every data file is
//! fsynced and renamed into place, so it is the commit marker, as in torch.

use std::path::{Path, PathBuf};

use super::encode::{self, OutChunk, OutItem, OutKind};
use super::metadata::PathElem;
use crate::error::{Error, IoContext, Result};
use crate::formats::torch::writer::{self, TorchLayout, TorchSeal, WStorage, WTensor};
use crate::ops::outcome::Outcome;
use crate::read::catalog::{Checkpoint, Chunk, TensorInfo};
use crate::read::dtype::Dtype;
use crate::read::shape::numel;
use crate::write::{self, Gather, Plan, RangeCopy, TargetFile, WriteOptions};

/// A tensor to write: its key and path in the state dict, and the catalog tensor whose stored
/// bytes are written (its dtype is what is stored).
#[derive(Clone, Debug)]
pub(crate) struct SrcTensor {
    pub key: String,
    pub path: Vec<PathElem>,
    pub info: TensorInfo,
    /// Shard along dim 0 (a parameter or optimizer state) rather than save whole.
    pub sharded: bool,
}

/// Tensors whose stored bytes come in at most this many runs are written as range copies of
/// each rank's slice; more (tensor-parallel shards, views) are gathered slice by slice.
const MAX_COPY_RUNS: u64 = 1 << 12;

/// A non-tensor item to write: carried over verbatim, or a value laid out here.
#[derive(Clone, Debug)]
pub(crate) struct SrcBytes {
    pub key: String,
    pub path: Vec<PathElem>,
    pub data: ValueData,
}

/// Where a non-tensor item's bytes come from.
#[derive(Clone, Debug)]
pub(crate) enum ValueData {
    /// A complete archive in a source file, copied byte for byte.
    Copied(Chunk),
    /// A `torch.save` archive of a value, laid out by the torch writer and written whole by the
    /// file's seal (a Megatron run's `common_state`, which no source holds).
    Pickled(TorchLayout),
}

impl ValueData {
    fn len(&self) -> u64 {
        match self {
            ValueData::Copied(c) => c.len,
            ValueData::Pickled(l) => l.file_len,
        }
    }
}

enum Placement {
    Rows { t: usize, start: u64, rows: u64 },
    Bytes { b: usize },
}

/// Writes `tensors` and `values` (reading from `ck`'s files) as a DCP folder `out` for `world`
/// ranks.
pub(crate) fn write_dcp(
    ck: &Checkpoint,
    tensors: &[SrcTensor],
    values: &[SrcBytes],
    out: &Path,
    world: u64,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    // Refused before the folder is created.
    check(tensors, out, world)?;
    // `.metadata` records the folder's absolute path; a dry run plans without creating it.
    let abs = match opts.job.is_some_and(crate::Job::is_dry_run) {
        true => std::path::absolute(out).at(out)?,
        false => {
            std::fs::create_dir_all(out).at(out)?;
            std::fs::canonicalize(out).at(out)?
        }
    };
    let Planned { mut plan, bytes } = plan_dcp(tensors, values, out, &abs, world)?;
    let meta_path = out.join(super::METADATA_NAME);
    // A previous DCP checkpoint in `out`: `.metadata` first. Writing over the source folder is
    // refused by the executor.
    plan.stale = write::stale_files(
        out,
        |n| n == super::METADATA_NAME || (n.starts_with("__") && n.ends_with(".distcp")),
        |n| n == super::METADATA_NAME,
    )?;

    crate::write::execute::execute(&plan, ck, opts)?;
    let mut written = plan.outputs();
    written.retain(|p| p != &meta_path);
    written.push(meta_path);
    Ok(Outcome {
        files: written,
        tensors: tensors.len(),
        bytes,
        values: values.iter().map(|v| v.key.clone()).collect(),
        world_size: Some(world),
        ..Outcome::default()
    })
}

/// A DCP folder planned: its rank files and `.metadata` (the last trailer), and the tensor
/// bytes it writes.
pub(crate) struct Planned {
    pub plan: Plan,
    pub bytes: u64,
}

/// Plans `tensors` and `values` as the DCP folder `out` for `world` ranks, `.metadata` (which
/// records `abs`, the folder's absolute path) its trailer. Nothing is created.
pub(crate) fn plan_dcp(
    tensors: &[SrcTensor],
    values: &[SrcBytes],
    out: &Path,
    abs: &Path,
    world: u64,
) -> Result<Planned> {
    let world_len = check(tensors, out, world)?;
    let per_rank = place(tensors, values, world, world_len);
    let (mut plan, items, bytes) = lay_out(tensors, values, &per_rank, out)?;
    plan.trailers.push((out.join(super::METADATA_NAME), encode::encode(&items, abs, &encode::uuid4())));
    Ok(Planned { plan, bytes })
}

/// The world size as a count of rank files, once `tensors` are known to fit torch files.
fn check(tensors: &[SrcTensor], out: &Path, world: u64) -> Result<usize> {
    let world_len = usize::try_from(world)
        .map_err(|_| Error::Misuse { path: out.to_path_buf(), misuse: crate::Misuse::WorldSizeOutOfRange { world } })?;
    for t in tensors {
        if !t.info.dtype.bits().is_multiple_of(8) {
            return Err(Error::NotInTorch { dst: out.to_path_buf(), tensor: t.key.clone(), dtype: t.info.dtype });
        }
    }
    Ok(world_len)
}

/// Who holds what: sharded rows first, then each whole tensor and value on the rank with the
/// fewest bytes planned so far (lowest rank on ties).
fn place(tensors: &[SrcTensor], values: &[SrcBytes], world: u64, world_len: usize) -> Vec<Vec<Placement>> {
    let mut per_rank: Vec<Vec<Placement>> = (0..world_len).map(|_| Vec::new()).collect();
    let mut load = vec![0u64; world_len];
    let mut whole = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let n = t.info.shape.first().copied().unwrap_or(0);
        let row = row_bytes(t);
        if !t.sharded || t.info.shape.is_empty() || n == 0 {
            whole.push(i);
            continue;
        }
        for (r, slot) in per_rank.iter_mut().enumerate() {
            let rows = fsdp_state::chunk_rows(n, world, r as u64).unwrap_or(0..0);
            if !rows.is_empty() {
                load[r] += (rows.end - rows.start) * row;
                slot.push(Placement::Rows { t: i, start: rows.start, rows: rows.end - rows.start });
            }
        }
    }
    let least = |load: &[u64]| load.iter().enumerate().min_by_key(|&(r, l)| (*l, r)).map_or(0, |(r, _)| r);
    for i in whole {
        let r = least(&load);
        let t = &tensors[i];
        load[r] += t.info.byte_len();
        let rows = if t.info.shape.is_empty() { 1 } else { t.info.shape.first().copied().unwrap_or(0) };
        per_rank[r].push(Placement::Rows { t: i, start: 0, rows });
    }
    for (b, v) in values.iter().enumerate() {
        let r = least(&load);
        load[r] += v.data.len();
        per_rank[r].push(Placement::Bytes { b });
    }
    per_rank
}

/// Each rank's file laid out as a target of copies and gathers from the source, and the items
/// `.metadata` lists; with the tensor bytes written.
fn lay_out(
    tensors: &[SrcTensor],
    values: &[SrcBytes],
    per_rank: &[Vec<Placement>],
    out: &Path,
) -> Result<(Plan, Vec<OutItem>, u64)> {
    // Each tensor's bytes as ranges when they are few, computed once for all ranks.
    let ranges: Vec<Option<Vec<Chunk>>> = tensors
        .iter()
        .map(|t| (t.info.run_count() <= MAX_COPY_RUNS && t.info.copies_well()).then(|| t.info.byte_ranges()))
        .collect();
    let mut chunks_of: Vec<Vec<OutChunk>> = vec![Vec::new(); tensors.len()];
    let mut value_at: Vec<Option<(String, u64, u64)>> = vec![None; values.len()];
    let mut plan = Plan::default();
    let mut bytes = 0u64;
    for (r, items) in per_rank.iter().enumerate() {
        if items.is_empty() {
            continue;
        }
        let mut file = RankFile::new(out, r as u64);
        let mut copies = Vec::new();
        let mut gathers = Vec::new();
        for p in items {
            match *p {
                Placement::Rows { t, start, rows } => {
                    let src = &tensors[t];
                    let row = row_bytes(src);
                    let item = file.push_rows(src.info.dtype, &src.info.shape, start, rows, row)?;
                    let (from, len) = (start * row, item.data_len);
                    match &ranges[t] {
                        Some(chunks) => slice_copies(chunks, from, len, item.data_at, &mut copies),
                        None if len > 0 => gathers.push(Gather {
                            tensor: src.info.clone(),
                            to: src.info.dtype,
                            dst_off: item.data_at,
                            compute: None,
                            range: Some(from..from + len),
                        }),
                        None => {}
                    }
                    bytes += len;
                    chunks_of[t].push(item.chunk);
                }
                Placement::Bytes { b } => {
                    let (at, len) = match &values[b].data {
                        ValueData::Copied(c) => {
                            let at = file.push_bytes(c.len);
                            if c.len > 0 {
                                copies.push(RangeCopy { src: c.file, src_off: c.offset, dst_off: at, len: c.len });
                            }
                            (at, c.len)
                        }
                        // Written whole by the file's seal, with the tensor items' archives.
                        ValueData::Pickled(layout) => file.push_layout(layout.clone()),
                    };
                    value_at[b] = Some((file.name.clone(), at, len));
                }
            }
        }
        let mut target = TargetFile::new(file.path, Vec::new(), file.len);
        target.copies = copies;
        target.gathers = gathers;
        target.seal = Some(Box::new(TorchSeal(file.layouts)));
        plan.targets.push(target);
    }

    let mut items = Vec::with_capacity(tensors.len() + values.len());
    for (t, chunks) in tensors.iter().zip(chunks_of) {
        let kind = OutKind::Tensor { dtype: t.info.dtype, size: t.info.shape.clone(), chunks };
        items.push(OutItem { key: t.key.clone(), path: t.path.clone(), kind });
    }
    for (v, at) in values.iter().zip(value_at) {
        let (file, offset, length) = at.unwrap_or_default();
        items.push(OutItem { key: v.key.clone(), path: v.path.clone(), kind: OutKind::Bytes { file, offset, length } });
    }
    Ok((plan, items, bytes))
}

/// One rank's `__{rank}_0.distcp` being laid out: items one after another, each where the
/// previous ends, with the descriptor `.metadata` gives each chunk. Both writers of DCP
/// folders build their rank files with it: a reshard or convert ([`write_dcp`]) and a
/// training job's ranks ([`crate::save_sharded`]).
pub(crate) struct RankFile {
    /// The file's name in its folder.
    pub name: String,
    /// Where it is written.
    pub path: PathBuf,
    /// Its length so far: where the next item goes.
    pub len: u64,
    /// Each tensor item's archive layout, at its offset (for [`TorchSeal`]).
    pub layouts: Vec<(u64, TorchLayout)>,
}

/// A tensor item laid out: its chunk as `.metadata` describes it, and where its storage bytes
/// go in the file.
pub(crate) struct RowsItem {
    pub chunk: OutChunk,
    pub data_at: u64,
    pub data_len: u64,
}

impl RankFile {
    /// The (empty) file of `rank` in `dir`.
    pub(crate) fn new(dir: &Path, rank: u64) -> RankFile {
        let name = format!("__{rank}_0.distcp");
        RankFile { path: dir.join(&name), name, len: 0, layouts: Vec::new() }
    }

    /// Lays out rows `start..start + rows` of a tensor of `dtype` and global `shape` (`row`
    /// bytes each; a 0-d tensor is one row) as the next item: a `torch.save` archive of the
    /// chunk.
    pub(crate) fn push_rows(
        &mut self,
        dtype: Dtype,
        shape: &[u64],
        start: u64,
        rows: u64,
        row: u64,
    ) -> Result<RowsItem> {
        let mut sizes = shape.to_vec();
        let mut offsets = vec![0u64; sizes.len()];
        if let (Some(s0), Some(o0)) = (sizes.first_mut(), offsets.first_mut()) {
            *s0 = rows;
            *o0 = start;
        }
        let data_len = rows * row;
        let wt = WTensor { dtype, shape: sizes.clone(), storage: 0, offset: 0 };
        let layout = writer::layout_tensor("archive", &wt, WStorage { dtype, byte_len: data_len }, &self.path)?;
        let data_at = self.len + layout.storage_offsets.first().copied().unwrap_or(0);
        let chunk = OutChunk { offsets, sizes, file: self.name.clone(), offset: self.len, length: layout.file_len };
        self.push_layout(layout);
        Ok(RowsItem { chunk, data_at, data_len })
    }

    /// Adds a laid-out archive (a pickled value) as the next item; returns its offset and length.
    pub(crate) fn push_layout(&mut self, layout: TorchLayout) -> (u64, u64) {
        let (at, len) = (self.len, layout.file_len);
        self.layouts.push((at, layout));
        self.len += len;
        (at, len)
    }

    /// Reserves `len` bytes for an item copied as it is (a complete archive already); returns
    /// its offset.
    pub(crate) fn push_bytes(&mut self, len: u64) -> u64 {
        let at = self.len;
        self.len += len;
        at
    }
}

/// Bytes in one dim-0 row (the whole value for a 0-d tensor).
fn row_bytes(t: &SrcTensor) -> u64 {
    // The source catalog checked that the whole tensor's size fits, so a row's does.
    numel(t.info.shape.get(1..).unwrap_or_default()).map_or(0, |n| n.saturating_mul(t.info.dtype.bits() / 8))
}

/// Copies of bytes `[from, from + len)` of a tensor made of `chunks` to `dst_off` onwards.
fn slice_copies(chunks: &[Chunk], from: u64, len: u64, dst_off: u64, out: &mut Vec<RangeCopy>) {
    let end = from + len;
    let mut at = 0u64;
    for c in chunks {
        let (lo, hi) = (at.max(from), (at + c.len).min(end));
        if lo < hi {
            out.push(RangeCopy {
                src: c.file,
                src_off: c.offset + (lo - at),
                dst_off: dst_off + (lo - from),
                len: hi - lo,
            });
        }
        at += c.len;
        if at >= end {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cross_source_chunks() {
        let chunks = [Chunk { file: 0, offset: 100, len: 8 }, Chunk { file: 1, offset: 50, len: 8 }];
        let mut out = Vec::new();
        slice_copies(&chunks, 4, 8, 1000, &mut out);
        assert_eq!(
            out,
            vec![
                RangeCopy { src: 0, src_off: 104, dst_off: 1000, len: 4 },
                RangeCopy { src: 1, src_off: 50, dst_off: 1004, len: 4 },
            ]
        );
    }
}
