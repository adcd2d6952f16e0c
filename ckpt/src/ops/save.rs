//! Saving tensors held in memory as safetensors: one file, or huggingface_hub's sharded folder.
//!
//! [`save_safetensors`] is the door the Python package's `save` goes through, and any Rust
//! caller with tensors in memory. It builds the same catalog every operation builds (each
//! tensor one range of its own source), plans it with the same planner as [`crate::split`]
//! (huggingface_hub's greedy shards, names, index and `__metadata__`) and runs the plan with the
//! same write engine (unpredictable temporaries created exclusively, fsync, rename, index last,
//! the previous checkpoint's files kept whole until the new index lands, planted links refused).
//! The sources are the caller's buffers themselves, borrowed: nothing is copied before it is
//! written, and the copies run in parallel pieces as they do from files.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result, SaveTensorProblem};
use crate::ops::outcome::Outcome;
use crate::plan::{self, Dest, IndexStyle, Meta, Out};
use crate::read::catalog::{Chunk, TensorInfo};
use crate::read::dtype::Dtype;
use crate::read::io::Sources;
use crate::read::shape::numel;
use crate::write::{Plan, WriteOptions};

/// A tensor held in memory: its name, dtype, shape and row-major little-endian bytes.
#[derive(Clone, Copy, Debug)]
pub struct MemoryTensor<'a> {
    /// Its name in the state dict.
    pub name: &'a str,
    /// Element type (one safetensors stores).
    pub dtype: Dtype,
    /// Its shape; the bytes hold exactly its elements.
    pub shape: &'a [u64],
    /// The elements, row-major, little-endian.
    pub bytes: &'a [u8],
}

/// Options for [`save_safetensors`].
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// A folder of huggingface_hub shards of at most this many bytes each (a tensor larger
    /// than that gets a shard of its own; everything in one shard is `model.safetensors` alone,
    /// with no index). `None`: one file.
    pub max_shard_size: Option<u64>,
    /// `__metadata__` after `format` (`pt` unless this names another): in the file when there
    /// is one, in the index after `total_size` when there are shards, as huggingface_hub's
    /// `save_torch_state_dict` writes it.
    pub metadata: Vec<(String, String)>,
}

