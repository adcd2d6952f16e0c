//! Entry points for the fuzz targets (`ckpt/fuzz`) of what a Megatron save holds besides its
//! tensors: the tracker, `metadata.json`, the rank folders' names and the saved state (the
//! `common_state` pickle and the `args` in it). Each parser runs on arbitrary bytes as the
//! reader runs it; none may panic, and a refusal is one line: whatever the input held, its
//! message has no control character.

use std::path::Path;

use super::rank_folders::{self, Sizes};
use super::{info, legacy};
use crate::formats::torch::flatten;
use crate::formats::torch::pickle::{self, Load};
use crate::read::value::Leaf;
use crate::AllowGlobals;

/// A refusal printed as the reader prints it: one line, the input's text escaped in it.
fn one_line(e: &crate::Error) {
    let text = e.to_string();
    assert!(!text.chars().any(char::is_control), "a message that is not one clean line: {text:?}");
}

/// `latest_checkpointed_iteration.txt`: an iteration number or `release`. What it names is
/// the folder the reader then opens, so it must be a plain name.
pub(crate) fn tracker(data: &[u8]) {
    match super::parse_tracker(data, Path::new("fuzz/latest_checkpointed_iteration.txt")) {
        Ok(t) => {
            let expected = t.iteration.map_or_else(|| "release".to_string(), |i| format!("iter_{i:07}"));
            assert_eq!(t.folder, expected);
            assert_eq!(super::iteration_of(&t.folder), t.iteration);
        }
        Err(e) => one_line(&e),
    }
}

/// `metadata.json`: JSON whose `sharded_backend` says whether the folder is a `torch_dist` one.
pub(crate) fn config(data: &[u8]) {
    if let Err(e) = super::parse_config(data, Path::new("fuzz/metadata.json")) {
        one_line(&e);
    }
}

/// The names in an iteration folder (one per line, as `read_dir` gives them): the rank
/// folders among them, checked to form a whole grid of ranks. Accepted, the grid holds each
/// folder once, in stage then rank order, each at the place its name gives.
pub(crate) fn rank_folders(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let names: Vec<String> = text.split('\n').map(str::to_string).collect();
    for name in &names {
        let _ = super::iteration_of(name);
        let _ = legacy::local_layer(name);
    }
    // Without `args`, as the names alone say; then as a run with expert parallelism only would.
    let sizes = [Sizes::default(), Sizes { pipeline: Some(1), expert: Some(2) }];
    for sizes in sizes {
        match rank_folders::rank_grid(Path::new("fuzz/iter_0000001"), &names, sizes) {
            Ok(grid) => {
                let last = grid.last().map(|r| (r.tp + 1, r.pp + 1, r.ep + 1)).unwrap_or_default();
                assert_eq!(grid.len() as u64, last.0 * last.1 * last.2, "the grid of {last:?} ranks is not whole");
                for (i, r) in grid.iter().enumerate() {
                    let i = i as u64;
                    assert_eq!((i % last.0, i / last.0 % last.2, i / (last.0 * last.2)), (r.tp, r.ep, r.pp));
                    let folder = r.file.parent().and_then(Path::file_name).and_then(|n| n.to_str());
                    let ranks = folder.and_then(rank_folders::ranks_of);
                    assert_eq!(ranks.map(|(t, _, _)| t), Some(r.tp), "{r:?}");
                }
            }
            Err(e) => one_line(&e),
        }
    }
}

/// A saved state's pickle, read both ways megatron saves one: as a `torch_dist` checkpoint's
/// `common_state` item (the save's classes admitted as records, tensors described in the
/// value), and as a legacy rank file's (the same classes as the allow-list, tensors flattened
/// out of the values). Then what the reader takes from it: the summary of the saved `args`,
/// the iteration, the optimizer's form, the grad buckets' size.
pub(crate) fn saved_state(data: &[u8]) {
    if let Ok(p) = pickle::load(data, Load::default().classes(super::SAVE_GLOBALS)) {
        if let Ok(value) = flatten::leaf_of_describing_tensors(&p) {
            let _ = flatten::flatten(&p);
            let m = info::from_saved(Some(info::saved_dict(&value)));
            let _ = serde_json::to_string(&m).expect("the summary renders");
        }
    }
    let Ok(allow) = AllowGlobals::new(super::SAVE_GLOBALS.iter().copied()) else { return };
    let Ok(p) = pickle::load(data, Load::default().allowing(&allow)) else { return };
    let Ok(flat) = flatten::flatten(&p) else { return };
    let value = |key: &str| flat.leaves.iter().find(|(k, _)| k == key).map(|(_, v)| v);
    let args: Option<&Leaf> = value("args");
    let m = info::from_args("legacy", args);
    let _ = (m, info::uint(value("iteration")), legacy::bucket_size(args));
}

/// A Megatron summary as a catalog's detail, for the JSON documents' target: the form of the
/// optimizer is text the checkpoint gave.
pub(crate) fn summary(optimizer: Option<String>) -> crate::read::catalog::Detail {
    let meta = super::MegatronInfo { layout: "torch_dist", optimizer, ..Default::default() };
    std::sync::Arc::new(info::Megatron { meta, dcp: None, legacy: None })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::path::PathBuf;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/megatron")
    }

    /// Every file named `name` under the Megatron fixtures.
    fn found(name: &str) -> Vec<PathBuf> {
        fn walk(dir: &Path, name: &str, out: &mut Vec<PathBuf>) {
            for e in std::fs::read_dir(dir).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, name, out);
                } else if p.file_name().is_some_and(|n| n == name) {
                    out.push(p);
                }
            }
        }
        let mut out = Vec::new();
        walk(&fixtures(), name, &mut out);
        out.sort();
        out
    }

    /// What the fuzz targets check, here on every `cargo test`: each fixture's tracker and
    /// `metadata.json`, whole, cut at every byte and with every byte edited.
    #[test]
    fn trackers_and_configs_of_the_fixtures_read_or_refuse_in_one_line() {
        let trackers = found("latest_checkpointed_iteration.txt");
        let configs = found("metadata.json");
        assert!(!trackers.is_empty() && !configs.is_empty());
        for (files, run) in [(trackers, tracker as fn(&[u8])), (configs, config)] {
            for f in files {
                let data = std::fs::read(&f).unwrap();
                run(&data);
                for at in 0..data.len() {
                    run(&data[..at]);
                    let mut edited = data.clone();
                    edited[at] = if at % 2 == 0 { b'\x1b' } else { data[at] ^ 0x5a };
                    run(&edited);
                }
            }
        }
    }

    /// Each legacy rank file's saved state (`args` and all), and the same cut short: read and
    /// summarized, or refused, never a panic.
    #[test]
    fn saved_states_of_the_legacy_fixtures_read_or_refuse() {
        let files = found(legacy::RANK_FILE);
        assert!(!files.is_empty());
        for f in files {
            let data = std::fs::read(&f).unwrap();
            let archive = crate::formats::torch::zip::Archive::open(&data[..], data.len() as u64, &f).unwrap();
            let pkl = archive.entries.iter().find(|e| e.name.ends_with("/data.pkl")).unwrap();
            let pkl = archive.read_entry(&data[..], pkl, 1 << 20).unwrap();
            saved_state(&pkl);
            for at in (0..pkl.len()).step_by(4099) {
                saved_state(&pkl[..at]);
            }
        }
    }
}
