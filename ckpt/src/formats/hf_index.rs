//! Hugging Face sharded checkpoints: shard files plus an index.
//!
//! A sharded checkpoint is a folder of `model-00001-of-0000N.safetensors` files and one
//! `model.safetensors.index.json`:
//!
//! ```json
//! { "metadata": { "total_size": 123, ... }, "weight_map": { "tensor.name": "model-00001-of-00002.safetensors", ... } }
//! ```
//!
//! `total_size` is the sum of the tensors' byte sizes (huggingface_hub counts each storage once,
//! headers excluded). `weight_map` values are bare file names in the index's folder; like
//! huggingface_hub we refuse anything that could leave it (separators, `..`, absolute or drive
//! paths). With a single shard, huggingface_hub writes `model.safetensors` and no index.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::safetensors::{self as st, Entries};
use crate::error::{Error, IndexProblem, Result};
use crate::plan::{Dest, IndexStyle, Meta, Out, Placed};
use crate::read::catalog::{Checkpoint, Format, Parts, Scan, SourceFile};
use crate::read::io::is_plain_file_name;
use crate::write::{self, Plan};

/// The name huggingface_hub gives the index of `model{suffix}.safetensors` shards.
pub(crate) const INDEX_NAME: &str = "model.safetensors.index.json";
pub(crate) use super::safetensors::{folder_files, SINGLE_NAME};
/// The largest index we read: a `weight_map` of a million long names is well under it.
pub(crate) const MAX_INDEX_LEN: u64 = 256 << 20;

/// A parsed, validated index file.
#[derive(Clone, Debug)]
pub(crate) struct Index {
    pub path: PathBuf,
    /// `metadata`, in file order (`total_size` included when present).
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// `weight_map`, in file order.
    pub weight_map: Vec<(String, String)>,
}

impl Index {
    /// Reads and validates the index at `path`, refusing one over [`MAX_INDEX_LEN`] bytes
    /// before reading it.
    pub(crate) fn read(path: &Path) -> Result<Index> {
        let text = crate::read::io::read_capped(path, MAX_INDEX_LEN)?;
        Index::parse(&text, path)
    }

    /// Parses and validates index JSON.
    pub(crate) fn parse(text: &[u8], path: &Path) -> Result<Index> {
        let bad = |problem| Error::BadIndex { path: path.to_path_buf(), problem };
        let not_json = |e: serde_json::Error| bad(IndexProblem::NotJson { parser: e.to_string() });
        let root: serde_json::Value = serde_json::from_slice(text).map_err(not_json)?;
        let serde_json::Value::Object(mut root) = root else {
            return Err(bad(IndexProblem::NotAnObject));
        };
        let metadata = match root.remove("metadata") {
            None | Some(serde_json::Value::Null) => serde_json::Map::new(),
            Some(serde_json::Value::Object(m)) => m,
            Some(_) => return Err(bad(IndexProblem::MetadataNotAnObject)),
        };
        if !matches!(root.get("weight_map"), Some(serde_json::Value::Object(_))) {
            return Err(bad(IndexProblem::NoWeightMap));
        }
        // The parsed map kept one of any repeated key; read the entries again in file order,
        // duplicates kept, to refuse them as safetensors headers refuse repeated names.
        #[derive(serde::Deserialize)]
        struct Raw {
            weight_map: Entries<serde_json::Value>,
        }
        let raw: Raw = serde_json::from_slice(text).map_err(not_json)?;
        let mut weight_map = Vec::with_capacity(raw.weight_map.0.len());
        let mut seen = std::collections::HashSet::with_capacity(raw.weight_map.0.len());
        for (tensor, file) in raw.weight_map.0 {
            if !seen.insert(tensor.clone()) {
                return Err(bad(IndexProblem::ListedTwice { tensor }));
            }
            let serde_json::Value::String(file) = file else {
                return Err(bad(IndexProblem::FileNotAString { tensor }));
            };
            if !is_plain_file_name(&file) {
                return Err(Error::UnsafeShardPath { index: path.to_path_buf(), tensor, file });
            }
            weight_map.push((tensor, file));
        }
        Ok(Index { path: path.to_path_buf(), metadata, weight_map })
    }

    /// The folder shard names are relative to.
    pub(crate) fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }

    /// Distinct shard file names in order of first appearance.
    pub(crate) fn shard_names(&self) -> Vec<&str> {
        let mut seen = std::collections::HashSet::new();
        self.weight_map.iter().map(|(_, f)| f.as_str()).filter(|f| seen.insert(*f)).collect()
    }
}

/// A sharded safetensors root: a `*.index.json` file (torch ones were claimed before), or a
/// folder holding `model.safetensors.index.json` or, without a `model.safetensors`, exactly one
/// `*.safetensors.index.json`.
pub(crate) fn detect(path: &Path) -> Result<Option<PathBuf>> {
    if path.is_file() {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        return Ok(name.ends_with(".index.json").then(|| path.to_path_buf()));
    }
    let index = path.join(INDEX_NAME);
    if index.is_file() {
        return Ok(Some(index));
    }
    if path.join(SINGLE_NAME).is_file() {
        return Ok(None);
    }
    let (indexes, _) = folder_files(path)?;
    Ok(match indexes.as_slice() {
        [one] => Some(one.clone()),
        _ => None,
    })
}

