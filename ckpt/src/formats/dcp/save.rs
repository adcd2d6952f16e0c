//! Writing a DCP folder from the ranks of a running job, each from its own memory
//! ([`crate::save_sharded`]).
//!
//! # On disk
//!
//! The folder FSDP2's `dcp.save` writes: rank r's `__{r}_0.distcp` holds an item for each
//! tensor slice and each value that rank passed, one complete `torch.save` archive each, laid out
//! by [`RankFile`] exactly as a reshard lays out its rank files; a rank that holds nothing writes
//! an empty file, as torch writes one per rank. `.metadata` lists every item, in the 2.13 form,
//! and is written last: it is the commit marker torch reads.
//!
//! # Here
//!
//! Each rank lays out its own file ([`lay_out_rank`]) and tells every other rank the file's
//! length and its items' descriptors (key, dtype, global shape, chunk box, byte range, and
//! where the storage bytes go). From every rank's descriptors, each rank then builds the same
//! plan ([`plan_folder`]): one target per rank file, pinned to its rank
//! ([`crate::write::TargetFile::owner`]), whose range copies read that rank's buffers, sealed
//! with torch's CRCs computed from the buffers (nothing is read back); `.metadata` is the
//! plan's trailer. The chunks of each tensor are checked to agree on dtype and shape and to tile
//! its rows exactly before anything is written, the same way on every rank, so every rank finds
//! the same fault and blames the same rank.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::encode::{self, OutChunk, OutItem, OutKind};
use super::metadata::PathElem;
use super::plan::RankFile;
use super::METADATA_NAME;
use crate::error::{Error, IoContext, Result, SaveTensorProblem};
use crate::formats::torch::writer::{self, TorchLayout};
use crate::ops::local::{KeyPart, LocalTensor, LocalValue};
use crate::ops::outcome::Outcome;
use crate::read::dtype::Dtype;
use crate::read::io::Sources;
use crate::read::shape::numel;
use crate::write::{Plan, RangeCopy, Seal, TargetFile};

/// One item of a rank's file, as the ranks tell each other.
#[derive(Serialize, Deserialize, Debug)]
struct Desc {
    key: String,
    path: Vec<(Option<String>, i64)>,
    /// `None` for a value.
    dtype: Option<String>,
    shape: Vec<u64>,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    /// The item's archive in the file.
    offset: u64,
    length: u64,
    /// Where a tensor's storage bytes go in the file, and how many (none for a value).
    data_at: u64,
    data_len: u64,
}

/// What a rank tells the others: its file's length and its items.
#[derive(Serialize, Deserialize, Debug, Default)]
struct Said {
    len: u64,
    items: Vec<Desc>,
}

/// This rank's file laid out, and the bytes its tensor items store (in the order of their
/// descriptors, which is the order of their archives in the file).
pub(crate) struct RankLayout<'a> {
    rank: u64,
    file: RankFile,
    said: Said,
    storages: Vec<&'a [u8]>,
}

/// The key of an entry from its path parts, as DCP flattens it.
fn key_of(path: &[KeyPart]) -> String {
    path_elems(path).iter().map(PathElem::text).collect::<Vec<_>>().join(".")
}

fn path_elems(path: &[KeyPart]) -> Vec<PathElem> {
    path.iter()
        .map(|p| match p {
            KeyPart::Key(k) => PathElem::Key(k.clone()),
            KeyPart::Index(i) => PathElem::Index(*i),
        })
        .collect()
}

/// A key's path parts as the descriptors carry them.
fn path_of(p: &[KeyPart]) -> Vec<(Option<String>, i64)> {
    p.iter()
        .map(|k| match k {
            KeyPart::Key(s) => (Some(s.clone()), 0),
            KeyPart::Index(i) => (None, *i),
        })
        .collect()
}

