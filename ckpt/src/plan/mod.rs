//! What every target planner shares: the tensors to write, where they go, and how they are cut
//! into shards.
//!
//! Every operation that writes a state dict (split, merge, convert, the ZeRO merge) hands a
//! target format's planner (`formats::plan_state_dict`) a list of [`Out`] tensors (a catalog
//! tensor, the dtype to write it as, and the storage it belongs to) and a [`Dest`]: one file,
//! or a folder of huggingface_hub shards. The planner lays the files out and places each
//! tensor as range copies or a gather (`write::TargetFile::place`); the executor does the rest.
//! Which tensors, in which order, with which metadata, is the operation's business; how a
//! format lays them out is its own module's; how they are cut into shards ([`cut`]) is here.

pub(crate) mod shares;
pub(crate) mod size;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::read::catalog::{Checkpoint, TensorInfo};
use crate::read::dtype::Dtype;

/// One tensor to write.
#[derive(Clone, Debug)]
pub(crate) struct Out<'a> {
    pub tensor: &'a TensorInfo,
    /// The dtype to write it as (a cast when it differs from how it is stored).
    pub dtype: Dtype,
    /// Tensors with the same key share one storage in the state dict the reference tools see:
    /// they count once toward a shard's size and follow the first of them into its shard.
    pub key: usize,
    /// For torch output: the index (into the output list) of the tensor whose storage this one
    /// shares instead of having its own.
    pub tied_to: Option<usize>,
    /// What the bytes are computed by instead of a copy or cast (block-scaled FP8).
    pub compute: Option<crate::map::blockscale::SharedCompute>,
}

impl Out<'_> {
    pub(crate) fn byte_len(&self) -> u64 {
        self.tensor.numel().saturating_mul(self.dtype.bits() / 8)
    }
}

/// Storage keys as the data tells them: tensors whose bytes start at the same place and have
/// the same length (a ZeRO alias; empty safetensors tensors at one offset) share one.
pub(crate) fn storage_keys(tensors: &[&TensorInfo]) -> Vec<usize> {
    let mut seen: HashMap<(Option<(usize, u64)>, u64), usize> = HashMap::new();
    tensors.iter().enumerate().map(|(i, t)| *seen.entry((t.location(), t.stored_len())).or_insert(i)).collect()
}

/// How a sharded index is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IndexStyle {
    /// huggingface_hub's `save_torch_state_dict`: `weight_map` in shard order.
    Hub,
    /// DeepSpeed's `zero_to_fp32`: keys sorted, and a trailing newline.
    ZeroToFp32,
}

/// Where a state dict goes.
#[derive(Clone, Debug)]
pub(crate) enum Dest {
    /// One file.
    File(PathBuf),
    /// A folder of shards of at most `max` bytes (a single shard gets the unsharded name).
    Shards { dir: PathBuf, max: u64, style: IndexStyle },
}

/// What a planner will write.
#[derive(Clone, Debug, Default)]
pub(crate) struct Placed {
    /// Data files, in shard order.
    pub files: Vec<PathBuf>,
    /// The index, when sharded into more than one file.
    pub index: Option<PathBuf>,
    /// Tensor bytes written (each storage once).
    pub bytes: u64,
}

/// The metadata that goes with a state dict: `format` (written first into every file that
/// has metadata) and the rest, which a single file carries in `__metadata__` and a sharded
/// output in its index, as huggingface_hub does.
#[derive(Clone, Debug, Default)]
pub(crate) struct Meta {
    pub format: Option<String>,
    pub user: Vec<(String, serde_json::Value)>,
}

impl Meta {
    /// Splits a folded metadata list into `format` and the rest.
    pub(crate) fn from_folded(folded: Vec<(String, serde_json::Value)>) -> Meta {
        let mut format = None;
        let mut user = Vec::with_capacity(folded.len());
        for (k, v) in folded {
            if k == "format" {
                format = Some(json_text(&v));
            } else {
                user.push((k, v));
            }
        }
        Meta { format, user }
    }

    /// The metadata a file carries: `format`, and the rest when `with_user` (an unsharded
    /// output).
    pub(crate) fn file(&self, with_user: bool) -> Vec<(String, String)> {
        let format = self.format.iter().map(|f| ("format".to_string(), f.clone()));
        let user = self.user.iter().filter(|_| with_user).map(|(k, v)| (k.clone(), json_text(v)));
        format.chain(user).collect()
    }
}

