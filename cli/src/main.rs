//! `ckpt`: split, merge, inspect and verify checkpoints; plan and explain data loading.
//!
//! Exit codes: 0 success, 1 problems found (`verify`), 2 usage, input or I/O error. stdout
//! carries data only; progress and notes go to stderr.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::Parser;

use args::{Cli, Command, CopyArg, OpenArgs, QuantArg};

/// The block edge of `--dequantize`/`--quantize` when `--block-size` does not give one
/// (DeepSeek-V3's 128×128 blocks).
const DEFAULT_BLOCK_SIZE: u64 = 128;

mod args;
mod data;
mod output;
mod progress;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Under an MPI launcher (with the `mpi` feature) this process is one rank of a job; every
    // rank runs the same command, each writes its share, and rank 0 prints.
    #[cfg(feature = "mpi")]
    let mpi = collective::mpi::launched().then(collective::mpi::Mpi::init).flatten();
    #[cfg(feature = "mpi")]
    let comm: &dyn collective::Collective = match &mpi {
        Some((_, world)) => world,
        None => &collective::Solo,
    };
    #[cfg(not(feature = "mpi"))]
    let comm: &dyn collective::Collective = &collective::Solo;
    // Without MPI, each process a launcher started would run the whole operation on its own,
    // all of them writing the one destination: refused (reading commands just print N times).
    #[cfg(not(feature = "mpi"))]
    if let (Some(launched), Some(_)) = (collective::launched_ranks(), cli.command.write()) {
        let line = format!(
            "error: started by a launcher as one of {launched}, but this `ckpt` was built without MPI, so each \
             rank would write the whole output on its own; hint: build it with `--features mpi` \
             (`cargo build -p statekit-cli --features mpi`), or run it once, outside the launcher\n"
        );
        // One write: the launcher forwards every rank's stderr, and a line written in pieces
        // would interleave with the other ranks'.
        let _ = std::io::stderr().write_all(line.as_bytes());
        return ExitCode::from(2);
    }
    let job = ckpt::Job::new(comm).dry_run(cli.command.write().is_some_and(|w| w.dry_run));
    run(&cli, &job).unwrap_or_else(|err| report_error(&err, &job))
}

/// Prints `err` on stderr, each cause once, with the `hint:` a flag can act on; exit 2. In a
/// job of several ranks the message names this rank, and a rank whose step failed only because
/// another's did prints nothing (that rank reports it).
fn report_error(err: &anyhow::Error, job: &ckpt::Job<'_>) -> ExitCode {
    if is_other_rank(err) {
        return ExitCode::from(2);
    }
    let rank = match job.world_size() {
        1 => String::new(),
        _ => format!("rank {}: ", job.rank()),
    };
    // A closed pipe (`ckpt inspect x | head`) is not an error worth a message.
    if err
        .chain()
        .any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe))
    {
        return ExitCode::SUCCESS;
    }
    let lib = err.chain().find_map(|c| c.downcast_ref::<ckpt::Error>());
    let mut stderr = std::io::stderr().lock();
    // Options that cannot be carried out are a usage error worded with the flags alone.
    if let Some(ckpt::Error::Misuse { misuse, .. }) = lib {
        let _ = writeln!(stderr, "{rank}error: {}", ckpt::escape_controls(&misuse.describe(&flag)));
        if let Some(hint) = lib.and_then(hint) {
            let _ = writeln!(stderr, "{}", ckpt::escape_controls(&hint));
        }
        return ExitCode::from(2);
    }
    // Our library errors already include their cause; print each cause only once. A library
    // error keeps the names it quotes as the file holds them: its text and its causes' are
    // escaped here, so that no name forges a line or reaches the terminal raw. The CLI's own
    // context (`open SRC`, a `\nhint:`) is printed as written.
    let mut msg = String::new();
    let mut quoting = false;
    for cause in err.chain() {
        quoting |= cause.is::<ckpt::Error>();
        let text = cause.to_string();
        let text = if quoting { ckpt::escape_controls(&text).into_owned() } else { text };
        if !msg.ends_with(&text) {
            if !msg.is_empty() {
                msg.push_str(": ");
            }
            msg.push_str(&text);
        }
    }
    if let Some(ckpt::Error::ExpandedView { .. }) = lib {
        msg.push_str("; hint: `--allow-expanded` writes it anyway");
    }
    let _ = writeln!(stderr, "{rank}error: {msg}");
    if let Some(hint) = lib.and_then(hint) {
        let _ = writeln!(stderr, "{}", ckpt::escape_controls(&hint));
    }
    ExitCode::from(2)
}