/// Lays out rank `rank`'s file of the folder `dir`: its tensor slices (each checked against its
/// global shape), then its values.
pub(crate) fn lay_out_rank<'a>(
    dir: &Path,
    rank: u64,
    tensors: &[LocalTensor<'a>],
    values: &[(Vec<KeyPart>, LocalValue)],
) -> Result<RankLayout<'a>> {
    let mut file = RankFile::new(dir, rank);
    let mut said = Said::default();
    let mut storages = Vec::new();
    for t in tensors {
        let Some(desc) = lay_out_tensor(&mut file, t)? else { continue };
        said.items.push(desc);
        storages.push(t.bytes);
    }
    for (p, v) in values {
        let layout = writer::layout_value("archive", &v.leaf(), &file.path)?;
        let (offset, length) = file.push_layout(layout);
        said.items.push(Desc {
            key: key_of(p),
            path: path_of(p),
            dtype: None,
            shape: vec![],
            offsets: vec![],
            sizes: vec![],
            offset,
            length,
            data_at: 0,
            data_len: 0,
        });
    }
    said.len = file.len;
    Ok(RankLayout { rank, file, said, storages })
}

impl RankLayout<'_> {
    /// What the other ranks are told of this file.
    pub(crate) fn said(&self) -> Vec<u8> {
        serde_json::to_vec(&self.said).unwrap_or_default()
    }
}

/// Checks this rank's slice of a tensor and lays it out as the next item of `file`: its
/// descriptor, or `None` for a slice of no rows.
fn lay_out_tensor(file: &mut RankFile, t: &LocalTensor<'_>) -> Result<Option<Desc>> {
    let key = key_of(&t.path);
    let bad = |problem| Error::BadSaveTensor { dst: file.path.clone(), tensor: key.clone(), problem };
    if !t.dtype.bits().is_multiple_of(8) || !t.dtype.in_safetensors() {
        return Err(bad(SaveTensorProblem::Dtype { dtype: t.dtype }));
    }
    let row = numel(t.global_shape.get(1..).unwrap_or_default())
        .and_then(|n| n.checked_mul(t.dtype.bits() / 8))
        .ok_or_else(|| bad(SaveTensorProblem::RowTooLarge))?;
    let len = t.bytes.len() as u64;
    let at = t.dim0_offset;
    let rows = if t.global_shape.is_empty() {
        if len != row || at != 0 {
            return Err(bad(SaveTensorProblem::ScalarBytes { row, len, at }));
        }
        1
    } else {
        if row == 0 || !len.is_multiple_of(row) {
            return Err(bad(SaveTensorProblem::PartialRows { len, row }));
        }
        let rows = len / row;
        let n0 = t.global_shape[0];
        if at.checked_add(rows).is_none_or(|end| end > n0) {
            return Err(bad(SaveTensorProblem::RowsBeyond { at, rows, n0 }));
        }
        rows
    };
    if rows == 0 {
        return Ok(None);
    }
    let item = file.push_rows(t.dtype, &t.global_shape, t.dim0_offset, rows, row)?;
    let c = item.chunk;
    Ok(Some(Desc {
        key,
        path: path_of(&t.path),
        dtype: Some(t.dtype.safetensors_name().to_string()),
        shape: t.global_shape.clone(),
        offsets: c.offsets,
        sizes: c.sizes,
        offset: c.offset,
        length: c.length,
        data_at: item.data_at,
        data_len: item.data_len,
    }))
}

/// The folder's plan, the same on every rank but for what only this rank holds: its buffers
/// among the sources, and its file's seal.
pub(crate) struct FolderPlan<'a> {
    pub plan: Plan,
    pub sources: Sources<'a>,
    pub outcome: Outcome,
}

/// A key's path, its tensor dtype and shape (`None` for a value), and each rank's pieces.
type Entry<'d> = (Vec<PathElem>, Option<(Dtype, Vec<u64>)>, Vec<(u64, &'d Desc)>);

