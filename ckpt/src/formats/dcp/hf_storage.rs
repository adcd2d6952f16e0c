//! DCP's Hugging Face storage: what `HuggingFaceStorageWriter(save_distributed=True)` writes
//! (torchtitan saves HF-format checkpoints this way), and what torch's
//! `consolidate_safetensors_files` makes of it.
//!
//! # On disk
//!
//! A folder of `shard-{R}-model-{K}-of-{N}.safetensors` files, numbers zero-padded to five
//! digits: `R` is the saving rank plus one, `K` of `N` the output file the writer's
//! `fqn_to_index_mapping` assigned the tensors to (1 of 1 without one). There is no index and no
//! `.metadata`. Each file is an ordinary safetensors file holding that rank's box of every tensor
//! it saved, as a compact tensor; its `__metadata__` has `format: pt`, `DCP_VERSION: "1.0"` and
//! `DCP_SHARDING_INFO`, a JSON object with one entry per tensor, `{"saved_offsets": [...]}`,
//! the box's offsets in the global tensor. The entries are in the order the rank's state dict
//! listed them (the header itself is sorted by dtype and name). Replicated tensors are saved by
//! one rank only, as DCP's dedup picks it. The global shape is not written anywhere: torch takes
//! it as the largest `offset + size` per dim over the boxes, and so do we.
//!
//! # Consolidated
//!
//! `consolidate_safetensors_files(input_dir, output_dir, fqn_to_index_mapping)` writes
//! `model-{K}-of-{N}.safetensors` files holding the full tensors, in mapping order (the state
//! dict's, when the writer consolidates itself), with a header that is Python's
//! `json.dumps({name: {"shape", "dtype", "data_offsets"}})` (spaces after `:` and `,`, no
//! padding, no `__metadata__`), and a `model.safetensors.index.json` (`json.dump(indent=2)`:
//! `metadata.total_size` and `weight_map`). [`write_consolidated`] writes exactly that, taking
//! the mapping from the shard names and the order from `DCP_SHARDING_INFO`.

use std::collections::{BinaryHeap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fsdp_state::Region;

use crate::error::{BoxProblem, Error, IoContext, Result};
use crate::formats::hf_index;
use crate::formats::safetensors as st;
use crate::ops::misuse::Opt;
use crate::ops::outcome::Outcome;
use crate::ops::request::{names_a_folder, Merge, MergeOptions};
use crate::read::catalog::{Checkpoint, Format, Parts, Scan, SourceFile, TensorBox, TensorData, TensorInfo};
use crate::read::dtype::Dtype;
use crate::read::shape;
use crate::write::{self, Plan, TargetFile, WriteOptions};

/// The `__metadata__` key that holds each tensor's offsets.
const SHARDING_KEY: &str = "DCP_SHARDING_INFO";
/// The index `consolidate_safetensors_files` writes.
const INDEX_NAME: &str = "model.safetensors.index.json";

/// `shard-{R}-model-{K}-of-{N}.safetensors`, parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ShardName {
    shard: u64,
    index: u64,
    of: u64,
}

fn parse_name(name: &str) -> Option<ShardName> {
    let five = |s: &str| (s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok()).flatten();
    let rest = name.strip_prefix("shard-")?.strip_suffix(".safetensors")?;
    let (shard, rest) = rest.split_once("-model-")?;
    let (index, of) = rest.split_once("-of-")?;
    let n = ShardName { shard: five(shard)?, index: five(index)?, of: five(of)? };
    (n.shard >= 1 && n.index >= 1 && n.index <= n.of).then_some(n)
}

