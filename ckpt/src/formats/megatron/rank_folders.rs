//! A legacy save's rank folders and what their names mean.
//!
//! Megatron-LM names each model-parallel rank's folder `mp_rank_TT`, then appends `_PPP` when the
//! run has pipeline parallelism and `_EEE` when it has expert parallelism
//! (`get_checkpoint_name` in `megatron/training/checkpointing.py`). So `mp_rank_00_001` is
//! pipeline stage 1 of a run with pipeline parallelism, but expert rank 1 of a run with expert
//! parallelism and none of the former: the name alone does not say, the saved `args`
//! (`pipeline_model_parallel_size`, `expert_model_parallel_size`) do. A save without `args`
//! reads a second number as the stage, the older and more common layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

use super::legacy::RANK_FILE;

/// The numbers of a rank folder's name: `mp_rank_TT`, `mp_rank_TT_NNN`, `mp_rank_TT_PPP_EEE`.
pub(crate) fn ranks_of(name: &str) -> Option<(u64, Option<u64>, Option<u64>)> {
    let rest = name.strip_prefix("mp_rank_")?;
    let mut parts = rest.split('_').map(|p| p.parse::<u64>().ok().filter(|_| p.bytes().all(|b| b.is_ascii_digit())));
    let tp = parts.next()??;
    let second = parts.next().map(|p| p.ok_or(())).transpose().ok()?;
    let third = parts.next().map(|p| p.ok_or(())).transpose().ok()?;
    parts.next().is_none().then_some((tp, second, third))
}

/// Which ranks a folder's name carries after the tensor-parallel one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Axes {
    pub pipeline: bool,
    pub expert: bool,
}

impl Axes {
    /// The name of the folder of tensor rank `tp`, stage `pp` and expert rank `ep`, as megatron's
    /// `get_checkpoint_name` writes it: `mp_rank_TT`, then `_PPP` and `_EEE` where these axes
    /// are carried.
    pub(crate) fn folder(self, tp: u64, pp: u64, ep: u64) -> String {
        let mut name = format!("mp_rank_{tp:02}");
        if self.pipeline {
            name += &format!("_{pp:03}");
        }
        if self.expert {
            name += &format!("_{ep:03}");
        }
        name
    }

    /// What a name of `numbers` ranks carries when no `args` say: a stage, then an expert rank.
    fn by_count(numbers: usize) -> Axes {
        Axes { pipeline: numbers >= 2, expert: numbers >= 3 }
    }

    fn count(self) -> usize {
        1 + usize::from(self.pipeline) + usize::from(self.expert)
    }

    fn spelled(self) -> &'static str {
        match (self.pipeline, self.expert) {
            (false, false) => "`mp_rank_TT`",
            (true, false) => "`mp_rank_TT_PPP`",
            (false, true) => "`mp_rank_TT_EEE`",
            (true, true) => "`mp_rank_TT_PPP_EEE`",
        }
    }
}

/// One model-parallel rank's place and file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Rank {
    pub tp: u64,
    pub pp: u64,
    pub ep: u64,
    pub file: PathBuf,
}

/// The run's parallel sizes as its `args` give them, to check the folders against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sizes {
    pub pipeline: Option<u64>,
    pub expert: Option<u64>,
}

impl Sizes {
    /// The axes megatron's names carry for these sizes; `None` when the args do not say.
    pub(crate) fn axes(self) -> Option<Axes> {
        Some(Axes { pipeline: self.pipeline? > 1, expert: self.expert.unwrap_or(1) > 1 })
    }
}