/// huggingface_hub's sharded safetensors: merged and converted as stored, not laid out for
/// ranks.
pub(crate) struct HfShardedFormat;

impl super::FormatOps for HfShardedFormat {
    fn catalog(&self, _: Format, root: PathBuf, _: &crate::OpenOptions) -> Result<Scan> {
        catalog(root)
    }

    /// A Hugging Face model folder (its `config.json` beside the weights) as a Megatron-LM run.
    fn to_megatron(
        &self,
        ck: &Checkpoint,
        out: &Path,
        layout: crate::ops::RunLayout,
        opts: &crate::WriteOptions<'_>,
    ) -> Result<crate::Outcome> {
        super::megatron::save::from_hf(ck, out, layout, opts)
    }
}

/// The catalog of a sharded checkpoint, with every disagreement between the index and its
/// shards collected as a problem (so `verify` lists them all) rather than stopping at the first.
pub(crate) fn catalog(index_path: PathBuf) -> Result<Scan> {
    let index = Index::read(&index_path)?;
    let dir = index.dir().to_path_buf();
    catalog_of(&index, |name| {
        let path = dir.join(name);
        path.exists().then(|| st::read_file(&path))
    })
}

/// The catalog of the sharded checkpoint `index` describes, each shard's header read by
/// `read_shard(name)` (`None`: the shard is missing): from the index's folder, or from a Hub
/// repository by range requests (`hf://`), with the same checks either way.
pub(crate) fn catalog_of(
    index: &Index,
    mut read_shard: impl FnMut(&str) -> Option<Result<(SourceFile, st::Header)>>,
) -> Result<Scan> {
    let index_path = index.path.clone();
    let mut problems = Vec::new();

    // The first tensor that names each shard, found in one pass.
    let mut first_tensor: HashMap<&str, &str> = HashMap::new();
    for (t, f) in &index.weight_map {
        first_tensor.entry(f.as_str()).or_insert(t.as_str());
    }
    // Shards in sorted name order: for huggingface_hub's names that is shard order.
    let mut names: Vec<&str> = index.shard_names();
    names.sort_unstable();
    let mut files: Vec<SourceFile> = Vec::new();
    let mut tensors = Vec::new();
    let mut holder: HashMap<String, usize> = HashMap::new();
    let mut file_of_name: HashMap<&str, usize> = HashMap::new();
    for name in names {
        let Some(read) = read_shard(name) else {
            problems.push(Error::MissingShard {
                index: index_path.clone(),
                tensor: first_tensor.get(name).copied().unwrap_or_default().to_string(),
                file: name.into(),
            });
            continue;
        };
        let (file, header) = match read {
            Ok(x) => x,
            Err(e) => {
                problems.push(e);
                continue;
            }
        };
        let path = file.path.clone();
        let fi = files.len();
        file_of_name.insert(name, fi);
        for t in st::header_tensors(header, fi) {
            if let Some(&prev) = holder.get(&t.name) {
                problems.push(Error::DuplicateAcrossShards {
                    tensor: t.name.clone(),
                    first: files.get(prev).map(|f| f.path.clone()).unwrap_or_default(),
                    second: path.clone(),
                });
                continue;
            }
            holder.insert(t.name.clone(), fi);
            tensors.push(t);
        }
        files.push(file);
    }

    let listed: HashMap<&str, &str> = index.weight_map.iter().map(|(t, f)| (t.as_str(), f.as_str())).collect();
    for (tensor, fname) in &index.weight_map {
        let Some(&fi) = file_of_name.get(fname.as_str()) else {
            continue;
        };
        if holder.get(tensor) != Some(&fi) {
            problems.push(Error::TensorNotInShard {
                index: index_path.clone(),
                tensor: tensor.clone(),
                file: fname.clone(),
            });
        }
    }
    // A tensor listed under another shard is reported above (that shard is missing or lacks
    // it); here only tensors the index does not list at all.
    for t in tensors.iter().filter(|t| !listed.contains_key(t.name.as_str())) {
        let file = t.location().and_then(|(f, _)| files.get(f)).map(|f| f.path.clone()).unwrap_or_default();
        problems.push(Error::UnlistedTensor { index: index_path.clone(), file, tensor: t.name.clone() });
    }
    let mut parts = Parts::new(Format::HfSharded, index_path, files, tensors);
    parts.index_metadata = Some(index.metadata.clone());
    Ok(Scan { checkpoint: Checkpoint::new(parts)?, problems })
}

