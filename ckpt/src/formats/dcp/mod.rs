//! `torch.distributed.checkpoint` (DCP) folders: read without torch, merged, written for any
//! world size.
//!
//! # On disk
//!
//! A DCP folder is a `.metadata` file plus data files, by default one per rank named
//! `__{rank}_0.distcp`. The data files have no header, padding or checksum: they are *items*
//! back to back, and only the metadata says where each item starts and how long it is.
//!
//! `.metadata` is a Python pickle of torch's `Metadata` dataclass (see [`metadata`]). For each
//! entry of the flattened state dict (`model.embed.weight`, `optim.state.<fqn>.exp_avg`,
//! `optim.param_groups.0.lr`) it records either a tensor (dtype, global size, and a list of
//! chunks, each an `offsets`/`sizes` box in the global tensor) or a non-tensor value. A separate
//! dict maps each (key, chunk offsets) to the item's file, byte offset and length, and
//! `planner_data` keeps the original nesting of every key (FQNs contain dots, so keys are never
//! split on `.`).
//!
//! Every item, tensor or not, is a complete `torch.save` zip archive (records under `archive/`),
//! with its zip offsets and its 64-byte payload alignment counted from the item's own start. A
//! tensor item holds the chunk as a compact tensor; a non-tensor item holds the pickled value.
//!
//! FSDP2 saves each parameter (and each Adam `exp_avg`/`exp_avg_sq`) sharded on dim 0 with
//! `torch.chunk` rules, one chunk per rank; ranks with an empty slice write an empty chunk, and
//! DCP's dedup collapses several identical empty chunks into one. Replicated tensors (buffers,
//! Adam's 0-d `step`) and non-tensor values are saved once, by whichever rank the dedup picks.
//!
//! # Here
//!
//! Each chunk becomes a box of its tensor in the catalog ([`crate::read::catalog::TensorBox`]): its
//! `offsets`/`sizes` region, and the strided view of its item's storage record (torch keeps a
//! chunk's strides when its storage is exactly the chunk, so `channels_last` and transposed items
//! are views, not compact tensors). Boxes on any dims are read alike: FSDP2's dim-0 chunks,
//! tensor parallel's dim-1 ones, FSDP2 + TP on a 2-D mesh, HSDP, `_StridedShard`. The catalog
//! checks that they tile the tensor and `merge` copies them into place by runs with the common
//! plan executor, never holding a tensor. DCP's Hugging Face storage, safetensors shards with the
//! boxes' offsets in their metadata, is read into the same boxes ([`hf_storage`]).
//!
//! Names follow `accelerate merge-weights`: when the state dict has a single top-level key
//! (`model` in accelerate's `pytorch_model_fsdp_0/`, `optimizer` in `optimizer_0/`) that level is
//! dropped. Non-tensor values become the catalog's metadata (dotted name → JSON), so a merged
//! optimizer keeps its `param_groups` in the output's `__metadata__`.
//!
//! Writing ([`plan`]) lays out FSDP2's layout for M ranks and writes the `.metadata` pickle last
//! ([`encode`]); the ranks of a running job write their own files from memory the same way
//! ([`save`]).

pub(crate) mod encode;
pub(crate) mod hf_storage;
pub(crate) mod metadata;
pub(crate) mod plan;
mod read;
pub(crate) mod save;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::Result;
use crate::map::model::{ModelMap, Target};
use crate::ops::outcome::Outcome;
use crate::read::catalog::{Checkpoint, Format, Parts, Scan, SourceFile, TensorData, TensorInfo};
use crate::report::describe::Description;
use crate::write::WriteOptions;
pub(crate) use metadata::metadata_classes;
use metadata::PathElem;
use plan::{SrcBytes, SrcTensor, ValueData};
pub(crate) use read::{read_with as read_folder_with, Classes, Dcp as DcpSource, DcpTensor};

/// The metadata file of a DCP folder.
pub(crate) const METADATA_NAME: &str = ".metadata";

/// The DCP folder `path` names: a folder holding `.metadata`, or that file itself.
pub(crate) fn detect(path: &Path) -> Result<Option<PathBuf>> {
    if path.is_dir() && path.join(METADATA_NAME).is_file() {
        return Ok(Some(path.to_path_buf()));
    }
    if path.is_file() && path.file_name().is_some_and(|n| n == METADATA_NAME) {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        return Ok(Some(dir.to_path_buf()));
    }
    Ok(None)
}

/// A `torch.distributed.checkpoint` folder: merged as `accelerate merge-weights` merges it (its
/// catalog as stored), resharded to FSDP2's layout for another world size.
pub(crate) struct DcpFormat;

impl super::FormatOps for DcpFormat {
    fn describe(&self, ck: &Checkpoint) -> Description {
        describe(ck)
    }

    fn catalog(&self, _: Format, root: PathBuf, _: &crate::OpenOptions) -> Result<Scan> {
        catalog(root)
    }

    fn reshard(&self, ck: &Checkpoint, out: &Path, world: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
        write(ck, out, world, opts)
    }
}