/// The shard files of a folder, sorted by shard then file index.
fn shard_files(dir: &Path) -> Result<Vec<(ShardName, PathBuf)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).at(dir)? {
        let entry = entry.at(dir)?;
        if let Some(n) = entry.file_name().to_str().and_then(parse_name) {
            out.push((n, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// A folder of `shard-*-model-*-of-*.safetensors` files with no safetensors index beside them.
pub(crate) fn detect(path: &Path) -> Result<Option<PathBuf>> {
    if !path.is_dir() || path.join(INDEX_NAME).exists() {
        return Ok(None);
    }
    Ok((!shard_files(path)?.is_empty()).then(|| path.to_path_buf()))
}

/// What the consolidated output needs beyond the catalog: each tensor's output file.
#[derive(Clone, Debug)]
pub(crate) struct HfStorage {
    pub file_of: Vec<OutputFile>,
}

/// An output file of the consolidated checkpoint, `(K, N)`: the `K`th of `N`.
type OutputFile = (u64, u64);

/// One tensor as the shard files describe it.
struct Found {
    dtype: Dtype,
    boxes: Vec<TensorBox>,
    file_of: (u64, u64),
}

/// DCP's Hugging Face storage: merged into one file as stored, or into a folder as torch's
/// `consolidate_safetensors_files` writes it; resharded to a DCP folder, which `dcp.load` reads
/// on any mesh.
pub(crate) struct DcpSafetensorsFormat;

impl crate::formats::FormatOps for DcpSafetensorsFormat {
    fn catalog(&self, _: Format, root: PathBuf, _: &crate::OpenOptions) -> Result<Scan> {
        catalog(root)
    }

    fn merge<'a>(&self, ck: &'a Checkpoint, out: &Path, options: &MergeOptions) -> Result<Merge<'a>> {
        let hf = ck.detail::<HfStorage>().filter(|_| names_a_folder(out));
        let Some(hf) = hf.filter(|_| options.model.is_none()) else {
            return crate::formats::merge_as_stored(self, ck, options);
        };
        if options.optimizer || options.max_shard_size.is_some() {
            let option = if options.optimizer { Opt::Optimizer } else { Opt::MaxShardSize };
            return Err(crate::formats::not_for_format(option, ck));
        }
        let out = out.to_path_buf();
        Ok(Merge::Own(Box::new(move |opts| write_consolidated(ck, hf, &out, opts))))
    }

    fn reshard(&self, ck: &Checkpoint, out: &Path, world: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
        super::write(ck, out, world, opts)
    }
}

/// Reads the shard folder `dir` into a catalog: one box per tensor per shard file.
pub(crate) fn catalog(dir: PathBuf) -> Result<Scan> {
    let shards = shard_files(&dir)?;
    let mut files = Vec::with_capacity(shards.len());
    let mut found: HashMap<String, Found> = HashMap::new();
    // Each file's tensors in its state-dict order, merged into one order below.
    let mut orders: Vec<Vec<String>> = Vec::with_capacity(shards.len());
    for (fi, (name, path)) in shards.iter().enumerate() {
        let (file, order) = read_shard(fi, *name, path, &mut found)?;
        orders.push(order);
        files.push(file);
    }
    let (tensors, file_of) = global_tensors(&dir, &files, found, &orders)?;
    let world = shards.iter().map(|(n, _)| n.shard).max();
    let mut parts = Parts::new(Format::DcpSafetensors, dir, files, tensors);
    parts.world_size = world;
    parts.detail = Some(Arc::new(HfStorage { file_of }));
    Ok(Scan::clean(Checkpoint::new(parts)?))
}

/// Reads shard file `fi` (`name`, at `path`): each tensor's box goes into `found`, checked
/// against the other shards' boxes of it. Returns the file and its tensors in state-dict order.
fn read_shard(
    fi: usize,
    name: ShardName,
    path: &Path,
    found: &mut HashMap<String, Found>,
) -> Result<(SourceFile, Vec<String>)> {
    let (mut file, header) = st::read_file(path)?;
    let rank = name.shard - 1;
    let bad = |tensor: &str, problem| Error::BadBox {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        rank: Some(rank),
        problem,
    };
    let info = sharding_info(&file, path)?;
    let offsets_of = |tensor: &str| -> Result<Vec<u64>> {
        let v = info.get(tensor).and_then(|e| e.get("saved_offsets"));
        let Some(serde_json::Value::Array(a)) = v else {
            return Err(bad(tensor, BoxProblem::NoSavedOffsets));
        };
        a.iter()
            .map(|x| x.as_u64().ok_or_else(|| bad(tensor, BoxProblem::NotAnOffset { value: x.to_string() })))
            .collect()
    };
    let start = header.data_start();
    for t in &header.tensors {
        let offsets = offsets_of(&t.name)?;
        if offsets.len() != t.shape.len() {
            return Err(bad(&t.name, BoxProblem::OffsetDims { offsets, shape: t.shape.clone() }));
        }
        let strides = shape::contiguous_strides(&t.shape).unwrap_or_default();
        let b = TensorBox {
            region: Region::new(offsets, t.shape.clone()),
            file: fi,
            base: start + t.begin,
            len: t.end - t.begin,
            offset: 0,
            strides,
        };
        let entry = found.entry(t.name.clone()).or_insert_with(|| Found {
            dtype: t.dtype,
            boxes: Vec::new(),
            file_of: (name.index, name.of),
        });
        if entry.dtype != t.dtype {
            return Err(Error::BoxDtypeMismatch {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                rank: Some(rank),
                found: t.dtype,
                other: entry.dtype,
            });
        }
        if entry.file_of != (name.index, name.of) {
            let (other_index, other_of) = entry.file_of;
            let problem = BoxProblem::OutputFileDiffers { index: name.index, of: name.of, other_index, other_of };
            return Err(bad(&t.name, problem));
        }
        entry.boxes.push(b);
    }
    if let Some(extra) = info.keys().find(|k| !header.tensors.iter().any(|t| &t.name == *k)) {
        return Err(bad(extra, BoxProblem::NotInFile));
    }
    // Only `format` is the checkpoint's metadata; the rest describes this one shard.
    file.metadata.retain(|(k, _)| k == "format");
    file.rank = Some(rank);
    Ok((file, info.keys().cloned().collect()))
}

/// The shard's `DCP_SHARDING_INFO`, a JSON object by tensor name.
fn sharding_info(file: &SourceFile, path: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    let info = file.metadata.iter().find(|(k, _)| k == SHARDING_KEY).map(|(_, v)| v.clone());
    let Some(info) = info else {
        return Err(Error::BadDcpMetadata {
            path: path.to_path_buf(),
            reason: format!("the shard file has no `{SHARDING_KEY}` entry in its `__metadata__`"),
        });
    };
    serde_json::from_str(&info).map_err(|e| Error::BadDcpMetadata {
        path: path.to_path_buf(),
        reason: format!("`{SHARDING_KEY}` is not a JSON object: {e}"),
    })
}

/// The tensors in the merged state-dict order, each with its global shape (the boxes' extent,
/// as torch's reader and consolidation take it), and each one's output file.
fn global_tensors(
    dir: &Path,
    files: &[SourceFile],
    mut found: HashMap<String, Found>,
    orders: &[Vec<String>],
) -> Result<(Vec<TensorInfo>, Vec<OutputFile>)> {
    let mut tensors = Vec::with_capacity(found.len());
    let mut file_of = Vec::with_capacity(found.len());
    for name in merged_order(orders) {
        let Some(f) = found.remove(&name) else { continue };
        let dims = f.boxes.first().map_or(0, |b| b.region.sizes.len());
        if let Some(b) = f.boxes.iter().find(|b| b.region.sizes.len() != dims) {
            return Err(Error::BadBox {
                path: files.get(b.file).map_or_else(|| dir.to_path_buf(), |f| f.path.clone()),
                tensor: name,
                rank: files.get(b.file).and_then(|f| f.rank),
                problem: BoxProblem::DimsDiffer { dims: b.region.sizes.len(), other: dims },
            });
        }
        let mut size = vec![0u64; dims];
        for b in &f.boxes {
            for (s, (&o, &n)) in size.iter_mut().zip(b.region.offsets.iter().zip(&b.region.sizes)) {
                *s = (*s).max(o.saturating_add(n));
            }
        }
        file_of.push(f.file_of);
        tensors.push(TensorInfo {
            name,
            dtype: f.dtype,
            shape: size,
            stored: f.dtype,
            data: TensorData::Boxes(f.boxes),
        });
    }
    Ok((tensors, file_of))
}

/// One order for every tensor, from each file's order of its own: each file lists a
/// subsequence of the state dict (a replicated tensor is in one file only), so the state dict's
/// order is a topological order of "comes before" in any file. Ties go to the tensor seen first.
fn merged_order(orders: &[Vec<String>]) -> Vec<String> {
    let mut id: HashMap<&str, usize> = HashMap::new();
    let mut names: Vec<&str> = Vec::new();
    for o in orders {
        for n in o {
            id.entry(n.as_str()).or_insert_with(|| {
                names.push(n.as_str());
                names.len() - 1
            });
        }
    }
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); names.len()];
    let mut indegree = vec![0usize; names.len()];
    for o in orders {
        for w in o.windows(2) {
            let (a, b) = (id[w[0].as_str()], id[w[1].as_str()]);
            next[a].push(b);
            indegree[b] += 1;
        }
    }
    let mut ready: BinaryHeap<std::cmp::Reverse<usize>> =
        (0..names.len()).filter(|&i| indegree[i] == 0).map(std::cmp::Reverse).collect();
    let mut out = Vec::with_capacity(names.len());
    let mut done = vec![false; names.len()];
    while let Some(std::cmp::Reverse(i)) = ready.pop() {
        done[i] = true;
        out.push(names[i].to_string());
        for &j in &next[i] {
            indegree[j] -= 1;
            if indegree[j] == 0 {
                ready.push(std::cmp::Reverse(j));
            }
        }
    }
    // Files that disagree (a cycle) cannot come from one state dict; keep first-seen order.
    out.extend((0..names.len()).filter(|&i| !done[i]).map(|i| names[i].to_string()));
    out
}