/// The rank files of the folders `names` of `dir`, by pipeline stage, expert rank, then
/// tensor-parallel rank, each file the one its folder names, checked to form a whole grid
/// before anything is read (the caller looks for the files). `sizes` are the saved `args`'
/// parallel sizes, which decide what a name's numbers are. The ranks in the names are inputs:
/// none sizes a loop or an allocation before it is checked against the number of folders (a
/// name claiming rank 2^64 - 1 once overflowed the grid's size).
pub(crate) fn rank_grid(dir: &Path, names: &[String], sizes: Sizes) -> Result<Vec<Rank>> {
    let bad = |path: PathBuf, rank: Option<u64>, reason: String| Error::BadMegatron { path, key: None, rank, reason };
    let mut parsed: Vec<(&str, Vec<u64>)> = Vec::new();
    for name in names {
        let Some((tp, a, b)) = ranks_of(name) else { continue };
        parsed.push((name, [Some(tp), a, b].into_iter().flatten().collect()));
    }
    let axes = match sizes.axes() {
        Some(axes) => axes,
        None => {
            let counts: Vec<usize> = parsed.iter().map(|p| p.1.len()).collect();
            if counts.iter().any(|&c| c != counts[0]) {
                return Err(bad(
                    dir.to_path_buf(),
                    None,
                    "some rank folders name a pipeline stage and others do not".into(),
                ));
            }
            Axes::by_count(counts.first().copied().unwrap_or(1))
        }
    };
    let mut found: BTreeMap<(u64, u64, u64), &str> = BTreeMap::new();
    for (name, numbers) in &parsed {
        let tp = numbers[0];
        let path = dir.join(name).join(RANK_FILE);
        if numbers.len() != axes.count() {
            return Err(bad(
                path,
                Some(tp),
                format!(
                    "the saved args (pipeline parallel {}, expert parallel {}) name rank folders {}, not `{}`",
                    sizes.pipeline.unwrap_or(1),
                    sizes.expert.unwrap_or(1),
                    axes.spelled(),
                    name.escape_debug()
                ),
            ));
        }
        let mut rest = numbers[1..].iter().copied();
        let pp = if axes.pipeline { rest.next().unwrap_or(0) } else { 0 };
        let ep = if axes.expert { rest.next().unwrap_or(0) } else { 0 };
        for (what, rank, size, arg) in [
            ("pipeline stage", pp, sizes.pipeline, "pipeline_model_parallel_size"),
            ("expert rank", ep, sizes.expert, "expert_model_parallel_size"),
        ] {
            if let Some(size) = size.filter(|&s| rank >= s) {
                return Err(bad(
                    path,
                    Some(tp),
                    format!("the folder's name gives {what} {rank}, but `args.{arg}` is {size}"),
                ));
            }
        }
        // `mp_rank_1` and `mp_rank_01` name the same rank: which one megatron wrote is not ours
        // to guess.
        if let Some(first) = found.insert((pp, ep, tp), name) {
            let (a, b) = if first < *name { (first, *name) } else { (*name, first) };
            return Err(bad(
                dir.to_path_buf(),
                Some(tp),
                format!("the rank folders `{}` and `{}` name the same rank", a.escape_debug(), b.escape_debug()),
            ));
        }
    }
    if found.is_empty() {
        return Err(Error::NotACheckpoint { path: dir.to_path_buf() });
    }
    // A whole grid of `n` folders numbers its ranks below `n`: a name past that cannot be part
    // of one, and is refused before it sizes anything.
    let n = found.len() as u64;
    if let Some((&(pp, ep, tp), name)) = found.iter().find(|(&(pp, ep, tp), _)| pp >= n || ep >= n || tp >= n) {
        let what = if tp >= n {
            format!("tensor-parallel rank {tp}")
        } else if pp >= n {
            format!("pipeline stage {pp}")
        } else {
            format!("expert rank {ep}")
        };
        return Err(bad(
            dir.join(name),
            Some(tp),
            format!("the folder's name gives {what}, but the iteration holds {n} rank folders"),
        ));
    }
    let tp = found.keys().map(|k| k.2).max().unwrap_or(0) + 1;
    let pp = found.keys().map(|k| k.0).max().unwrap_or(0) + 1;
    let ep = found.keys().map(|k| k.1).max().unwrap_or(0) + 1;
    if tp.checked_mul(pp).and_then(|g| g.checked_mul(ep)) != Some(n) {
        // The first rank missing in grid order: within `n + 1` steps, each step before it a
        // folder that is there.
        let (pp_m, ep_m, tp_m) = (0..pp)
            .flat_map(|s| (0..ep).flat_map(move |e| (0..tp).map(move |t| (s, e, t))))
            .find(|k| !found.contains_key(k))
            .unwrap_or((0, 0, 0));
        let path = dir.join(axes.folder(tp_m, pp_m, ep_m)).join(RANK_FILE);
        if ep > 1 {
            return Err(bad(
                path,
                Some(tp_m),
                format!(
                    "missing: the save has {tp} tensor-parallel × {pp} pipeline × {ep} expert ranks, but this \
                     rank's file is not there"
                ),
            ));
        }
        return Err(Error::MissingMegatronRank { path, rank: tp_m, tp, pp });
    }
    Ok(found
        .into_iter()
        .map(|((pp, ep, tp), name)| Rank { tp, pp, ep, file: dir.join(name).join(RANK_FILE) })
        .collect())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn grid(names: &[&str], sizes: Sizes) -> Vec<(u64, u64, u64, String)> {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let grid = rank_grid(Path::new("it"), &names, sizes).unwrap();
        let folder = |r: &Rank| r.file.parent().unwrap().file_name().unwrap().to_string_lossy().into_owned();
        grid.iter().map(|r| (r.tp, r.pp, r.ep, folder(r))).collect()
    }

    #[test]
    fn rank_folders_name_their_ranks() {
        assert_eq!(ranks_of("mp_rank_00"), Some((0, None, None)));
        assert_eq!(ranks_of("mp_rank_01_002"), Some((1, Some(2), None)));
        assert_eq!(ranks_of("mp_rank_01_002_003"), Some((1, Some(2), Some(3))));
        assert_eq!(ranks_of("mp_rank_x"), None);
        assert_eq!(ranks_of("mp_rank_"), None);
        assert_eq!(ranks_of("mp_rank_1_2_3_4"), None);
    }

    #[test]
    fn a_second_number_is_the_expert_rank_when_the_args_say_no_pipeline() {
        let ep2 = Sizes { pipeline: Some(1), expert: Some(2) };
        assert_eq!(
            grid(&["mp_rank_00_001", "mp_rank_00_000"], ep2),
            [(0, 0, 0, "mp_rank_00_000".into()), (0, 0, 1, "mp_rank_00_001".into())]
        );
        let pp2 = Sizes { pipeline: Some(2), expert: Some(1) };
        assert_eq!(
            grid(&["mp_rank_00_001", "mp_rank_00_000"], pp2),
            [(0, 0, 0, "mp_rank_00_000".into()), (0, 1, 0, "mp_rank_00_001".into())]
        );
        // Without args, as before: the stage.
        assert_eq!(
            grid(&["mp_rank_00_001", "mp_rank_00_000"], Sizes::default())[1],
            (0, 1, 0, "mp_rank_00_001".into())
        );
        let both = Sizes { pipeline: Some(2), expert: Some(2) };
        let g = grid(&["mp_rank_00_001_001", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_000_000"], both);
        assert_eq!(g.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(), [(0, 0), (0, 1), (1, 0), (1, 1)]);
    }

    #[test]
    fn names_past_the_folders_or_the_args_are_refused_before_they_size_anything() {
        let refused = |names: &[&str], sizes: Sizes| {
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            rank_grid(Path::new("it"), &names, sizes).unwrap_err().to_string()
        };
        let ep2 = Sizes { pipeline: Some(1), expert: Some(2) };
        assert_eq!(
            refused(&["mp_rank_00_000", "mp_rank_00_18446744073709551615"], ep2),
            "it/mp_rank_00_18446744073709551615/model_optim_rng.pt (rank 0): the folder's name gives expert rank \
             18446744073709551615, but `args.expert_model_parallel_size` is 2"
        );
        assert_eq!(
            refused(&["mp_rank_00_000_000", "mp_rank_00_000_5"], Sizes::default()),
            "it/mp_rank_00_000_5 (rank 0): the folder's name gives expert rank 5, but the iteration holds 2 rank folders"
        );
        assert_eq!(
            refused(&["mp_rank_00", "mp_rank_00_001"], Sizes::default()),
            "it: some rank folders name a pipeline stage and others do not"
        );
        assert!(refused(&[], ep2).starts_with("it: no checkpoint found"));
    }
}