/// Writes `tensors`, in the order given, as safetensors at `path`: the bytes
/// `huggingface_hub.save_torch_state_dict(state_dict, path, max_shard_size=…, metadata=…)`
/// writes for the same state dict (shards, their names, the index and every file's content;
/// with no `max_shard_size`, what `safetensors.torch.save_file` writes with that metadata).
///
/// Empty tensors share one storage, as torch gives every one the same null pointer: they
/// follow the first of them into its shard. Names must be unique and each tensor's bytes must
/// hold its shape's elements. Returns the files written, the index last.
pub fn save_safetensors(
    tensors: &[MemoryTensor<'_>],
    path: &Path,
    options: &SaveOptions,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    match opts.job {
        // Over the ranks of a job, one rank's refusal ends the others' wait too.
        Some(job) => job.operation(path, || save_here(tensors, path, options, opts)),
        None => save_here(tensors, path, options, opts),
    }
}

fn save_here(
    tensors: &[MemoryTensor<'_>],
    path: &Path,
    options: &SaveOptions,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    let _held = crate::write::claim::claim(path, opts)?;
    let bad = |tensor: &str, problem| Error::BadSaveTensor { dst: path.to_path_buf(), tensor: tensor.into(), problem };
    let mut infos = Vec::with_capacity(tensors.len());
    let mut seen = std::collections::HashSet::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if !t.dtype.in_safetensors() {
            return Err(Error::NotInSafetensors { tensor: t.name.to_string(), dtype: t.dtype.to_string() });
        }
        if !seen.insert(t.name) {
            return Err(bad(t.name, SaveTensorProblem::NamedTwice));
        }
        let want = numel(t.shape).and_then(|n| t.dtype.byte_len(n));
        let len = t.bytes.len() as u64;
        if want != Some(len) {
            let problem = SaveTensorProblem::ByteLen { len, shape: t.shape.to_vec(), dtype: t.dtype, holds: want };
            return Err(bad(t.name, problem));
        }
        let chunk = Chunk { file: i, offset: 0, len };
        infos.push(TensorInfo::ranges(t.name.to_string(), t.dtype, t.shape.to_vec(), vec![chunk]));
    }
    let first_empty = tensors.iter().position(|t| t.bytes.is_empty());
    let outs: Vec<Out<'_>> = infos
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let key = if tensors[i].bytes.is_empty() { first_empty.unwrap_or(i) } else { i };
            Out { tensor: t, dtype: t.dtype, key, tied_to: None, compute: None }
        })
        .collect();

    let mut meta = Meta::from_folded(
        options.metadata.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect(),
    );
    meta.format.get_or_insert_with(|| "pt".into());
    let dest = match options.max_shard_size {
        Some(max) => Dest::Shards { dir: path.to_path_buf(), max, style: IndexStyle::Hub },
        None => Dest::File(path.to_path_buf()),
    };
    let mut plan = Plan::default();
    let placed = plan::safetensors(&outs, &meta, &dest, &mut plan)?;
    if let Dest::File(p) = &dest {
        plan.named.push(p.clone());
    }
    let srcs =
        Sources::memory(tensors.iter().map(|t| (PathBuf::from(format!("<tensor `{}` in memory>", t.name)), t.bytes)));
    crate::write::execute::execute_from(&plan, &srcs, &[], opts)?;
    let mut files = placed.files;
    files.extend(placed.index);
    Ok(Outcome { files, tensors: tensors.len(), bytes: placed.bytes, ..Outcome::default() })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn f32s(n: usize, base: f32) -> Vec<u8> {
        (0..n).flat_map(|i| (base + i as f32).to_le_bytes()).collect()
    }

    #[test]
    fn shards_as_split_does_and_reads_back() {
        let tmp = tempfile::tempdir().unwrap();
        // 2, 12 (over the limit: a shard of its own, the open shard stays open), 2, 6 KiB.
        let bufs: Vec<Vec<u8>> = [512, 3072, 512, 1536].iter().enumerate().map(|(i, &n)| f32s(n, i as f32)).collect();
        let shapes: Vec<Vec<u64>> = vec![vec![512], vec![3, 1024], vec![512], vec![1536]];
        let names = ["a", "big", "c", "d"];
        let mut tensors: Vec<MemoryTensor<'_>> = (0..4)
            .map(|i| MemoryTensor { name: names[i], dtype: Dtype::F32, shape: &shapes[i], bytes: &bufs[i] })
            .collect();
        tensors.push(MemoryTensor { name: "empty", dtype: Dtype::BF16, shape: &[0, 3], bytes: &[] });
        let out = tmp.path().join("m");
        let opts = SaveOptions { max_shard_size: Some(10 << 10), metadata: vec![("k".into(), "v".into())] };
        let done = save_safetensors(&tensors, &out, &opts, &WriteOptions::default()).unwrap();
        let index = out.join("model.safetensors.index.json");
        assert_eq!(done.files.last(), Some(&index));
        assert_eq!(done.tensors, 5);
        assert_eq!(done.bytes, 4 * (512 + 3072 + 512 + 1536));

        // The same shards, names and index as `ckpt split` of the same tensors in one file.
        let single = tmp.path().join("one.safetensors");
        save_safetensors(&tensors, &single, &SaveOptions::default(), &WriteOptions::default()).unwrap();
        let ck = crate::Checkpoint::open(single.to_str().unwrap()).unwrap();
        let names: Vec<&str> = ck.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "big", "c", "d", "empty"], "the caller's order is kept");
        assert_eq!(ck.metadata().unwrap(), vec![("format".to_string(), serde_json::json!("pt"))]);
        let split = tmp.path().join("split");
        crate::split(&ck, &split, 10 << 10, &WriteOptions::default()).unwrap();
        let listing = |d: &Path| {
            let mut v: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
            v.sort();
            v
        };
        assert_eq!(listing(&out), listing(&split));
        for name in listing(&out) {
            let (ours, theirs) = (std::fs::read(out.join(&name)).unwrap(), std::fs::read(split.join(&name)).unwrap());
            if name == "model.safetensors.index.json" {
                // The user's metadata goes in the index, after `total_size`.
                let text = String::from_utf8(ours).unwrap();
                assert!(text.contains("\"total_size\": 22528,\n    \"k\": \"v\""), "{text}");
                let weight_map = |t: &str| t[t.find("weight_map").unwrap()..].to_string();
                assert_eq!(weight_map(&text), weight_map(&String::from_utf8(theirs).unwrap()));
            } else {
                assert_eq!(ours, theirs, "{name:?}");
            }
        }
        // `big` went first (over the limit), `a` and `c` stayed together, the empty tensor
        // followed nothing (the only one) and closes the last shard.
        let text = std::fs::read_to_string(&index).unwrap();
        let order: Vec<&str> = ["\"big\"", "\"a\"", "\"c\"", "\"d\"", "\"empty\""].into();
        let at: Vec<usize> = order.iter().map(|n| text.find(n).unwrap()).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{text}");

        let back = crate::Checkpoint::open(out.to_str().unwrap()).unwrap();
        for (t, want) in names.iter().zip(&bufs) {
            let info = back.tensors().iter().find(|i| i.name == *t).unwrap();
            assert_eq!(&back.read_tensor(info).unwrap(), want, "{t}");
        }
        let left: Vec<_> = listing(tmp.path());
        assert_eq!(left, ["m", "one.safetensors", "split"].map(std::ffi::OsString::from), "no temporaries left");
    }

    #[test]
    fn a_resave_replaces_the_previous_shards_and_refuses_planted_links() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("m");
        let bufs: Vec<Vec<u8>> = (0..6).map(|i| f32s(256, i as f32)).collect();
        let shape = [256u64];
        let names: Vec<String> = (0..6).map(|i| format!("w{i}")).collect();
        let tensors: Vec<MemoryTensor<'_>> = (0..6)
            .map(|i| MemoryTensor { name: &names[i], dtype: Dtype::F32, shape: &shape, bytes: &bufs[i] })
            .collect();
        let sharded = SaveOptions { max_shard_size: Some(1024), ..SaveOptions::default() };
        save_safetensors(&tensors, &out, &sharded, &WriteOptions::default()).unwrap();
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 7);
        // Fewer, larger shards: the old ones nothing replaced are swept once the index lands.
        let fewer = SaveOptions { max_shard_size: Some(4096), ..SaveOptions::default() };
        let done = save_safetensors(&tensors, &out, &fewer, &WriteOptions::default()).unwrap();
        assert_eq!(done.files.len(), 3);
        let mut left: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        let want =
            ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"];
        assert_eq!(left, want.map(std::ffi::OsString::from));

        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let shard = out.join("model-00001-of-00002.safetensors");
        std::fs::remove_file(&shard).unwrap();
        std::os::unix::fs::symlink(&victim, &shard).unwrap();
        let e = save_safetensors(&tensors, &out, &fewer, &WriteOptions::default()).unwrap_err();
        assert!(matches!(e, Error::PlantedLink { .. }), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    }

    #[test]
    fn bytes_that_do_not_match_the_shape_are_refused_before_anything_is_written() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("m.safetensors");
        let bytes = [0u8; 10];
        let t = MemoryTensor { name: "x", dtype: Dtype::F32, shape: &[3], bytes: &bytes };
        let e = save_safetensors(&[t], &out, &SaveOptions::default(), &WriteOptions::default()).unwrap_err();
        let want = format!("cannot save {}: tensor `x` has 10 bytes, but shape [3] of `F32` holds 12", out.display());
        assert_eq!(e.to_string(), want);
        let t = MemoryTensor { bytes: &bytes[..8], shape: &[2], ..t };
        let e = save_safetensors(&[t, t], &out, &SaveOptions::default(), &WriteOptions::default()).unwrap_err();
        assert!(e.to_string().contains("tensor `x` is named twice"), "{e}");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }
}
