//! A whole `save_state` folder written again for another world size (`reshard`), and a merge of
//! one of its models (`merge`): the folder is its parts, each handled as its own format
//! handles it.
//!
//! The new folder is staged whole ([`Stage::folder`]): every part is written straight into the
//! staging folder under its final name, and the folder is committed once complete, so a kill at
//! any moment leaves no folder or the whole one, and nothing beside it.

use std::path::{Path, PathBuf};

use super::{OptimizerState, SaveState};
use crate::error::{Error, IoContext, Result};
use crate::formats::{dcp, deepspeed};
use crate::ops::outcome::Outcome;
use crate::ops::request::{Merge, MergeOptions};
use crate::read::catalog::Checkpoint;
use crate::write::execute::{on_root, stage_folder};
use crate::write::stage::Stage;
use crate::write::WriteOptions;

/// Model `options.model` of a `save_state` folder, to be merged as its own format merges (DCP as
/// `accelerate merge-weights`, ZeRO as `zero_to_fp32`, a file as itself), and with
/// `options.optimizer` its optimizer beside it: refused before anything is written when the
/// folder has no such model, or the model no optimizer.
pub(super) fn merge<'a>(state: &'a SaveState, options: &MergeOptions) -> Result<Merge<'a>> {
    let n = options.model.unwrap_or(0);
    let Some(model) = state.model(n) else {
        let have: Vec<String> = state.models.iter().map(|m| m.index.to_string()).collect();
        return Err(Error::BadSaveState {
            path: state.root.clone(),
            rank: None,
            reason: format!(
                "has no model {n} (models: {})",
                if have.is_empty() { "none".into() } else { have.join(", ") }
            ),
        });
    };
    // A ZeRO model keeps its optimizer inside: its own merge writes the moments.
    let in_model = matches!(state.optimizer(n).map(|o| &o.state), Some(OptimizerState::InModel));
    let inner = MergeOptions { optimizer: options.optimizer && in_model, model: None, ..options.clone() };
    let optimizer = match (options.optimizer && !in_model, state.optimizer(n).map(|o| &o.state)) {
        (false, _) => None,
        (true, Some(OptimizerState::Own(ock))) => Some(&**ock),
        (true, _) => {
            return Err(Error::BadSaveState {
                path: state.root.clone(),
                rank: None,
                reason: format!("model {n} has no optimizer"),
            })
        }
    };
    Ok(Merge::Members { model: &model.checkpoint, options: inner, optimizer })
}

/// A whole `save_state` folder for `world` ranks, built in a staging folder of `out` and
/// committed when complete:
/// - DCP models and optimizers are resharded to FSDP2's layout for `world` ranks;
/// - a ZeRO model becomes DeepSpeed's universal checkpoint, under the tag accelerate loads
///   (`pytorch_model[_i]/`), with `latest` naming the last; in a `Trainer` folder under
///   DeepSpeed's own names (`<tag>_universal/` and `latest_universal`);
/// - files that do not depend on the world size are copied byte for byte;
/// - rank `r`'s RNG file is the source's rank `r mod N` (ranks past the old world repeat the
///   streams of the ranks they map to; accelerate's `step` is kept);
/// - a stateful dataloader's position moves by `dataload`'s N → M rule: the `N·k` batches all
///   ranks had read become `⌊N·k/M⌋` per rank, the remainder read again.
pub(super) fn reshard(state: &SaveState, out: &Path, world: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
    // A data position that cannot be read cannot be laid out for another world size; copying
    // it as it is would carry a refused pickle along.
    if let Some(e) = state.unreadable_positions(None).into_iter().next() {
        return Err(e);
    }
    // A new folder only: `Stage::folder` refuses an existing path (or link) before writing. Over
    // the ranks of a job, every plan is written by all of them and the file work between plans
    // (small files, the commit) by rank 0; a dry run only plans.
    let job = opts.job;
    let dry = job.is_some_and(crate::Job::is_dry_run);
    let stage: Option<Stage> = if dry { None } else { Some(stage_folder(job, out)?) };
    let tmp = stage.as_ref().map_or_else(|| out.to_path_buf(), |s| s.path().to_path_buf());
    let files = |f: &dyn Fn() -> Result<()>| if dry { Ok(()) } else { on_root(job, out, f) };
    let mut outcome = Outcome { world_size: Some(world), ..Outcome::default() };
    let mut done = reshard_models(state, &tmp, world, opts, &mut outcome)?;
    reshard_optimizers(state, &tmp, world, opts, &mut done.paths, &mut outcome)?;
    files(&|| copy_per_world(state, &tmp, world, &done))?;
    let Some(stage) = stage else { return Ok(outcome) };
    files(&|| stage.commit_ref())?;
    outcome.files = crate::read::io::files_under(out)?;
    Ok(outcome)
}

