//! `ckpt data`: plan and explain rank-sharded data loading (the `dataload` crate).
//!
//! JSON output of `ckpt data plan --json`:
//! `{"ranks": [{"rank": r, "batches": [[i, ...], ...]}, ...]}`.
//!
//! `ckpt data state --from-accelerate DIR --len N --batch-size B --json` prints the
//! `LoaderState` itself (see `dataload::LoaderState`).
//!
//! JSON output of `ckpt data state FILE --json` (and of `--mixture MIX.json --cursor K`),
//! `dataload::StateReport`:
//! `{"epoch", "cursor", "dataset_len", "world_size", "global_batch_size", "steps_done",
//!   "steps_left", "mode", "sampler", "ranks": [{"rank", "next_batch": [...] | null,
//!   "batches_left", "next_samples": [[source, index], ...] (mixtures only)}],
//!   "mixture": {"sources", "block", "positions": [...]} (mixtures only)}`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};
use dataload::{DataLoaderConfiguration, LoaderState, ShardedSampler};
use serde::Serialize;

/// `ckpt data …`
#[derive(Subcommand, Debug, Clone)]
pub enum DataCommand {
    /// Print the batches each rank gets (accelerate's sharding, exactly).
    Plan(PlanArgs),
    /// Explain a saved loader state: epoch, position, what each rank reads next.
    State(StateArgs),
}

/// The loader a plan or a state is about: the dataset, the batch sampler and accelerate's
/// configuration.
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct LoaderArgs {
    /// Number of samples in the dataset (required).
    #[arg(long = "len", value_name = "N")]
    pub len: Option<u64>,
    /// Batch size of the underlying batch sampler, as given to torch's `DataLoader` (required).
    #[arg(long, value_name = "B")]
    pub batch_size: Option<u64>,
    /// accelerate's `split_batches`.
    #[arg(long)]
    pub split_batches: bool,
    /// accelerate's `even_batches = false`.
    #[arg(long)]
    pub no_even_batches: bool,
    /// torch `DataLoader`'s `drop_last`.
    #[arg(long)]
    pub drop_last: bool,
    /// accelerate's `dispatch_batches = true` (rank 0 reads and broadcasts).
    #[arg(long)]
    pub dispatch_batches: bool,
    /// Shuffle with accelerate's `SeedableRandomSampler` (needs `--seed`, unless a saved
    /// `sampler.bin` gives it).
    #[arg(long)]
    pub shuffle: bool,
    /// `data_seed` (any Python int torch accepts, negatives included).
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub seed: Option<i128>,
}

impl LoaderArgs {
    /// The flags given, as the command line spells them: a state FILE holds its own loader, so
    /// any of them beside one would be ignored, and is refused instead.
    fn given(&self) -> Vec<&'static str> {
        let flags = [
            (self.len.is_some(), "--len"),
            (self.batch_size.is_some(), "--batch-size"),
            (self.split_batches, "--split-batches"),
            (self.no_even_batches, "--no-even-batches"),
            (self.drop_last, "--drop-last"),
            (self.dispatch_batches, "--dispatch-batches"),
            (self.shuffle, "--shuffle"),
            (self.seed.is_some(), "--seed"),
        ];
        flags.into_iter().filter(|(given, _)| *given).map(|(_, flag)| flag).collect()
    }

    fn loader(&self, world_size: u64, rank: u64) -> anyhow::Result<ShardedSampler> {
        Ok(self.builder(world_size, rank)?.build()?)
    }

    fn builder(&self, world_size: u64, rank: u64) -> anyhow::Result<dataload::ShardedSamplerBuilder> {
        let (Some(len), Some(batch_size)) = (self.len, self.batch_size) else {
            anyhow::bail!("the loader needs `--len N` and `--batch-size B`");
        };
        if self.shuffle != self.seed.is_some() {
            anyhow::bail!("`--shuffle` and `--seed S` go together");
        }
        let config = DataLoaderConfiguration {
            split_batches: self.split_batches,
            even_batches: !self.no_even_batches,
            dispatch_batches: Some(self.dispatch_batches),
            use_seedable_sampler: self.shuffle,
            data_seed: self.seed,
            ..DataLoaderConfiguration::default()
        };
        Ok(ShardedSampler::builder()
            .dataset_len(len)
            .batch_size(batch_size)
            .world_size(world_size)
            .rank(rank)
            .drop_last(self.drop_last)
            .shuffle(self.shuffle)
            .config(config))
    }
}

