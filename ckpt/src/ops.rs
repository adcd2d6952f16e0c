//! Split and merge: each builds the target catalog, turns it into a plan of range copies, and
//! hands the plan to the writer.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::catalog::{Checkpoint, TensorInfo};
use crate::error::Result;
use crate::formats::hf_index::{self, shard_name};
use crate::formats::safetensors::{self as st, OutTensor};
use crate::write::{self, Plan, RangeCopy, TargetFile, WriteOptions};

/// What a split wrote.
#[derive(Clone, Debug)]
pub struct SplitOutcome {
    /// Each file written and the tensors it holds, in shard order.
    pub files: Vec<(PathBuf, Vec<String>)>,
    /// The index, when more than one shard was written.
    pub index: Option<PathBuf>,
    /// `metadata.total_size`: the bytes of all tensors, headers excluded.
    pub total_size: u64,
}

/// What a merge wrote.
#[derive(Clone, Debug)]
pub struct MergeOutcome {
    pub path: PathBuf,
    pub tensors: usize,
    pub bytes: u64,
}

/// Splits `ck` into huggingface_hub-style shards of at most `max_shard_size` bytes in `out_dir`.
///
/// The shards, their names, the `weight_map` and `total_size` are what
/// `huggingface_hub.save_torch_state_dict(load_file(src), out_dir, max_shard_size=…)` writes,
/// and so is every shard's content.
pub fn split(ck: &Checkpoint, out_dir: &Path, max_shard_size: u64, opts: &WriteOptions<'_>) -> Result<SplitOutcome> {
    let (plan, outcome) = plan_split(ck, out_dir, max_shard_size)?;
    write::execute(&plan, &ck.files, opts)?;
    Ok(outcome)
}

/// Merges every tensor of `ck` into the single safetensors file `out`, keeping `__metadata__`.
pub fn merge(ck: &Checkpoint, out: &Path, opts: &WriteOptions<'_>) -> Result<MergeOutcome> {
    let (plan, outcome) = plan_merge(ck, out)?;
    write::execute(&plan, &ck.files, opts)?;
    Ok(outcome)
}

/// Assigns tensors to shards the way huggingface_hub's `split_state_dict_into_shards_factory`
/// does. `items` are `(storage key, size)` in state-dict order; tensors sharing a storage key
/// count once and follow the first of them into its shard, appended at its end.
///
/// The pass is greedy and single: a tensor larger than the limit gets a shard of its own,
/// emitted immediately while the current shard stays open, so key order is not monotonic
/// across shards (huggingface_hub behaves the same).
pub fn assign_shards<K: Eq + std::hash::Hash + Clone>(items: &[(K, u64)], max: u64) -> (Vec<Vec<usize>>, u64) {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut group_of: HashMap<K, usize> = HashMap::new();
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_size = 0u64;
    let mut total = 0u64;
    for (i, (key, size)) in items.iter().enumerate() {
        if let Some(&g) = group_of.get(key) {
            groups[g].push(i);
            continue;
        }
        group_of.insert(key.clone(), groups.len());
        groups.push(vec![i]);
        total += size;
        if *size > max {
            shards.push(vec![i]);
            continue;
        }
        if current_size + size > max {
            shards.push(std::mem::take(&mut current));
            current_size = 0;
        }
        current.push(i);
        current_size += size;
    }
    if !current.is_empty() {
        shards.push(current);
    }
    for group in groups.iter().filter(|g| g.len() > 1) {
        if let Some(shard) = shards.iter_mut().find(|s| s.contains(&group[0])) {
            shard.extend_from_slice(&group[1..]);
        }
    }
    (shards, total)
}