/// What resharding a `save_state` folder's models and optimizers did: the sources laid out
/// (not copied), the tag `latest` names, and whether a ZeRO model was resharded.
struct Resharded<'a> {
    paths: Vec<&'a Path>,
    last_tag: Option<String>,
    zero: bool,
}

/// `a`'s tensors and bytes added to `outcome`.
fn add_counts(a: Outcome, outcome: &mut Outcome) {
    outcome.tensors += a.tensors;
    outcome.bytes += a.bytes;
}

/// The folder's ZeRO models as universal checkpoints and its DCP models for `world` ranks,
/// each written into `tmp` under its final name.
fn reshard_models<'a>(
    state: &'a SaveState,
    tmp: &Path,
    world: u64,
    opts: &WriteOptions<'_>,
    outcome: &mut Outcome,
) -> Result<Resharded<'a>> {
    let mut done = Resharded { paths: Vec::new(), last_tag: None, zero: false };
    for m in &state.models {
        let name = m.path.file_name().map(PathBuf::from).unwrap_or_default();
        if let Some(universal) = deepspeed::universal_tag(&m.checkpoint) {
            let o = if state.trainer.is_some() {
                // The `Trainer` resumes from any `global_step*` folder, and DeepSpeed with
                // `load_universal` follows `latest_universal`: DeepSpeed's own names stay.
                let latest = tmp.join("latest_universal");
                deepspeed::write_universal(&m.checkpoint, &tmp.join(&universal), Some(&latest), world, opts)?
            } else {
                // accelerate's `load_state` loads the tag it saved, by name.
                let tag = name.to_string_lossy().into_owned();
                let o = deepspeed::write_universal(&m.checkpoint, &tmp.join(&tag), None, world, opts)?;
                done.last_tag = Some(tag);
                o
            };
            done.zero = true;
            add_counts(o, outcome);
        } else if is_dcp(&m.checkpoint) {
            add_counts(dcp::write(&m.checkpoint, &tmp.join(&name), world, opts)?, outcome);
        } else {
            continue;
        }
        done.paths.push(&m.path);
    }
    Ok(done)
}

/// Whether a member was read as a DCP folder (which `reshard` lays out for `world` ranks).
fn is_dcp(ck: &Checkpoint) -> bool {
    ck.detail::<dcp::DcpSource>().is_some()
}

/// The folder's DCP optimizers for `world` ranks, into `tmp`; each source goes into `done`.
fn reshard_optimizers<'a>(
    state: &'a SaveState,
    tmp: &Path,
    world: u64,
    opts: &WriteOptions<'_>,
    done: &mut Vec<&'a Path>,
    outcome: &mut Outcome,
) -> Result<()> {
    for o in &state.optimizers {
        if let OptimizerState::Own(ock) = &o.state {
            if is_dcp(ock) {
                let name = o.path.file_name().map(PathBuf::from).unwrap_or_default();
                add_counts(dcp::write(ock, &tmp.join(&name), world, opts)?, outcome);
                done.push(&o.path);
            }
        }
    }
    Ok(())
}