/// Writes what `consolidate_safetensors_files` writes for this folder into `out`: the full
/// tensors in `model-{K}-of-{N}.safetensors` files and their index.
pub(crate) fn write_consolidated(
    ck: &Checkpoint,
    hf: &HfStorage,
    out: &Path,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    // Output files in the order their first tensor comes, tensors in catalog order.
    let mut groups: Vec<((u64, u64), Vec<usize>)> = Vec::new();
    for (i, k) in hf.file_of.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| g == k) {
            Some((_, members)) => members.push(i),
            None => groups.push((*k, vec![i])),
        }
    }
    let mut plan = Plan::default();
    let mut weight_map = Vec::with_capacity(ck.tensors.len());
    let mut total = 0u64;
    let mut files = Vec::with_capacity(groups.len() + 1);
    for ((k, n), members) in &groups {
        let name = format!("model-{k:05}-of-{n:05}.safetensors");
        let path = out.join(&name);
        let mut header = String::from("{");
        let mut at = 0u64;
        let mut places = Vec::with_capacity(members.len());
        for (j, &i) in members.iter().enumerate() {
            let t = &ck.tensors[i];
            if !t.dtype.in_safetensors() {
                return Err(Error::NotInSafetensors { tensor: t.name.clone(), dtype: t.dtype.to_string() });
            }
            let len = t.byte_len();
            if j > 0 {
                header.push_str(", ");
            }
            let dims: Vec<String> = t.shape.iter().map(u64::to_string).collect();
            header.push_str(&format!(
                "{}: {{\"shape\": [{}], \"dtype\": \"{}\", \"data_offsets\": [{at}, {}]}}",
                py_json_string(&t.name),
                dims.join(", "),
                t.dtype.safetensors_name(),
                at + len
            ));
            places.push((i, at));
            weight_map.push((t.name.clone(), name.clone()));
            at += len;
        }
        header.push('}');
        let json = header.into_bytes();
        let mut head = (json.len() as u64).to_le_bytes().to_vec();
        head.extend_from_slice(&json);
        let data_start = head.len() as u64;
        let mut target = TargetFile::new(path.clone(), head, data_start + at);
        for (i, off) in places {
            let t = &ck.tensors[i];
            target.place(t, t.dtype, data_start + off, None);
        }
        total += at;
        plan.targets.push(target);
        files.push(path);
    }
    let index = out.join(INDEX_NAME);
    // `json.dump(indent=2)` of `metadata.total_size` and `weight_map`, as huggingface_hub's.
    let mut metadata = serde_json::Map::new();
    metadata.insert("total_size".into(), total.into());
    plan.trailers.push((index.clone(), hf_index::render(&metadata, &weight_map)));
    plan.stale =
        write::stale_files(out, |n| hf_index::is_managed_name(n, "model", ".safetensors"), |n| n == INDEX_NAME)?;
    crate::write::execute::execute(&plan, ck, opts)?;
    files.push(index);
    Ok(Outcome { files, tensors: ck.tensors.len(), bytes: total, ..Outcome::default() })
}

