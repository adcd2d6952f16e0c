//! `convert` to a Hugging Face model folder: the source's format says what model it holds (a
//! format-neutral [`crate::ModelConfig`]), the architecture tables map its tensors to the Hub's
//! names and shapes, and the folder is planned like any sharded safetensors output, with
//! `config.json` written after the shards and before the index, all in one staged commit.

use std::path::Path;

use crate::error::{Error, Result};
use crate::formats;
use crate::map::arch::{hf_config, tables, Arch};
use crate::ops::misuse::Misuse;
use crate::ops::{ConvertOptions, Outcome, TargetFormat};
use crate::plan::{self, Dest, IndexStyle, Meta, Out};
use crate::read::catalog::{Checkpoint, Parts};
use crate::write::{Plan, WriteOptions};

/// The name transformers reads a model's configuration from.
pub(crate) const CONFIG_NAME: &str = "config.json";

/// Writes `ck` into the folder `dst` as a Hugging Face model (options checked by
/// [`ConvertOptions::check`]).
pub(super) fn convert(
    ck: &Checkpoint,
    dst: &Path,
    options: &ConvertOptions,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    let config = ck.format().ops().model_config(ck)?;
    let refuse = |arch: Arch, setting, value| Error::NoHfArchitecture {
        path: ck.root.clone(),
        arch: Some(arch.name()),
        setting,
        value,
    };
    let arch = match options.arch {
        Some(a) => match a.mismatch(&config) {
            Some((setting, value)) => return Err(refuse(a, setting, value)),
            None => a,
        },
        None => Arch::recognized(&config, &ck.root)?,
    };
    let vocab = options.vocab_size;
    if let Some(asked) = vocab.filter(|n| *n == 0 || *n > config.vocab_size) {
        let misuse = Misuse::VocabBeyondRows { asked, rows: config.vocab_size };
        return Err(Error::Misuse { path: dst.to_path_buf(), misuse });
    }
    let map = tables::to_hf(&ck.root, &config, arch, vocab, &ck.tensors)?;
    let tensors = map.apply(&ck.root, &ck.tensors)?;
    // The Hub model as a catalog of the source's own files (its tiling checked as every
    // catalog's is), which the planner and the executor read like any other.
    let mut parts = Parts::new(ck.format, ck.root.clone(), ck.files.clone(), tensors);
    parts.members = ck.members.clone();
    let hf = Checkpoint::new(parts)?;

    let dtype = options.dtype.unwrap_or(config.dtype);
    let keys = plan::storage_keys(&hf.tensors.iter().collect::<Vec<_>>());
    let outs: Vec<Out> = hf
        .tensors
        .iter()
        .zip(keys)
        .map(|(t, key)| {
            let d = if options.dtype.is_some() && t.dtype.is_castable() { dtype } else { t.dtype };
            Out { tensor: t, dtype: d, key, tied_to: None, compute: None }
        })
        .collect();
    let max = match options.max_shard_size {
        Some(m) => m,
        None => crate::plan::size::parse_size(crate::plan::size::DEFAULT_MAX_SHARD_SIZE)?,
    };
    let dest = Dest::Shards { dir: dst.to_path_buf(), max, style: IndexStyle::Hub };
    let meta = Meta { format: Some("pt".into()), user: Vec::new() };
    plan::refuse_expanded(&outs, &hf.files, opts.allow_expanded)?;
    let mut plan = Plan::default();
    let placed = formats::plan_state_dict(TargetFormat::Hf, &outs, &[], &meta, &dest, &mut plan)?;
    let rows = vocab.unwrap_or(config.vocab_size);
    let json = hf_config::config_json(&config, arch, rows, dtype);
    let mut text = serde_json::to_string_pretty(&json).unwrap_or_default();
    text.push('\n');
    // After the shards, before the index: the index stays the commit marker.
    let config_path = dst.join(CONFIG_NAME);
    plan.trailers.insert(0, (config_path.clone(), text.into_bytes()));
    crate::write::execute::execute(&plan, &hf, opts)?;
    let mut files = placed.files;
    files.push(config_path);
    files.extend(placed.index);
    Ok(Outcome { files, tensors: outs.len(), bytes: placed.bytes, ..Outcome::default() })
}