/// True for names that huggingface_hub's `save_torch_state_dict` deletes before writing with the
/// file pattern `{stem}{suffix}{ext}`: `model.safetensors`, `model-XXXXX-of-XXXXX.safetensors`
/// and the `.index.json` (`stem` = `model`, `ext` = `.safetensors`; `pytorch_model` and `.bin`
/// for torch files).
pub(crate) fn is_managed_name(name: &str, stem: &str, ext: &str) -> bool {
    let Some(rest) = name.strip_prefix(stem) else {
        return false;
    };
    let rest = rest.strip_suffix(".index.json").unwrap_or(rest);
    let Some(mid) = rest.strip_suffix(ext) else {
        return false;
    };
    if mid.is_empty() {
        return true;
    }
    let b = mid.as_bytes();
    // Byte-wise with `get`: a non-ASCII name must not split a character.
    b.len() == 15
        && b.first() == Some(&b'-')
        && b.get(1..6).is_some_and(|d| d.iter().all(u8::is_ascii_digit))
        && b.get(6..10) == Some(b"-of-".as_slice())
        && b.get(10..15).is_some_and(|d| d.iter().all(u8::is_ascii_digit))
}

/// Renders an index the way huggingface_hub writes it: `json.dump(index, indent=2)`, which
/// escapes every non-ASCII character and has no trailing newline.
pub(crate) fn render(
    metadata: &serde_json::Map<String, serde_json::Value>,
    weight_map: &[(String, String)],
) -> Vec<u8> {
    let weight_map: serde_json::Map<String, serde_json::Value> =
        weight_map.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
    let root = serde_json::json!({ "metadata": metadata, "weight_map": weight_map });
    // serde_json's pretty printer matches Python's `indent=2` layout; Python additionally
    // escapes everything outside printable ASCII (ensure_ascii), which only occurs inside strings.
    let pretty = serde_json::to_string_pretty(&root).unwrap_or_default();
    escape_non_ascii(&pretty).into_bytes()
}

/// Python's `ensure_ascii` on JSON text: everything outside printable ASCII as `\uXXXX`.
pub(crate) fn escape_non_ascii(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if (' '..='~').contains(&c) || c == '\n' {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

/// The index of a sharded output (huggingface_hub's layout, whatever the shards' format), the
/// previous checkpoint's files to sweep, and the outcome.
pub(crate) fn finish_sharded(
    plan: &mut Plan,
    files: &[(PathBuf, Vec<usize>)],
    outs: &[Out<'_>],
    dest: &Dest,
    meta: &Meta,
    total: u64,
    (stem, ext, index_name): (&str, &str, &str),
) -> Result<Placed> {
    let mut placed = Placed { files: files.iter().map(|(p, _)| p.clone()).collect(), index: None, bytes: total };
    let Dest::Shards { dir, style, .. } = dest else { return Ok(placed) };
    if files.len() > 1 {
        let mut weight_map: Vec<(String, String)> = Vec::with_capacity(outs.len());
        for (path, members) in files {
            let name = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            weight_map.extend(members.iter().map(|&i| (outs[i].tensor.name.clone(), name.clone())));
        }
        let mut index_meta = serde_json::Map::new();
        index_meta.insert("total_size".into(), total.into());
        for (k, v) in &meta.user {
            index_meta.insert(k.clone(), v.clone());
        }
        if *style == IndexStyle::ZeroToFp32 {
            weight_map.sort();
        }
        let mut text = render(&index_meta, &weight_map);
        if *style == IndexStyle::ZeroToFp32 {
            text.push(b'\n');
        }
        let index = dir.join(index_name);
        plan.trailers.push((index.clone(), text));
        placed.index = Some(index);
    }
    plan.stale = write::stale_files(dir, |n| is_managed_name(n, stem, ext), |n| n.ends_with(".index.json"))?;
    Ok(placed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn managed_names() {
        for ok in ["model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json"] {
            assert!(is_managed_name(ok, "model", ".safetensors"), "{ok}");
        }
        for no in ["model-1-of-2.safetensors", "other.safetensors", "model.bin", "model-00001-of-00002.bin"] {
            assert!(!is_managed_name(no, "model", ".safetensors"), "{no}");
        }
        for ok in ["pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"] {
            assert!(is_managed_name(ok, "pytorch_model", ".bin"), "{ok}");
        }
        for no in ["pytorch_model-1-of-2.bin", "model.bin", "pytorch_model.safetensors", "model-0000é-of-2.safetensors"]
        {
            assert!(!is_managed_name(no, "pytorch_model", ".bin"), "{no}");
            assert!(!is_managed_name(no, "model", ".safetensors"), "{no}");
        }
    }

    #[test]
    fn plain_names() {
        assert!(is_plain_file_name("model-00001-of-00002.safetensors"));
        for bad in ["../x", "/etc/passwd", "a/b", "a\\b", "C:x", "..", ""] {
            assert!(!is_plain_file_name(bad), "{bad}");
        }
    }

    #[test]
    fn render_escapes_like_python() {
        let mut meta = serde_json::Map::new();
        meta.insert("total_size".into(), 4.into());
        let out = render(&meta, &[("é😀\u{7f}".into(), "f".into())]);
        assert_eq!(
            String::from_utf8(out).unwrap_or_default(),
            "{\n  \"metadata\": {\n    \"total_size\": 4\n  },\n  \"weight_map\": {\n    \"\\u00e9\\ud83d\\ude00\\u007f\": \"f\"\n  }\n}"
        );
    }
}