/// Plans the folder `dir` from every rank's descriptors (`gathered`, by rank), `mine` being this
/// rank's layout (see the module docs). A fault in the descriptors is
/// [`Error::ShardedSave`] blaming the rank whose descriptors were at fault.
pub(crate) fn plan_folder<'a>(dir: &Path, mine: RankLayout<'a>, gathered: &[Vec<u8>]) -> Result<FolderPlan<'a>> {
    let blame = |rank: u64, e: Error| Error::ShardedSave { dir: dir.to_path_buf(), rank, source: Box::new(e) };
    let mut said = Vec::with_capacity(gathered.len());
    for (r, bytes) in gathered.iter().enumerate() {
        let s: Said = serde_json::from_slice(bytes).map_err(|e| {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidData, format!("malformed descriptors: {e}"));
            blame(r as u64, Error::Io { path: dir.to_path_buf(), source: e })
        })?;
        said.push(s);
    }
    let items = metadata_items(dir, &said)?;
    let meta = encode::encode(&items, &absolute(dir)?, &encode::uuid4());

    let mut plan = Plan::default();
    let mut sources: Vec<(PathBuf, &'a [u8])> = Vec::new();
    let mut outcome = Outcome { world_size: Some(said.len() as u64), ..Outcome::default() };
    let mut keys = std::collections::BTreeSet::new();
    let mut mine = Some(mine);
    for (r, s) in said.iter().enumerate() {
        let r = r as u64;
        let own = mine.take_if(|m| m.rank == r);
        let file = RankFile::new(dir, r);
        let mut target = TargetFile::new(file.path.clone(), Vec::new(), s.len);
        target.owner = Some(r);
        let mut held = own.as_ref().map(|m| m.storages.iter());
        for d in &s.items {
            if d.dtype.is_none() {
                outcome.values.push(d.key.clone());
                continue;
            }
            keys.insert(d.key.as_str());
            outcome.bytes += d.data_len;
            // Another rank's bytes are not here: only their place in the plan is.
            let bytes = held.as_mut().and_then(Iterator::next).copied().unwrap_or_default();
            let src = sources.len();
            sources.push((PathBuf::from(format!("<tensor `{}` of rank {r} in memory>", d.key)), bytes));
            target.copies.push(RangeCopy { src, src_off: 0, dst_off: d.data_at, len: d.data_len });
        }
        if let Some(own) = own {
            target.seal = Some(Box::new(MemorySeal::of(own)));
        }
        outcome.files.push(target.path.clone());
        plan.targets.push(target);
    }
    let meta_path = dir.join(METADATA_NAME);
    plan.trailers.push((meta_path.clone(), meta));
    outcome.files.push(meta_path);
    outcome.tensors = keys.len();
    Ok(FolderPlan { plan, sources: Sources::memory(sources), outcome })
}