/// Arguments of `ckpt data plan`.
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct PlanArgs {
    #[command(flatten)]
    pub loader: LoaderArgs,
    /// Number of ranks.
    #[arg(long, value_name = "W", value_parser = clap::value_parser!(u64).range(1..=dataload::MAX_WORLD_SIZE))]
    pub world_size: u64,
    /// Only this rank (default: all).
    #[arg(long, value_name = "R")]
    pub rank: Option<u64>,
    /// Epoch to plan.
    #[arg(long, value_name = "E", default_value_t = 0)]
    pub epoch: u64,
    /// accelerate's `skip_first_batches(K)`, applied on every rank.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub skip_batches: u64,
    #[command(flatten)]
    pub json: crate::args::JsonArg,
}

/// Arguments of `ckpt data state`.
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct StateArgs {
    /// A loader state written by `ShardedSampler::state_dict` (JSON).
    #[arg(required_unless_present_any = ["from_accelerate", "from_trainer", "mixture"], conflicts_with_all = ["from_accelerate", "from_trainer", "mixture"])]
    pub file: Option<PathBuf>,
    /// Instead, a mixture's definition (JSON: `sizes`, `weights`, `seed`, `once`, `length`,
    /// `changes`), read in order by the loader of the flags below, at `--cursor`.
    #[arg(long, value_name = "MIX.json", conflicts_with_all = ["from_accelerate", "from_trainer"])]
    pub mixture: Option<PathBuf>,
    /// With `--mixture`: the position in the mixture's order (samples all ranks have read).
    #[arg(long, value_name = "K", default_value_t = 0, requires = "mixture")]
    pub cursor: u64,
    /// With `--mixture`: the number of ranks reading it.
    #[arg(long, value_name = "W", default_value_t = 1, requires = "mixture", value_parser = clap::value_parser!(u64).range(1..=dataload::MAX_WORLD_SIZE))]
    pub world_size: u64,
    /// Instead, the position an accelerate `save_state` folder saved (`dl_state_dict.bin`,
    /// `sampler.bin`), as our loader state for the loader described by the flags below; with
    /// `--json` the `LoaderState` itself, which `ShardedSampler::load_state_dict` continues from
    /// at the same next sample, on any world size.
    #[arg(long, value_name = "DIR", conflicts_with = "from_trainer")]
    pub from_accelerate: Option<PathBuf>,
    /// Instead, where a transformers `Trainer` resuming from its `checkpoint-N/` folder continues:
    /// `global_step` from `trainer_state.json`, as whole steps of `--gradient-accumulation-steps`
    /// batches into the epoch, for the loader described by the flags below.
    #[arg(long, value_name = "DIR")]
    pub from_trainer: Option<PathBuf>,
    /// With `--from-trainer`: the run's `gradient_accumulation_steps` (its `training_args.bin`
    /// holds it, and is never read).
    #[arg(long, value_name = "K", default_value_t = 1, requires = "from_trainer")]
    pub gradient_accumulation_steps: u64,
    /// The described loader (with `--from-accelerate`).
    #[command(flatten)]
    pub loader: LoaderArgs,
    /// With `--from-accelerate`: which prepared dataloader (0 is `dl_state_dict.bin`).
    #[arg(long, value_name = "I", default_value_t = 0, requires = "from_accelerate")]
    pub dataloader: usize,
    /// With `--from-accelerate`, where the folder saved no position (a map-style loader
    /// without `use_stateful_dataloader`): the batches each rank had read in the epoch, which
    /// accelerate's own resume recipe passes to `skip_first_batches`.
    #[arg(long, value_name = "K", requires = "from_accelerate")]
    pub step: Option<u64>,
    /// With `--from-accelerate`: the epoch, where `sampler.bin` does not say.
    #[arg(long, value_name = "E", requires = "from_accelerate")]
    pub epoch: Option<u64>,
    #[command(flatten)]
    pub json: crate::args::JsonArg,
}