/// A JSON value as safetensors metadata text: strings as themselves, anything else as JSON.
pub(crate) fn json_text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Assigns tensors to shards the way huggingface_hub's `split_state_dict_into_shards_factory`
/// does. `items` are `(storage key, size)` in state-dict order; tensors sharing a storage key
/// count once and follow the first of them into its shard, appended at its end.
///
/// The pass is greedy and single: a tensor larger than the limit gets a shard of its own,
/// emitted immediately while the current shard stays open, so key order is not monotonic
/// across shards (huggingface_hub behaves the same).
pub(crate) fn assign_shards<K: Eq + std::hash::Hash + Clone>(items: &[(K, u64)], max: u64) -> (Vec<Vec<usize>>, u64) {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut group_of: HashMap<K, usize> = HashMap::new();
    // The shard each group's first tensor landed in; `open` are the groups of the open shard.
    let mut shard_of: Vec<usize> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_size = 0u64;
    let mut total = 0u64;
    for (i, (key, size)) in items.iter().enumerate() {
        if let Some(&g) = group_of.get(key) {
            groups[g].push(i);
            continue;
        }
        let g = groups.len();
        group_of.insert(key.clone(), g);
        groups.push(vec![i]);
        shard_of.push(0);
        total = total.saturating_add(*size);
        if *size > max {
            shard_of[g] = shards.len();
            shards.push(vec![i]);
            continue;
        }
        if current_size.saturating_add(*size) > max {
            for og in open.drain(..) {
                shard_of[og] = shards.len();
            }
            shards.push(std::mem::take(&mut current));
            current_size = 0;
        }
        open.push(g);
        current.push(i);
        current_size += size;
    }
    if !current.is_empty() {
        for og in open.drain(..) {
            shard_of[og] = shards.len();
        }
        shards.push(current);
    }
    for (g, group) in groups.iter().enumerate().filter(|(_, g)| g.len() > 1) {
        if let Some(shard) = shards.get_mut(shard_of[g]) {
            shard.extend_from_slice(&group[1..]);
        }
    }
    (shards, total)
}

/// The file names of `n` shards of a `stem`/`ext` checkpoint (`model-00001-of-00002.safetensors`),
/// or the unsharded name when there is one.
fn shard_names(dir: &Path, n: usize, single: &str, stem: &str, ext: &str) -> Vec<PathBuf> {
    if n == 1 {
        return vec![dir.join(single)];
    }
    (1..=n).map(|i| dir.join(format!("{stem}-{i:05}-of-{n:05}{ext}"))).collect()
}

/// Cuts `outs` into the destination's files: `(path, members)` per file, and the total bytes.
pub(crate) fn cut<'o>(
    outs: &'o [Out<'o>],
    dest: &Dest,
    single: &str,
    stem: &str,
    ext: &str,
) -> (Vec<(PathBuf, Vec<usize>)>, u64) {
    let items: Vec<(usize, u64)> = outs.iter().map(|o| (o.key, o.byte_len())).collect();
    let (shards, total) = match dest {
        Dest::File(_) => {
            let unique: u64 = items.iter().enumerate().filter(|(i, (k, _))| i == k).map(|(_, (_, s))| *s).sum();
            (vec![(0..outs.len()).collect::<Vec<_>>()], unique)
        }
        Dest::Shards { max, .. } => assign_shards(&items, *max),
    };
    // A single file always exists; a folder of nothing holds nothing (as huggingface_hub's
    // split of an empty state dict gives no shard).
    let shards = if shards.is_empty() && matches!(dest, Dest::File(_)) { vec![Vec::new()] } else { shards };
    let paths = match dest {
        Dest::File(p) => vec![p.clone()],
        Dest::Shards { dir, .. } => shard_names(dir, shards.len(), single, stem, ext),
    };
    (paths.into_iter().zip(shards).collect(), total)
}

/// Refuses a broadcast view (`expand`) that would be written far larger than its storage,
/// unless asked: a file of a few kilobytes must not start a write of gigabytes.
pub(crate) fn refuse_expanded(outs: &[Out<'_>], files: &[crate::read::catalog::SourceFile], allow: bool) -> Result<()> {
    if allow {
        return Ok(());
    }
    for o in outs {
        if let Some((output, storage)) = o.tensor.expansion() {
            let path = o.tensor.location().and_then(|(f, _)| files.get(f)).map(|f| f.path.clone()).unwrap_or_default();
            return Err(Error::ExpandedView { path, tensor: o.tensor.name.clone(), output, storage });
        }
    }
    Ok(())
}

impl Checkpoint {
    /// The refusal [`crate::split`], [`crate::merge`] and [`crate::convert`] make without
    /// `allow_expanded`, for a reader that materialises every tensor whole (the Python
    /// package's `load`): the first broadcast view whose bytes would be far more than its
    /// storage's ([`Error::ExpandedView`]), before anything is allocated for it.
    pub fn refuse_expanded_views(&self) -> Result<()> {
        for t in self.tensors() {
            if let Some((output, storage)) = t.expansion() {
                let path =
                    t.location().and_then(|(f, _)| self.files.get(f)).map(|f| f.path.clone()).unwrap_or_default();
                return Err(Error::ExpandedView { path, tensor: t.name.clone(), output, storage });
            }
        }
        Ok(())
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
    fn follower_of_an_oversized_tensor_joins_its_shard() {
        let items = vec![("a", 2), ("big", 12), ("c", 2), ("big", 12)];
        let (shards, _) = assign_shards(&items, 10);
        assert_eq!(shards, vec![vec![1, 3], vec![0, 2]]);
    }

    #[test]
    fn empty_input_gives_no_shard() {
        let (shards, total) = assign_shards::<u8>(&[], 10);
        assert!(shards.is_empty());
        assert_eq!(total, 0);
    }
}