/// Whether `err` is only that another rank of the job failed.
fn is_other_rank(err: &anyhow::Error) -> bool {
    err.chain().any(|c| matches!(c.downcast_ref::<ckpt::Error>(), Some(ckpt::Error::OtherRank { .. })))
}

/// An option of the library as this command line spells it, with the value a message is about.
fn flag(option: ckpt::Opt, value: Option<&str>) -> String {
    let flag = match option {
        ckpt::Opt::To => "--to",
        ckpt::Opt::Dtype => "--dtype",
        ckpt::Opt::MaxShardSize => "--max-shard-size",
        ckpt::Opt::Dedupe => "--dedupe",
        ckpt::Opt::WorldSize => "--world-size",
        ckpt::Opt::Dequantize => "--dequantize",
        ckpt::Opt::Quantize => "--quantize",
        ckpt::Opt::AllowGlobals => "--allow-global",
        ckpt::Opt::AsStored => "--as-stored",
        ckpt::Opt::Tag => "--tag",
        ckpt::Opt::Revision => "--revision",
        ckpt::Opt::Model => "--model",
        ckpt::Opt::Optimizer => "--optimizer",
        ckpt::Opt::Checksums => "--checksums",
        ckpt::Opt::Arch => "--arch",
        ckpt::Opt::VocabSize => "--vocab-size",
        ckpt::Opt::TensorParallel => "--tensor-parallel",
        ckpt::Opt::PipelineParallel => "--pipeline-parallel",
        ckpt::Opt::ExpertParallel => "--expert-parallel",
        _ => "an option",
    };
    match value {
        Some(v) => format!("`{flag} {v}`"),
        None => format!("`{flag}`"),
    }
}