/// The catalog view of the DCP folder `dir`: its tensors under their logical names, a model
/// map that renames each stored key.
pub(crate) fn catalog(dir: PathBuf) -> Result<Scan> {
    let dcp = read::read(&dir)?;
    let strip = single_top_level(&dcp);
    let name = |path: &[PathElem]| -> String {
        let rest = if strip { path.get(1..).unwrap_or_default() } else { path };
        rest.iter().map(PathElem::text).collect::<Vec<_>>().join(".")
    };
    // The stored tensors under their keys, seen under their logical names.
    let sources: Vec<TensorInfo> = dcp
        .tensors
        .iter()
        .map(|t| TensorInfo {
            name: t.key.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            stored: t.dtype,
            data: TensorData::Boxes(t.boxes.clone()),
        })
        .collect();
    let mut map = ModelMap::new("logical view");
    for t in &dcp.tensors {
        map.push(Target::renamed(name(&t.path), t.key.clone(), &t.shape));
    }
    let tensors = map.apply(&dir, &sources)?;
    let values = dcp.bytes.iter().map(|b| (name(&b.path), b.value.clone())).collect();
    let files = save_file_sources(&dcp, &dir);
    let mut parts = Parts::new(Format::Dcp, dir, files, tensors);
    parts.values = values;
    parts.world_size = Some(dcp.files.len() as u64);
    parts.members = crate::read::io::regular_files(&parts.root)?;
    parts.detail = Some(Arc::new(dcp));
    Ok(Scan::clean(Checkpoint::new(parts)?))
}

/// How a DCP folder (or DCP's Hugging Face storage) is named: by its rank files.
pub(crate) fn describe(ck: &Checkpoint) -> Description {
    match ck.world_size() {
        Some(w) => Description::titled(format!("a DCP checkpoint of {w} rank file(s)")),
        None => Description::of_files(ck),
    }
}

/// The folder's data files, the first carrying the `__metadata__` that
/// `safetensors.torch.save_file` writes (and so `accelerate merge-weights`); the `.metadata`
/// file carries it when there is no data file.
pub(crate) fn save_file_sources(dcp: &DcpSource, dir: &Path) -> Vec<SourceFile> {
    let mut files = dcp.files.clone();
    let meta = vec![("format".to_string(), "pt".to_string())];
    match files.first_mut() {
        Some(f) => f.metadata = meta,
        None => files.push(SourceFile { metadata: meta, ..SourceFile::new(dir.join(METADATA_NAME), 0) }),
    }
    files
}

/// True when every key sits under one and the same top-level key of a dict (accelerate's
/// `{"model": …}` / `{"optimizer": …}`), which merging drops as accelerate does.
fn single_top_level(dcp: &read::Dcp) -> bool {
    let paths = dcp.tensors.iter().map(|t| &t.path).chain(dcp.bytes.iter().map(|b| &b.path));
    let mut tops = HashSet::new();
    for p in paths {
        match p.as_slice() {
            [PathElem::Key(top), _, ..] => {
                tops.insert(top.as_str());
            }
            _ => return false,
        }
    }
    tops.len() == 1
}

/// Writes `ck` as a DCP folder for `world_size` ranks into `out`, in FSDP2's layout.
///
/// A DCP source is resharded: every tensor it held sharded (on any dims) is cut on dim 0 by
/// `torch.chunk` rules, tensors saved whole stay whole, non-tensor values (optimizer
/// `param_groups`) are carried byte for byte. Any other checkpoint is saved as FSDP2 saves a
/// model state dict: keys are the tensor names, tensors of one or more dimensions are sharded on
/// dim 0, 0-d tensors are saved whole; its non-tensor values are not carried (the outcome counts
/// none).
pub(crate) fn write(ck: &Checkpoint, out: &Path, world_size: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
    if let Some(dcp) = ck.detail::<DcpSource>().filter(|d| d.tensors.len() == ck.tensors.len()) {
        // A tensor saved as several chunks was a DTensor. With one data file, everything is one
        // chunk and nothing tells a parameter from a buffer, so tensors are sharded as a plain
        // checkpoint's are.
        let one_rank = dcp.files.len() <= 1;
        let tensors: Vec<SrcTensor> = dcp
            .tensors
            .iter()
            .zip(&ck.tensors)
            .map(|(t, info)| SrcTensor {
                key: t.key.clone(),
                path: t.path.clone(),
                info: info.clone(),
                sharded: !t.shape.is_empty() && (info.boxes().len() > 1 || one_rank),
            })
            .collect();
        let values: Vec<SrcBytes> = dcp
            .bytes
            .iter()
            .map(|b| SrcBytes { key: b.key.clone(), path: b.path.clone(), data: ValueData::Copied(b.chunk) })
            .collect();
        return plan::write_dcp(ck, &tensors, &values, out, world_size, opts);
    }
    // DCP's safetensors shards tell parameters from replicated tensors as DCP does: by their
    // number of boxes.
    let by_boxes = ck.format == Format::DcpSafetensors && ck.world_size.is_some_and(|w| w > 1);
    let tensors: Vec<SrcTensor> = ck
        .tensors
        .iter()
        .map(|t| SrcTensor {
            key: t.name.clone(),
            path: vec![PathElem::Key(t.name.clone())],
            // Bytes are copied as stored (a ZeRO bf16 frozen param stays bf16).
            info: TensorInfo { dtype: t.stored, ..t.clone() },
            sharded: !t.shape.is_empty() && (!by_boxes || t.boxes().len() > 1),
        })
        .collect();
    plan::write_dcp(ck, &tensors, &[], out, world_size, opts)
}
