//! `zero_to_fp32`, as a plan of range copies.
//!
//! The state dict is built in zero_to_fp32's order: persistent buffers (floating ones as fp32),
//! frozen params (stage ≥ 2, as fp32), trainable params from the fp32 master partitions in
//! `param_shapes` order, then the aliases of `shared_params`. It is written the way
//! `zero_to_fp32 --safe_serialization` writes it: `safetensors` files with `{"format": "pt"}`
//! metadata, sharded by huggingface_hub's `split_torch_state_dict_into_shards` into
//! `model-0000i-of-0000n.safetensors` plus an index dumped with sorted keys and a newline.
//!
//! Tied weights: DeepSpeed 0.19.8's `--safe_serialization` crashes on them (safetensors refuses
//! two names for one tensor); its `.bin` output maps the alias to the same tensor. We write the
//! alias as its own copy of the bytes, which is what loading that `.bin` and saving it with
//! `safetensors` gives, and keep the alias beside its target when sharding, as huggingface_hub
//! does with shared storages.
//!
//! Almost every byte is a range copy from a rank file. The exceptions, tensors saved in another
//! dtype than fp32 (bf16 frozen params, half buffers), are read and cast one at a time once the
//! copies are done, so memory stays bounded by the largest such tensor.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::read::ZeroCheckpoint;
use crate::catalog::{Chunk, SourceFile};
use crate::dtype::Dtype;
use crate::error::{Error, IoContext, Result};
use crate::formats::hf_index::{self, shard_name};
use crate::formats::safetensors::{self as st, OutTensor};
use crate::write::{self, Plan, RangeCopy, TargetFile, WriteOptions};

/// What to write.
#[derive(Clone, Debug, Default)]
pub struct ZeroMergeOptions {
    /// Shard the weights into the output folder with files of at most this many bytes.
    pub max_shard_size: Option<u64>,
    /// Also write the merged Adam moments (`<param>.exp_avg`, `<param>.exp_avg_sq`) to
    /// `optimizer.safetensors` beside the weights.
    pub optimizer: bool,
}

/// What a merge wrote.
#[derive(Clone, Debug)]
pub struct ZeroMergeOutcome {
    /// Weight files, in shard order, then the index if sharded, then the optimizer file.
    pub files: Vec<PathBuf>,
    pub tensors: usize,
    pub bytes: u64,
}

/// The optimizer output's file name, beside the weights.
pub const OPTIMIZER_NAME: &str = "optimizer.safetensors";

/// One tensor of the output and where its bytes come from.
#[derive(Clone, Debug)]
struct Out {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    /// Saved dtype of the source (differs from `dtype` when a cast is needed).
    from: Dtype,
    chunks: Vec<Chunk>,
    /// Storage identity for sharding: an alias has its target's.
    key: usize,
}

impl Out {
    fn len(&self) -> u64 {
        self.shape.iter().product::<u64>() * (self.dtype.bits() / 8)
    }
}

fn floating(d: Dtype) -> bool {
    matches!(d, Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16)
}

/// The weights state dict, in zero_to_fp32's order.
fn weights(ck: &ZeroCheckpoint) -> Vec<Out> {
    let mut out: Vec<Out> = Vec::new();
    let as_fp32 = |d: Dtype| if floating(d) { Dtype::F32 } else { d };
    for t in ck.buffers.iter().chain(&ck.frozen) {
        let key = out.len();
        out.push(Out {
            name: t.name.clone(),
            dtype: as_fp32(t.dtype),
            shape: t.shape.clone(),
            from: t.dtype,
            chunks: t.chunks.clone(),
            key,
        });
    }
    for p in &ck.params {
        let key = out.len();
        out.push(Out {
            name: p.name.clone(),
            dtype: Dtype::F32,
            shape: p.shape.clone(),
            from: Dtype::F32,
            chunks: p.fp32.clone(),
            key,
        });
    }
    for (alias, target) in &ck.aliases {
        let Some(t) = out.iter().find(|o| &o.name == target).cloned() else { continue };
        let entry = Out { name: alias.clone(), ..t };
        // A Python dict keeps an overwritten key where it was.
        match out.iter_mut().find(|o| &o.name == alias) {
            Some(slot) => *slot = entry,
            None => out.push(entry),
        }
    }
    out
}

/// The merged Adam moments: for each trainable param, `.exp_avg` then `.exp_avg_sq`.
fn moments(ck: &ZeroCheckpoint) -> Vec<Out> {
    let mut out = Vec::with_capacity(ck.params.len() * 2);
    for p in &ck.params {
        for (suffix, chunks) in [("exp_avg", &p.exp_avg), ("exp_avg_sq", &p.exp_avg_sq)] {
            let key = out.len();
            out.push(Out {
                name: format!("{}.{suffix}", p.name),
                dtype: Dtype::F32,
                shape: p.shape.clone(),
                from: Dtype::F32,
                chunks: chunks.clone(),
                key,
            });
        }
    }
    out
}

/// A tensor to cast after the copies: target index, offset in the target, source.
type Cast = (usize, u64, Out);