fn run(cli: &Cli, job: &ckpt::Job<'_>) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    match &cli.command {
        Command::Data { cmd } => return data::run(cmd.clone()),
        Command::Inspect { path, json, open } => {
            // The catalog alone: an `hf://` model is read by its headers, not downloaded.
            let options = ckpt::OpenOptions { headers_only: true, ..open.options()? };
            let ck = ckpt::Checkpoint::open_with(path, &options)?;
            if json.json {
                output::json(&mut out, &ck)?;
            } else {
                output::inspect_text(&mut out, &ck)?;
            }
        }
        Command::Push { local_dir, dst, revision, message } => {
            let done = ckpt::push(local_dir, dst, revision.as_deref(), message.as_deref())?;
            let at = format!("{}@{}", done.repo, done.revision);
            if let Some(url) = &done.url {
                writeln!(out, "{url}")?;
            }
            if !cli.quiet {
                match done.commit {
                    Some(_) => eprintln!(
                        "pushed {} file(s) to {at} ({} already there)",
                        done.uploaded.len(),
                        done.skipped.len()
                    ),
                    None => eprintln!("nothing to push: {at} holds all {} file(s) already", done.skipped.len()),
                }
            }
        }
        Command::Verify { path, json, headers_only, open } => {
            let quiet = cli.quiet || json.json;
            let options = ckpt::OpenOptions { headers_only: *headers_only, ..open.options()? };
            let report = progress::downloading(quiet, |p| {
                ckpt::verify_with(path, &ckpt::OpenOptions { progress: p, ..options.clone() })
            })?;
            if json.json {
                output::json(&mut out, &report)?;
            } else {
                output::verify_text(&mut out, &report)?;
            }
            out.flush()?;
            return Ok(if report.is_valid() { ExitCode::SUCCESS } else { ExitCode::from(1) });
        }
        op => {
            // With `--json` stdout is the document, and stderr carries errors only. Rank 0 of
            // a job speaks for it: its bar shows every rank's bytes.
            let root = job.rank() == 0;
            let quiet = cli.quiet || op.json() || !root;
            // One progress bar and one set of write options for whichever operation runs.
            let bar = progress::Bar::new(0, !quiet);
            let report = |n: u64| bar.inc(n);
            let copy = match cli.copy_method {
                CopyArg::Auto => ckpt::CopyMethod::Auto,
                CopyArg::Mmap => ckpt::CopyMethod::Mapped,
            };
            // Every shared write flag reaches the library, for every command that writes.
            let flags = op.write().unwrap_or_default();
            let write = ckpt::WriteOptions {
                job: Some(job),
                copy,
                checksums: flags.checksums,
                progress: Some(&report),
                allow_expanded: flags.allow_expanded,
            };
            let (ck, done, verb) = operate(op, &bar, &write, quiet, job)?;
            bar.finish();
            if !root {
                return Ok(ExitCode::SUCCESS);
            }
            if op.json() {
                output::json(&mut out, &done)?;
            } else if done.dry_run {
                output::shares_text(&mut out, &done)?;
            } else {
                for path in &done.files {
                    writeln!(out, "{}", path.display())?;
                }
            }
            if !quiet && std::io::stderr().is_terminal() {
                eprintln!("{}", summary(&ck, &done, verb));
            }
        }
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// Runs a command that writes a checkpoint: the source it read, what it wrote, and its verb.
fn operate(
    command: &Command,
    bar: &progress::Bar,
    write: &ckpt::WriteOptions<'_>,
    quiet: bool,
    job: &ckpt::Job<'_>,
) -> anyhow::Result<(ckpt::Checkpoint, ckpt::Outcome, &'static str)> {
    // Every rank opens the source (its catalog: headers and indexes, not the tensors); the
    // ranks agree that all of them could before any goes on, so one that could not reports
    // it alone and none waits for it in the operation.
    let open = |src: &str, open: &OpenArgs, verb: &str| {
        // An `hf://` source is downloaded first, under a bar of its own.
        let ck = open.options().and_then(|o| {
            progress::downloading(quiet, |p| {
                ckpt::Checkpoint::open_with(src, &ckpt::OpenOptions { progress: p, ..o })
                    .and_then(|ck| job.fault_at_open(src.as_ref()).map(|()| ck))
            })
            .or_else(|e| named(e, verb, src))
        });
        settle(job, src, ck.inspect(|ck| bar.set_total(ck.total_bytes())))
    };
    // The shard size is parsed on every rank and settled, so a bad one is reported once.
    let size = |src: &str, shards: &args::ShardArgs| settle(job, src, shards.bytes().map_err(Into::into));
    Ok(match command {
        Command::Split { src, out_dir, shards, open: o, .. } => {
            let default = || ckpt::parse_size(ckpt::DEFAULT_MAX_SHARD_SIZE);
            let max = size(src, shards)?.map_or_else(default, Ok)?;
            let ck = open(src, o, "splitting")?;
            let done = ckpt::split(&ck, out_dir, max, write).or_else(|e| named(e, "splitting", src));
            let done = settle(job, src, done)?;
            (ck, done, "split")
        }
        Command::Merge { src, out: dst, model, optimizer, shards, open: o, .. } => {
            let max_shard_size = size(src, shards)?;
            let options = ckpt::MergeOptions { max_shard_size, optimizer: *optimizer, model: *model };
            let ck = open(src, o, "merging")?;
            let done = ckpt::merge(&ck, dst, &options, write).or_else(|e| named(e, "merging", src));
            let done = settle(job, src, done)?;
            (ck, done, "merged")
        }
        Command::Convert {
            src,
            dst,
            dtype,
            dequantize,
            quantize,
            quantize_all,
            block_size,
            shards,
            to,
            dedupe,
            world_size,
            arch,
            vocab_size,
            tensor_parallel,
            pipeline_parallel,
            expert_parallel,
            open: o,
            ..
        } => {
            let max_shard_size = size(src, shards)?;
            let block = block_size.unwrap_or(DEFAULT_BLOCK_SIZE);
            let options = ckpt::ConvertOptions {
                to: *to,
                dtype: *dtype,
                blocks: match (dequantize, quantize) {
                    (Some(to), _) => Some(ckpt::BlockScaling::Dequantize { to: *to, block }),
                    (None, Some(QuantArg::Fp8E4m3)) => {
                        Some(ckpt::BlockScaling::Quantize { block, all_2d: *quantize_all })
                    }
                    (None, None) => None,
                },
                max_shard_size,
                dedupe: *dedupe,
                world_size: *world_size,
                arch: *arch,
                vocab_size: *vocab_size,
                tensor_parallel: *tensor_parallel,
                pipeline_parallel: *pipeline_parallel,
                expert_parallel: *expert_parallel,
            };
            // The library's check of the options, before anything is read.
            let format = settle(job, src, options.check(dst).map_err(Into::into))?;
            let ck = open(src, o, "converting")?;
            let done = ckpt::convert(&ck, dst, &options, write).or_else(|e| named(e, "converting", src));
            let done = settle(job, src, done)?;
            if !quiet {
                notes(&done, format);
            }
            (ck, done, "converted")
        }
        Command::Reshard { src, out: dst, world_size, open: o, .. } => {
            let ck = open(src, o, "resharding")?;
            let done = ckpt::reshard(&ck, dst, *world_size, write).or_else(|e| named(e, "resharding", src));
            let done = settle(job, src, done)?;
            (ck, done, "resharded")
        }
        Command::Data { .. } | Command::Inspect { .. } | Command::Verify { .. } | Command::Push { .. } => {
            unreachable!("`run` handles the commands that write no checkpoint")
        }
    })
}

/// `mine` on every rank of `job` once all have settled it: an error on the lowest rank that
/// failed, [`ckpt::Error::OtherRank`] on the others (which print nothing).
///
/// Every rank must reach it: a step that fails the same way on every rank (a bad option, a
/// refused tensor) is then printed once, by rank 0; one that failed in a library operation
/// already agreed which rank reports it, and the others' [`ckpt::Error::OtherRank`] is not a
/// failure of their own here.
fn settle<T>(job: &ckpt::Job<'_>, at: &str, mine: anyhow::Result<T>) -> anyhow::Result<T> {
    job.agree(std::path::Path::new(at), mine, is_other_rank, Into::into)
}

/// What a conversion did that the output alone does not show: aliases dropped or tied, and the
/// non-tensor values kept.
fn notes(done: &ckpt::Outcome, format: ckpt::TargetFormat) {
    // safetensors output drops an alias; torch output ties it to the kept storage.
    let dropped = done.files.iter().any(|p| p.extension().is_some_and(|e| e == "safetensors"));
    let what = if dropped { "dropped, alias of" } else { "tied to" };
    for (alias, kept) in &done.aliases {
        eprintln!("note: `{alias}` {what} `{kept}`");
    }
    if !done.values.is_empty() && format != ckpt::TargetFormat::Dcp {
        eprintln!("note: kept {} non-tensor value(s): {}", done.values.len(), done.values.join(", "));
    }
}

/// The `hint:` line for a torch file refused for globals `--allow-global` could admit, for a
/// pattern it cannot take, or for a checkpoint `reshard` cannot lay out for ranks.
fn hint(e: &ckpt::Error) -> Option<String> {
    match e {
        ckpt::Error::Misuse {
            misuse:
                ckpt::Misuse::BadGlobalPattern { .. }
                | ckpt::Misuse::OptionNotForFormat { option: ckpt::Opt::AllowGlobals, .. },
            ..
        } => {
            return Some(
                "hint: `--allow-global` applies to torch files and takes a dotted name, a prefix ending in `.*` \
                 (quoted: `'omegaconf.*'`), or `'*'`"
                    .into(),
            )
        }
        ckpt::Error::NotReshardable { .. } => {
            return Some(
                "hint: `ckpt convert SRC OUT --to dcp --world-size M` lays any checkpoint out for M ranks".into(),
            )
        }
        _ => {}
    }
    let globals = e.unallowed_globals()?;
    let flags: Vec<String> = globals.iter().map(|g| format!("--allow-global {}", ckpt::escape_controls(g))).collect();
    Some(format!(
        "hint: `{}` reads {} as inert data (a prefix such as `--allow-global 'omegaconf.*'` admits a module, `'*'` any global); nothing is imported or called",
        flags.join(" "),
        if globals.len() == 1 { "it" } else { "them" }
    ))
}

/// Adds "VERB SRC" to an error that does not already name the source, so a message names
/// each file once.
fn named<T>(err: ckpt::Error, verb: &str, src: &str) -> anyhow::Result<T> {
    if err.to_string().contains(src) {
        Err(err.into())
    } else {
        Err(anyhow::Error::new(err).context(format!("{verb} {src}")))
    }
}

/// The one-line note after an operation (on a terminal only).
fn summary(ck: &ckpt::Checkpoint, done: &ckpt::Outcome, verb: &str) -> String {
    // The source by its format's own name (`a ZeRO-2 checkpoint of 4 ranks`).
    let from = ck.describe().title;
    let into = match done.world_size {
        Some(w) => format!("{} file(s) for {w} ranks", done.files.len()),
        None => format!("{} file(s)", done.files.len()),
    };
    format!("{verb} {} tensors ({} bytes) from {from} into {into}", done.tensors, done.bytes)
}