/// Runs a `ckpt data` subcommand.
pub fn run(cmd: DataCommand) -> anyhow::Result<ExitCode> {
    let text = match cmd {
        DataCommand::Plan(args) => plan(&args)?,
        DataCommand::State(args) => state(&args)?,
    };
    // An `io::Error` (a closed pipe included) goes back to main, which decides the exit code.
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

#[derive(Serialize, Debug, PartialEq, Eq)]
struct RankBatches {
    rank: u64,
    batches: Vec<Vec<u64>>,
}

#[derive(Serialize, Debug)]
struct PlanOut {
    ranks: Vec<RankBatches>,
}

impl PlanArgs {
    /// The batches of every requested rank.
    fn compute(&self) -> anyhow::Result<Vec<RankBatches>> {
        let ranks: Vec<u64> = match self.rank {
            Some(r) => vec![r],
            None => (0..self.world_size).collect(),
        };
        ranks
            .into_iter()
            .map(|rank| {
                let mut l = self.loader.loader(self.world_size, rank)?;
                l.set_epoch(self.epoch);
                l.skip_first_batches(self.skip_batches);
                Ok(RankBatches { rank, batches: l.rest_of_epoch()? })
            })
            .collect()
    }
}

fn list(b: &[u64]) -> String {
    let items: Vec<String> = b.iter().map(u64::to_string).collect();
    format!("[{}]", items.join(", "))
}

fn plan(args: &PlanArgs) -> anyhow::Result<String> {
    let ranks = args.compute()?;
    if args.json.json {
        return Ok(serde_json::to_string(&PlanOut { ranks })? + "\n");
    }
    let mut out = String::new();
    for r in &ranks {
        out += &format!("rank {}: {} batches\n", r.rank, r.batches.len());
        for b in &r.batches {
            out += &format!("  {}\n", list(b));
        }
    }
    Ok(out)
}

fn state(args: &StateArgs) -> anyhow::Result<String> {
    let st = match (&args.file, &args.from_accelerate, &args.loader) {
        (Some(_), _, l) if !l.given().is_empty() => {
            let flags: Vec<String> = l.given().iter().map(|f| format!("`{f}`")).collect();
            anyhow::bail!(
                "{} describe the loader of `--from-accelerate`, `--from-trainer` or `--mixture`; a state FILE holds its own",
                flags.join(", ")
            )
        }
        (Some(file), _, _) => {
            let text = read_user_file(file, MAX_STATE_LEN)?;
            LoaderState::from_json(&text).with_context(|| format!("`{}` is not a loader state", file.display()))?
        }
        (None, Some(dir), loader) => {
            let st = from_accelerate(dir, loader, args)?;
            if args.json.json {
                return Ok(st.to_json()? + "\n");
            }
            st
        }
        (None, None, loader) if args.mixture.is_some() => at_mixture(args.mixture.as_deref(), loader, args)?,
        (None, None, loader) if args.from_trainer.is_some() => {
            let st = from_trainer(args.from_trainer.as_deref().unwrap_or(std::path::Path::new(".")), loader, args)?;
            if args.json.json {
                return Ok(st.to_json()? + "\n");
            }
            st
        }
        (None, None, _) => anyhow::bail!(
            "give a state FILE, `--from-accelerate DIR` or `--from-trainer DIR`, with `--len N --batch-size B`"
        ),
    };
    // The document and the text are dataload's own, one rendering for every caller.
    let report = dataload::StateReport::new(&st)?;
    if args.json.json {
        return Ok(serde_json::to_string_pretty(&report)? + "\n");
    }
    Ok(report.to_string())
}

/// The most a loader state or a mixture definition the command line names may hold: both are
/// small JSON documents (a mixture of a million sources is a few tens of megabytes), and a
/// larger file, or a device or a FIFO given by mistake, is refused before it is read.
const MAX_STATE_LEN: u64 = 64 << 20;

/// The whole of the user's file `path` as text, read by the library's capped reader (only a
/// regular file, at most `max` bytes; each error names the file).
fn read_user_file(path: &std::path::Path, max: u64) -> anyhow::Result<String> {
    let bytes = ckpt::read_small_file(path, max)?;
    String::from_utf8(bytes).with_context(|| format!("`{}` is not UTF-8 text", path.display()))
}

/// The state of the loader of `loader` reading the mixture of `file` in order on
/// `--world-size` ranks, at `--cursor`.
fn at_mixture(file: Option<&std::path::Path>, loader: &LoaderArgs, args: &StateArgs) -> anyhow::Result<LoaderState> {
    let file = file.unwrap_or(std::path::Path::new("."));
    let text = read_user_file(file, MAX_STATE_LEN)?;
    let spec: dataload::MixtureSpec =
        serde_json::from_str(&text).with_context(|| format!("`{}` is not a mixture definition", file.display()))?;
    let len = dataload::Mixture::new(spec.clone())?.len();
    if loader.shuffle {
        anyhow::bail!("a mixture is read in its own order: `--shuffle` does not apply");
    }
    if args.cursor > len {
        anyhow::bail!("`--cursor {}` is past the end of the mixture ({len} samples)", args.cursor);
    }
    let loader = LoaderArgs { len: Some(loader.len.unwrap_or(len)), ..loader.clone() };
    let sampler = loader.builder(args.world_size, 0)?.mixture(spec).build()?;
    let mut st = sampler.state_dict();
    st.cursor = args.cursor;
    Ok(st)
}

/// Our loader state at the position an accelerate `save_state` folder recorded: `k` batches
/// read by every rank in the epoch (a stateful dataloader's `_num_yielded`, or `--step K`), in
/// the epoch a pickled `SeedableRandomSampler` names (or `--epoch`), with its seed.
fn from_accelerate(dir: &std::path::Path, loader: &LoaderArgs, args: &StateArgs) -> anyhow::Result<LoaderState> {
    let ck = ckpt::Checkpoint::open(&dir.to_string_lossy())?;
    let Some(saved) = ck.save_state() else {
        anyhow::bail!("{}: not an accelerate `save_state` folder (it is {})", dir.display(), ck.format().name());
    };
    // The flag is the way out only where the folder saved no batch count (the error names the
    // folder, not a file): a position file that cannot be read is refused whatever the flags say.
    let point = saved.resume_point(args.dataloader, args.step, args.epoch).map_err(|e| {
        let no_count = matches!(&e, ckpt::Error::BadSaveState { path, .. } if *path == saved.root);
        // The library error becomes text here, so it is escaped here (as `report_error` would).
        let e = ckpt::escape_controls(&e.to_string()).into_owned();
        anyhow::anyhow!("{e}{}", if args.step.is_none() && no_count { " (`--step K`)" } else { "" })
    })?;
    // Without `--seed` the saved sampler's seed is taken; with one, dataload checks they agree.
    let mut loader = loader.clone();
    if let (Some(seed), None) = (point.seed, loader.seed) {
        loader.seed = Some(i128::from(seed));
        loader.shuffle = true;
    }
    let built = loader.loader(point.world_size, 0)?;
    built.state_at(point.world_size, point.epoch, point.batches, point.seed.map(i128::from)).map_err(|e| match &e {
        dataload::DataloadError::StateMismatch { field: "seed", .. } => {
            anyhow::anyhow!(
                "{e}\nhint: `--seed` contradicts the seed the saved sampler holds; leave it out to take that one"
            )
        }
        _ => e.into(),
    })
}

/// Our loader state where a `Trainer` resuming from `dir` continues: the epoch and the batches
/// into it that `trainer_state.json`'s `global_step` means for this loader (O(1): nothing is
/// replayed).
fn from_trainer(dir: &std::path::Path, loader: &LoaderArgs, args: &StateArgs) -> anyhow::Result<LoaderState> {
    let ck = ckpt::Checkpoint::open(&dir.to_string_lossy())?;
    let Some(trainer) = ck.save_state().and_then(|s| s.trainer.as_ref()) else {
        anyhow::bail!(
            "{}: not a `Trainer` checkpoint folder (no `trainer_state.json`; it is {})",
            dir.display(),
            ck.format().name()
        );
    };
    let world = ck.save_state().map_or(1, |s| s.world_size);
    let mut l = loader.loader(world, 0)?;
    let point = trainer.resume_point(l.len()?, args.gradient_accumulation_steps)?;
    l.set_epoch(point.epoch);
    l.skip_first_batches(point.batches);
    Ok(l.state_dict())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Wrap {
        #[command(subcommand)]
        cmd: DataCommand,
    }

    fn parse(args: &[&str]) -> PlanArgs {
        let mut v = vec!["x", "plan"];
        v.extend_from_slice(args);
        match Wrap::try_parse_from(v).unwrap().cmd {
            DataCommand::Plan(p) => p,
            DataCommand::State(_) => unreachable!("plan expected"),
        }
    }

    #[test]
    fn plan_parses_into_accelerate_batches() {
        // accelerate's test_batch_sampler_shards_with_no_splits, n=21, bs=3.
        let p = parse(&["--len", "21", "--batch-size", "3", "--world-size", "2"]);
        let ranks = p.compute().unwrap();
        assert_eq!(ranks[1].batches.last().unwrap(), &vec![0, 1, 2]);
        let p = parse(&[
            "--len",
            "10",
            "--batch-size",
            "2",
            "--world-size",
            "2",
            "--shuffle",
            "--seed",
            "42",
            "--rank",
            "1",
            "--skip-batches",
            "1",
        ]);
        assert_eq!(p.loader.seed, Some(42));
        let ranks = p.compute().unwrap();
        assert_eq!(ranks.len(), 1);
        assert_eq!(ranks[0].rank, 1);
    }

    #[test]
    fn shuffle_needs_seed() {
        let p = parse(&["--len", "4", "--batch-size", "1", "--world-size", "1", "--shuffle"]);
        assert!(p.compute().is_err(), "a shuffled plan needs the seed");
    }
}
