//! Where the data stream was: torchdata's `StatefulDataLoader.state_dict()` in
//! `dl_state_dict[_i].bin` (flat with no workers, under `_snapshot` with), or a pickled
//! `SeedableRandomSampler` in `sampler[_i].bin` (its epoch and seed); and the stateful state
//! rewritten for another world size.

use std::path::Path;

use super::names::{classify, Kind};
use super::read::value;
use super::{bad, Component, DataPosition, ResumePoint, SaveState};
use crate::error::{Error, IoContext, Result};
use crate::formats::torch;
use crate::read::value::Leaf;

impl SaveState {
    /// Where dataloader `n` continues: the batches every rank had read from its stateful state
    /// (`_num_yielded`), else `step` (accelerate's resume recipe: the caller's own count, as
    /// passed to `skip_first_batches`); the epoch and seed from a pickled sampler, else
    /// `epoch` (default 0). A `step` that contradicts the saved position, or no position and no
    /// `step`, is refused naming the file.
    ///
    /// A position file that is there but cannot be read (its pickle names a global outside its
    /// allow-list, a value is out of range, a stateful state holds no batch count) is refused
    /// naming the file, whatever `step` and `epoch` say: it is never replaced by a default.
    pub fn resume_point(&self, n: usize, step: Option<u64>, epoch: Option<u64>) -> Result<ResumePoint> {
        if let Some(e) = self.unreadable_positions(Some(n)).into_iter().next() {
            return Err(e);
        }
        let (stateful, sampler) = (self.position_of(n, "dl_state_dict"), self.position_of(n, "sampler"));
        let batches = match (stateful.and_then(|p| p.batches_yielded), step) {
            (Some(k), None) => k,
            (Some(k), Some(s)) if k == s => k,
            (Some(k), Some(s)) => {
                let path = stateful.map_or(self.root.as_path(), |p| p.path.as_path());
                return Err(bad(
                    path,
                    None,
                    format!("saved the position ({k} batches per rank), which step {s} contradicts"),
                ));
            }
            (None, Some(s)) => s,
            (None, None) => {
                return Err(bad(
                    &self.root,
                    None,
                    format!(
                        "accelerate saved no data position for dataloader {n} (a map-style loader without \
                         `use_stateful_dataloader`); give the step, the batches each rank had read in the epoch, \
                         as accelerate's resume recipe passes to `skip_first_batches`"
                    ),
                ))
            }
        };
        let epoch = sampler.and_then(|p| p.epoch).or(epoch).unwrap_or(0);
        Ok(ResumePoint { batches, epoch, seed: sampler.and_then(|p| p.seed), world_size: self.world_size })
    }

    /// Why the stateful state at `p` gives no batch count.
    fn no_batch_count(&self, p: &DataPosition) -> Error {
        const COUNTS: [&str; 3] = ["_num_yielded", "_snapshot._snapshot_step", "_steps_since_snapshot"];
        let c = self.data.iter().map(|(c, _)| c).find(|c| c.path == p.path);
        let wrong =
            c.and_then(|c| COUNTS.iter().find_map(|k| value(c, k).filter(|v| v.as_u64().is_none()).map(|v| (k, v))));
        match wrong {
            Some((key, v)) => bad(&p.path, None, format!("`{key}` is {v}, not a batch count")),
            None => bad(
                &p.path,
                None,
                "holds no batch count (`_num_yielded`, or `_snapshot._snapshot_step` with workers); \
                 the data position is not read, and none is guessed",
            ),
        }
    }

    /// Why each data position file (of dataloader `n`, or of all) that is there cannot be read:
    /// its pickle names a global outside its allow-list, a value is out of range, or a stateful
    /// state holds no batch count. `verify` reports these, and `reshard` and
    /// [`SaveState::resume_point`] refuse them.
    pub(crate) fn unreadable_positions(&self, n: Option<usize>) -> Vec<Error> {
        self.data
            .iter()
            .filter(|(c, _)| n.is_none_or(|n| c.index == n))
            .filter_map(|(c, p)| match p {
                None => {
                    let kind = c.path.file_name().and_then(|f| classify(&f.to_string_lossy(), false));
                    position(c, kind.map_or(Kind::DataLoader, |(k, _)| k)).err()
                }
                Some(p) if p.kind == "dl_state_dict" && p.batches_yielded.is_none() => Some(self.no_batch_count(p)),
                Some(_) => None,
            })
            .collect()
    }

    /// The data position of dataloader `n`: its stateful state, else its pickled sampler.
    pub fn data_position(&self, n: usize) -> Option<&DataPosition> {
        self.position_of(n, "dl_state_dict").or_else(|| self.position_of(n, "sampler"))
    }

    /// Dataloader `n`'s position from the file of `kind` (`dl_state_dict` or `sampler`).
    fn position_of(&self, n: usize, kind: &str) -> Option<&DataPosition> {
        self.data.iter().filter(|(c, _)| c.index == n).find_map(|(_, p)| p.as_ref().filter(|p| p.kind == kind))
    }
}