/// Builds the plan for [`split`] without writing anything.
pub fn plan_split(ck: &Checkpoint, out_dir: &Path, max_shard_size: u64) -> Result<(Plan, SplitOutcome)> {
    // Within one file, tensors can only share a storage when they are empty and sit at the same
    // offset: safetensors hands them the same data pointer, and huggingface_hub keys storages
    // by (pointer, byte size).
    let items: Vec<((usize, u64, u64), u64)> = ck
        .tensors
        .iter()
        .map(|t| {
            let first = t.chunks.first().map_or((usize::MAX, 0, 0), |c| (c.file, c.offset, c.len));
            (first, t.byte_len())
        })
        .collect();
    let (shards, total_size) = assign_shards(&items, max_shard_size);

    // What huggingface_hub calls the user `metadata`: the source's `__metadata__` beyond
    // `format`, and its index metadata beyond `total_size`. Like `save_torch_state_dict`, a
    // single output file carries it in `__metadata__`, a sharded output in the index.
    let source_meta = ck.file_metadata()?;
    let format = source_meta.iter().find(|(k, _)| k == "format").map_or_else(|| "pt".to_string(), |(_, v)| v.clone());
    let mut user_meta: Vec<(String, serde_json::Value)> =
        source_meta.into_iter().filter(|(k, _)| k != "format").map(|(k, v)| (k, v.into())).collect();
    for (k, v) in index_extras(ck) {
        if !user_meta.iter().any(|(kk, _)| *kk == k) {
            user_meta.push((k, v));
        }
    }
    let n = shards.len();
    let mut file_meta = vec![("format".to_string(), format)];
    if n == 1 {
        file_meta.extend(user_meta.iter().map(|(k, v)| (k.clone(), json_to_string(v))));
    }

    let mut plan = Plan::default();
    let mut outcome = SplitOutcome { files: Vec::new(), index: None, total_size };
    let mut weight_map = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = if n == 1 { hf_index::SINGLE_NAME.to_string() } else { shard_name(i + 1, n) };
        let path = out_dir.join(&name);
        let tensors: Vec<&TensorInfo> = shard.iter().map(|&j| &ck.tensors[j]).collect();
        plan.targets.push(target_file(&path, &tensors, &file_meta)?);
        outcome.files.push((path, tensors.iter().map(|t| t.name.clone()).collect()));
        weight_map.extend(tensors.iter().map(|t| (t.name.clone(), name.clone())));
    }
    if n > 1 {
        let mut meta = serde_json::Map::new();
        meta.insert("total_size".into(), total_size.into());
        for (k, v) in user_meta {
            meta.insert(k, v);
        }
        let index_path = out_dir.join(hf_index::INDEX_NAME);
        plan.trailers.push((index_path.clone(), hf_index::render(&meta, &weight_map)));
        outcome.index = Some(index_path);
    }
    plan.stale = write::stale_files(
        out_dir,
        |n| hf_index::is_managed_name(n, "model", ".safetensors"),
        |n| n.ends_with(".index.json"),
    )?;
    plan.protected.push(ck.root.clone());
    Ok((plan, outcome))
}

/// Builds the plan for [`merge`] without writing anything.
pub fn plan_merge(ck: &Checkpoint, out: &Path) -> Result<(Plan, MergeOutcome)> {
    let mut meta = ck.file_metadata()?;
    for (k, v) in index_extras(ck) {
        if !meta.iter().any(|(kk, _)| *kk == k) {
            meta.push((k, json_to_string(&v)));
        }
    }
    let tensors: Vec<&TensorInfo> = ck.tensors.iter().collect();
    let target = target_file(out, &tensors, &meta)?;
    let outcome = MergeOutcome { path: out.to_path_buf(), tensors: tensors.len(), bytes: ck.total_bytes() };
    Ok((Plan { targets: vec![target], protected: vec![ck.root.clone()], ..Plan::default() }, outcome))
}

fn target_file(path: &Path, tensors: &[&TensorInfo], metadata: &[(String, String)]) -> Result<TargetFile> {
    let by_name: HashMap<&str, &TensorInfo> = tensors.iter().map(|t| (t.name.as_str(), *t)).collect();
    let out: Vec<OutTensor> = tensors
        .iter()
        .map(|t| OutTensor { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone(), len: t.byte_len() })
        .collect();
    let layout = st::layout(out, metadata, path)?;
    let mut copies = Vec::new();
    for (t, at) in &layout.tensors {
        let mut dst = *at;
        for c in &by_name[t.name.as_str()].chunks {
            if c.len > 0 {
                copies.push(RangeCopy { src: c.file, src_off: c.offset, dst_off: dst, len: c.len });
            }
            dst += c.len;
        }
    }
    Ok(TargetFile { path: path.to_path_buf(), head: layout.head, len: layout.file_len, copies })
}

/// The source index's metadata other than `total_size`, which is always recomputed.
fn index_extras(ck: &Checkpoint) -> Vec<(String, serde_json::Value)> {
    ck.index_metadata()
        .map(|m| m.iter().filter(|(k, _)| *k != "total_size").map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default()
}

fn json_to_string(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::assign_shards;

    fn gb(sizes: &[u64]) -> Vec<(usize, u64)> {
        sizes.iter().enumerate().map(|(i, s)| (i, s * 1_000_000_000)).collect()
    }

    #[test]
    fn greedy_in_key_order() {
        // huggingface_hub's docstring example: [6,6,2,6,2,2] GB with a 10 GB limit.
        let (shards, total) = assign_shards(&gb(&[6, 6, 2, 6, 2, 2]), 10_000_000_000);
        assert_eq!(shards, vec![vec![0], vec![1, 2], vec![3, 4, 5]]);
        assert_eq!(total, 24_000_000_000);
    }

    #[test]
    fn oversized_tensor_is_emitted_before_the_open_shard() {
        let (shards, _) = assign_shards(&gb(&[2, 12, 2]), 10_000_000_000);
        assert_eq!(shards, vec![vec![1], vec![0, 2]]);
    }

    #[test]
    fn shared_storage_follows_its_first_tensor_and_counts_once() {
        let items = vec![("a", 5), ("b", 0), ("c", 6), ("b", 0)];
        let (shards, total) = assign_shards(&items, 10);
        assert_eq!(shards, vec![vec![0, 1, 3], vec![2]]);
        assert_eq!(total, 11);
    }

    #[test]
    fn empty_input_gives_no_shard() {
        let (shards, total) = assign_shards::<u8>(&[], 10);
        assert!(shards.is_empty());
        assert_eq!(total, 0);
    }
}