/// A string as Python's `json.dumps` writes it: serde_json escapes what JSON requires, as
/// Python does, and `ensure_ascii` the rest.
fn py_json_string(s: &str) -> String {
    hf_index::escape_non_ascii(&serde_json::Value::String(s.to_string()).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names() {
        assert_eq!(
            parse_name("shard-00002-model-00001-of-00003.safetensors"),
            Some(ShardName { shard: 2, index: 1, of: 3 })
        );
        assert_eq!(parse_name("shard-0002-model-00001-of-00003.safetensors"), None);
        assert_eq!(parse_name("model-00001-of-00003.safetensors"), None);
        assert_eq!(parse_name("shard-00000-model-00001-of-00001.safetensors"), None);
    }

    #[test]
    fn orders_merge_into_the_state_dicts() {
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // `b` replicated, saved by the second rank only.
        assert_eq!(merged_order(&[o(&["a", "c"]), o(&["a", "b", "c"])]), o(&["a", "b", "c"]));
        assert_eq!(merged_order(&[o(&["x"]), o(&["y"])]), o(&["x", "y"]));
    }

    #[test]
    fn python_json() {
        assert_eq!(py_json_string("a.b"), "\"a.b\"");
        assert_eq!(py_json_string("é\"\u{1F600}\u{1}"), "\"\\u00e9\\\"\\ud83d\\ude00\\u0001\"");
        assert_eq!(py_json_string("a\nb\u{7f}"), "\"a\\nb\\u007f\"");
    }
}