/// torchdata's `StatefulDataLoader.state_dict()`: flat with no workers, under `_snapshot` with.
fn loader_position(c: &Component) -> DataPosition {
    let u = |n: &str| value(c, n).and_then(serde_json::Value::as_u64);
    let (batches, workers) = match u("_num_yielded") {
        Some(n) => (Some(n), Some(0)),
        None => (
            u("_snapshot._snapshot_step").map(|s| s + u("_steps_since_snapshot").unwrap_or(0)),
            u("_snapshot._main_snapshot._num_workers"),
        ),
    };
    let samples = [
        "_index_sampler_state.samples_yielded",
        "_sampler_iter_state.samples_yielded",
        "_snapshot._main_snapshot._index_sampler_state.samples_yielded",
    ]
    .iter()
    .find_map(|n| u(n));
    DataPosition {
        path: c.path.clone(),
        kind: "dl_state_dict",
        batches_yielded: batches,
        samples_yielded: samples,
        finished: value(c, "_iterator_finished").and_then(serde_json::Value::as_bool),
        num_workers: workers,
        ..DataPosition::default()
    }
}

/// The data position the file `c` of `kind` saved: refused by name where its pickle names a
/// global outside its allow-list, or where a value it needs is out of range.
pub(super) fn position(c: &Component, kind: Kind) -> Result<DataPosition> {
    if let Some(global) = &c.refused {
        return Err(bad(
            &c.path,
            None,
            format!(
                "its pickle names `{global}`, outside what this kind of file may hold; \
                 the data position is not read, and none is guessed"
            ),
        ));
    }
    match kind {
        Kind::Sampler => sampler_position(c),
        _ => Ok(loader_position(c)),
    }
}

/// A pickled `SeedableRandomSampler`: its epoch and seed (`set_epoch` reseeds with their sum),
/// both required, the epoch a count from 0 and the seed a 64-bit signed integer.
fn sampler_position(c: &Component) -> Result<DataPosition> {
    let field = |name: &str, what: &str, ok: fn(&serde_json::Value) -> bool| -> Result<&serde_json::Value> {
        match value(c, name) {
            None => {
                Err(bad(&c.path, None, format!("has no `{name}`; the data position is not read, and none is guessed")))
            }
            Some(v) if !ok(v) => Err(bad(&c.path, None, format!("`{name}` is {v}, not {what}"))),
            Some(v) => Ok(v),
        }
    };
    let epoch = field("state.epoch", "an epoch (a count from 0)", |v| v.as_u64().is_some())?.as_u64();
    let seed = field("state.initial_seed", "a seed (a 64-bit signed integer)", |v| v.as_i64().is_some())?.as_i64();
    Ok(DataPosition { path: c.path.clone(), kind: "sampler", epoch, seed, ..DataPosition::default() })
}

/// Writes the stateful dataloader state `src`, saved by `from` ranks, for `to` ranks at `dst`
/// (a new file). Every rank had read `k` batches, `from·k` in all; on `to` ranks that is
/// `⌊from·k/to⌋` each (accelerate's `BatchSamplerShard` deals whole rounds of batches, so the
/// remainder of a round is read again). Only the main-process form is moved: the multi-worker
/// form's per-worker snapshots describe the old round-robin.
pub(crate) fn write_loader_state(src: &Path, dst: &Path, from: u64, to: u64) -> Result<()> {
    let f = torch::read_with_classes(src, &[])?;
    if from == to {
        return crate::write::copy_durable(src, dst);
    }
    if let Some(t) = f.tensors.first() {
        return Err(bad(
            src,
            None,
            format!(
                "holds the tensor `{}` (a stateful sampler's own state), which cannot be moved to another world size",
                t.name
            ),
        ));
    }
    let yielded = |name: &str| f.leaves.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let Some(Leaf::Int(k)) = yielded("_num_yielded") else {
        return Err(bad(
            src,
            None,
            "is a multi-worker (`num_workers > 0`) or unknown dataloader state; only the main-process form moves to another world size",
        ));
    };
    let k = u64::try_from(k).map_err(|_| bad(src, None, "`_num_yielded` is negative"))?;
    let moved = i64::try_from(fsdp_state::stream::steps_on_world(k, 1, from, to)).unwrap_or(i64::MAX);
    let mut root: Vec<(String, Leaf)> = Vec::new();
    for (name, leaf) in &f.leaves {
        let leaf = match name.as_str() {
            "_num_yielded" | "_sampler_iter_yielded" => Leaf::Int(moved),
            _ => leaf.clone(),
        };
        insert(&mut root, name, leaf);
    }
    let layout = crate::formats::torch::writer::layout_value(
        &crate::formats::torch::writer::archive_name(dst),
        &Leaf::Dict(root),
        dst,
    )?;
    let file = crate::write::create_new(dst)?;
    file.set_len(layout.file_len).at(dst)?;
    layout.write_fixed_at(&file, dst, 0)?;
    layout.finish_at(&file, dst, 0)?;
    file.sync_all().at(dst)
}

/// Puts `leaf` at the dotted `name` of a nested dict (the inverse of flattening string keys).
fn insert(into: &mut Vec<(String, Leaf)>, name: &str, leaf: Leaf) {
    match name.split_once('.') {
        None => into.push((name.to_string(), leaf)),
        Some((head, rest)) => {
            if !into.iter().any(|(k, _)| k == head) {
                into.push((head.to_string(), Leaf::Dict(Vec::new())));
            }
            if let Some((_, Leaf::Dict(d))) = into.iter_mut().find(|(k, _)| k == head) {
                insert(d, rest, leaf);
            }
        }
    }
}