/// The items `.metadata` lists, from every rank's descriptors: each tensor's chunks checked to
/// agree on dtype and shape and to tile its rows, each value saved once. A fault is
/// [`Error::ShardedSave`] blaming the rank whose descriptor shows it.
fn metadata_items(dir: &Path, said: &[Said]) -> Result<Vec<OutItem>> {
    let bad = |rank: u64, key: &str, problem| {
        let e = Error::BadSaveTensor { dst: dir.to_path_buf(), tensor: key.to_string(), problem };
        Error::ShardedSave { dir: dir.to_path_buf(), rank, source: Box::new(e) }
    };
    let mut per_key: BTreeMap<&str, Entry<'_>> = BTreeMap::new();
    let mut order = Vec::new();
    for (r, s) in said.iter().enumerate() {
        let r = r as u64;
        for d in &s.items {
            let dtype = match &d.dtype {
                Some(n) => Some(
                    Dtype::from_safetensors_name(n)
                        .ok_or_else(|| bad(r, &d.key, SaveTensorProblem::UnknownDtype { name: n.clone() }))?,
                ),
                None => None,
            };
            let path = d.path.iter().map(|(k, i)| k.clone().map_or(PathElem::Index(*i), PathElem::Key)).collect();
            let entry = per_key.entry(d.key.as_str()).or_insert_with(|| {
                order.push(d.key.as_str());
                (path, dtype.map(|t| (t, d.shape.clone())), Vec::new())
            });
            if entry.1 != dtype.map(|t| (t, d.shape.clone())) {
                return Err(bad(r, &d.key, SaveTensorProblem::DiffersAcrossRanks));
            }
            if dtype.is_none() && !entry.2.is_empty() {
                return Err(bad(r, &d.key, SaveTensorProblem::ValueOnTwoRanks));
            }
            entry.2.push((r, d));
        }
    }
    let mut items = Vec::with_capacity(order.len());
    for key in order {
        let Some((path, kind, mut chunks)) = per_key.remove(key) else { continue };
        let chunk = |r: u64, d: &Desc| OutChunk {
            offsets: d.offsets.clone(),
            sizes: d.sizes.clone(),
            file: RankFile::new(dir, r).name,
            offset: d.offset,
            length: d.length,
        };
        let kind = match kind {
            Some((dtype, size)) => {
                chunks.sort_by_key(|(_, d)| d.offsets.first().copied().unwrap_or(0));
                let mut next = 0u64;
                let total = size.first().copied().unwrap_or(1);
                for (r, d) in &chunks {
                    let at = d.offsets.first().copied().unwrap_or(0);
                    if at < next {
                        return Err(bad(*r, key, SaveTensorProblem::RowsOnTwoRanks { from: at, to: next }));
                    }
                    if at > next {
                        return Err(bad(*r, key, SaveTensorProblem::RowsOnNoRank { from: next, to: at }));
                    }
                    next = at + d.sizes.first().copied().unwrap_or(1);
                }
                if next != total {
                    let r = chunks.last().map_or(0, |(r, _)| *r);
                    return Err(bad(r, key, SaveTensorProblem::RowsOnNoRank { from: next, to: total }));
                }
                OutKind::Tensor { dtype, size, chunks: chunks.iter().map(|(r, d)| chunk(*r, d)).collect() }
            }
            None => {
                let Some((r, d)) = chunks.pop() else { continue };
                let c = chunk(r, d);
                OutKind::Bytes { file: c.file, offset: c.offset, length: c.length }
            }
        };
        items.push(OutItem { key: key.to_string(), path, kind });
    }
    Ok(items)
}

/// `dir` as `.metadata` records it: absolute, through its nearest existing folder's real path
/// (the folder itself does not exist yet). Megatron's run folders record theirs the same way.
pub(crate) fn absolute(dir: &Path) -> Result<PathBuf> {
    let abs = std::path::absolute(dir).at(dir)?;
    let mut rest = Vec::new();
    let mut at = abs.as_path();
    loop {
        if let Ok(real) = std::fs::canonicalize(at) {
            return Ok(rest.iter().rev().fold(real, |p, n| p.join(n)));
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                at = parent;
            }
            _ => return Ok(abs),
        }
    }
}

/// A rank file's archives, each at its base offset, with the CRC32 of each tensor item's
/// storage computed from the caller's buffer (in parallel, before anything is written).
#[derive(Debug)]
struct MemorySeal {
    archives: Vec<(u64, TorchLayout, Option<u32>)>,
}

impl MemorySeal {
    fn of(rank: RankLayout<'_>) -> MemorySeal {
        let crcs: Vec<u32> = rank.storages.par_iter().map(|b| crc32fast::hash(b)).collect();
        // Tensor items come first in the file, in the order of their buffers; values follow.
        let mut crcs = crcs.into_iter();
        let archives = rank.file.layouts.into_iter().map(|(base, layout)| {
            let crc = match layout.storage_offsets.is_empty() {
                true => None,
                false => crcs.next(),
            };
            (base, layout, crc)
        });
        MemorySeal { archives: archives.collect() }
    }
}

impl Seal for MemorySeal {
    fn seal(&self, file: &File, path: &Path) -> Result<()> {
        for (base, layout, crc) in &self.archives {
            layout.write_fixed_at(file, path, *base)?;
            layout.finish_known(file, path, *base, crc.as_slice())?;
        }
        Ok(())
    }
}