fn target(path: &Path, tensors: &[&Out], plan: &mut Plan, casts: &mut Vec<Cast>) -> Result<()> {
    let meta = [("format".to_string(), "pt".to_string())];
    let outs: Vec<OutTensor> = tensors
        .iter()
        .map(|t| OutTensor { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone(), len: t.len() })
        .collect();
    let layout = st::layout(outs, &meta, path)?;
    let by_name: HashMap<&str, &Out> = tensors.iter().map(|t| (t.name.as_str(), *t)).collect();
    let ti = plan.targets.len();
    let mut copies = Vec::new();
    for (t, at) in &layout.tensors {
        let Some(src) = by_name.get(t.name.as_str()) else { continue };
        if src.from != src.dtype {
            casts.push((ti, *at, (*src).clone()));
            continue;
        }
        let mut dst = *at;
        for c in &src.chunks {
            if c.len > 0 {
                copies.push(RangeCopy { src: c.file, src_off: c.offset, dst_off: dst, len: c.len });
            }
            dst += c.len;
        }
    }
    plan.targets.push(TargetFile { path: path.to_path_buf(), head: layout.head, len: layout.file_len, copies });
    Ok(())
}

/// Merges the checkpoint into `out`: one `.safetensors` file, or with `max_shard_size` a folder
/// of huggingface_hub shards (a single `model.safetensors` when everything fits in one).
pub fn merge_zero(
    ck: &ZeroCheckpoint,
    out: &Path,
    options: &ZeroMergeOptions,
    opts: &WriteOptions<'_>,
) -> Result<ZeroMergeOutcome> {
    let tensors = weights(ck);
    let mut plan = Plan::default();
    let mut casts: Vec<Cast> = Vec::new();
    let mut files = Vec::new();
    let dir = match options.max_shard_size {
        None => {
            let refs: Vec<&Out> = tensors.iter().collect();
            target(out, &refs, &mut plan, &mut casts)?;
            files.push(out.to_path_buf());
            out.parent().map(Path::to_path_buf).unwrap_or_default()
        }
        Some(max) => {
            let items: Vec<(usize, u64)> = tensors.iter().map(|t| (t.key, t.len())).collect();
            let (shards, total) = crate::ops::assign_shards(&items, max);
            let n = shards.len();
            let mut weight_map = Vec::new();
            for (i, shard) in shards.iter().enumerate() {
                let name = if n == 1 { hf_index::SINGLE_NAME.to_string() } else { shard_name(i + 1, n) };
                let path = out.join(&name);
                let refs: Vec<&Out> = shard.iter().filter_map(|&j| tensors.get(j)).collect();
                target(&path, &refs, &mut plan, &mut casts)?;
                weight_map.extend(refs.iter().map(|t| (t.name.clone(), name.clone())));
                files.push(path);
            }
            if n > 1 {
                // zero_to_fp32 dumps the index with `sort_keys=True` and a trailing newline.
                weight_map.sort();
                let mut meta = serde_json::Map::new();
                meta.insert("total_size".into(), total.into());
                let mut text = hf_index::render(&meta, &weight_map);
                text.push(b'\n');
                let index = out.join(hf_index::INDEX_NAME);
                plan.trailers.push((index.clone(), text));
                files.push(index);
            }
            out.to_path_buf()
        }
    };
    let mut count = tensors.len();
    let mut bytes: u64 = tensors.iter().map(Out::len).sum();
    if options.optimizer {
        let path = dir.join(OPTIMIZER_NAME);
        if files.contains(&path) {
            return Err(Error::BadConvert {
                dst: path,
                reason: format!("the weights and the optimizer states would both be `{OPTIMIZER_NAME}`"),
            });
        }
        let m = moments(ck);
        let refs: Vec<&Out> = m.iter().collect();
        target(&path, &refs, &mut plan, &mut casts)?;
        files.push(path);
        count += m.len();
        bytes += m.iter().map(Out::len).sum::<u64>();
    }
    let sources = &ck.files;
    let finish = |ti: usize, f: &File, tmp: &Path| -> Result<()> {
        casts.par_iter().filter(|(t, _, _)| *t == ti).try_for_each(|(_, at, src)| cast_one(sources, src, f, tmp, *at))
    };
    write::execute_with(&plan, sources, opts, &finish)?;
    Ok(ZeroMergeOutcome { files, tensors: count, bytes })
}

/// Reads one tensor, casts it to its output dtype with torch's rounding, and writes it at `at`.
fn cast_one(sources: &[SourceFile], src: &Out, f: &File, tmp: &Path, at: u64) -> Result<()> {
    let mut raw = Vec::new();
    for c in &src.chunks {
        let s = sources.get(c.file).ok_or_else(|| Error::BadConvert {
            dst: tmp.to_path_buf(),
            reason: format!("tensor `{}` names an unknown source file", src.name),
        })?;
        let file = File::open(&s.path).at(&s.path)?;
        let start = raw.len();
        raw.resize(start + usize::try_from(c.len).unwrap_or(0), 0);
        file.read_exact_at(&mut raw[start..], c.offset).at(&s.path)?;
    }
    let mut out = Vec::with_capacity(usize::try_from(src.len()).unwrap_or(0));
    crate::cast::cast_into(&raw, src.from, src.dtype, &mut out);
    f.write_all_at(&out, at).at(tmp)
}