/// The per-rank files for `world` ranks (RNG files, dataloader positions) and a copy of
/// everything else at the top of the folder that `done` did not lay out, into `tmp`; then
/// `latest`, where a ZeRO model was resharded under accelerate's tag.
fn copy_per_world(state: &SaveState, tmp: &Path, world: u64, done: &Resharded<'_>) -> Result<()> {
    let mut skip = done.paths.clone();
    skip.extend(state.rng.iter().map(|r| r.path.as_path()));
    skip.extend(
        state
            .data
            .iter()
            .filter(|(_, pos)| pos.as_ref().is_some_and(|p| p.kind == "dl_state_dict"))
            .map(|(c, _)| c.path.as_path()),
    );
    let deepspeed_root: Vec<PathBuf> = match done.zero {
        true => ["latest", "latest_universal", "zero_to_fp32.py"].iter().map(|f| state.root.join(f)).collect(),
        false => Vec::new(),
    };
    // Rank r of the new world continues rank r mod N's generators.
    let n = state.rng.len() as u64;
    for r in (0..world).filter(|_| n > 0) {
        let src = &state.rng[(r % n) as usize].path;
        crate::write::copy_durable(src, &tmp.join(state.rng_name(r, world)))?;
    }
    for (c, pos) in &state.data {
        if pos.as_ref().is_some_and(|p| p.kind == "dl_state_dict") {
            let name = c.path.file_name().map(PathBuf::from).unwrap_or_default();
            super::write_loader_state(&c.path, &tmp.join(name), state.world_size, world)?;
        }
    }
    // Everything else at the top of the folder is independent of the world size.
    for entry in std::fs::read_dir(&state.root).at(&state.root)? {
        let path = entry.at(&state.root)?.path();
        if skip.contains(&path.as_path()) || deepspeed_root.contains(&path) {
            continue;
        }
        if path.is_dir() {
            return Err(Error::BadSaveState {
                path,
                rank: None,
                reason: "a folder this reshard does not know how to lay out for another world size".into(),
            });
        }
        let name = path.file_name().map(PathBuf::from).unwrap_or_default();
        crate::write::copy_durable(&path, &tmp.join(name))?;
    }
    if let Some(tag) = &done.last_tag {
        crate::write::write_small(&tmp.join("latest"), tag.as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn copy_tree(src: &Path, dst: &Path) {
        std::fs::create_dir_all(dst).unwrap();
        for e in std::fs::read_dir(src).unwrap() {
            let e = e.unwrap();
            match e.file_type().unwrap().is_dir() {
                true => copy_tree(&e.path(), &dst.join(e.file_name())),
                false => drop(std::fs::copy(e.path(), dst.join(e.file_name())).unwrap()),
            }
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn a_reshard_that_fails_after_its_models_were_written_leaves_nothing_beside_its_destination() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/accelerate/ds_two_models_w2");
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        copy_tree(&fixture, &src);
        let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
        // A folder the reshard cannot lay out, found only after both ZeRO models were written as
        // universal checkpoints into the staging folder.
        std::fs::create_dir(src.join("notes")).unwrap();
        let out = tmp.path().join("w3");
        let err = crate::reshard(&ck, &out, 3, &WriteOptions::default()).unwrap_err();
        assert!(matches!(&err, Error::BadSaveState { path, .. } if path.ends_with("notes")), "{err:?}");
        assert_eq!(names(tmp.path()), ["src"], "no output, no staging folder, no scratch");

        std::fs::remove_dir(src.join("notes")).unwrap();
        crate::reshard(&ck, &out, 3, &WriteOptions::default()).unwrap();
        assert_eq!(names(tmp.path()), ["src", "w3"]);
        let mut want = vec!["latest", "pytorch_model", "pytorch_model_1"];
        want.extend(["random_states_0.pkl", "random_states_1.pkl", "random_states_2.pkl"]);
        assert_eq!(names(&out), want, "each universal checkpoint under its tag, nothing else");
        assert_eq!(names(&out.join("pytorch_model")), ["mp_rank_00_model_states.pt", "zero"]);
    }
}
