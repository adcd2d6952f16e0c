//! `ckpt`: split, merge, inspect and verify checkpoints; plan and explain data loading.
//!
//! Exit codes: 0 success, 1 problems found (`verify`), 2 usage, input or I/O error. stdout
//! carries data only; progress and notes go to stderr.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

mod data;
mod output;
mod progress;

/// Split, merge, inspect and verify checkpoints, streaming, with bounded memory.
#[derive(Parser, Debug)]
#[command(name = "ckpt", version, about = "Split, merge, inspect and verify checkpoints, streaming, with bounded memory.", long_about = None)]
pub struct Cli {
    /// Print nothing on stderr but errors.
    #[arg(short, long, global = true)]
    pub quiet: bool,

    /// How tensor bytes are moved: `auto` (kernel copy, falling back to a memory map) or `mmap`.
    #[arg(long, global = true, value_enum, default_value_t = CopyArg::Auto, hide = true)]
    pub copy_method: CopyArg,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyArg {
    Auto,
    Mmap,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Plan and explain rank-sharded data loading.
    Data {
        #[command(subcommand)]
        cmd: data::DataCommand,
    },
    /// Show a checkpoint's format, tensors and totals.
    Inspect {
        /// A `.safetensors` file, an index, a folder, or `hf://ORG/NAME[@REV][/PATH]`.
        path: String,
        /// Print JSON (schema in the README).
        #[arg(long)]
        json: bool,
    },
    /// Split a checkpoint into huggingface_hub-style shards with an index.
    Split {
        /// A `.safetensors` file, a sharded folder or its index, or an `hf://` address.
        src: String,
        /// Output folder (created if missing). A previous checkpoint there is replaced.
        out_dir: PathBuf,
        /// Largest shard, in huggingface_hub's units: `5GB` is 5·10⁹ bytes.
        #[arg(long, default_value = ckpt::DEFAULT_MAX_SHARD_SIZE)]
        max_shard_size: String,
        /// Also write a `SHA256SUMS` manifest that `ckpt verify` checks.
        #[arg(long)]
        checksums: bool,
    },
    /// Merge a sharded or DeepSpeed ZeRO checkpoint into one `.safetensors` file, bit-exact.
    ///
    /// A DeepSpeed checkpoint folder (with `latest`, or a tag folder) is merged the way
    /// `zero_to_fp32.py --safe_serialization` merges it: fp32 master weights, buffers, frozen
    /// and tied parameters (a tied alias is written as its own copy).
    Merge {
        /// A sharded folder, its index file, a DCP folder (holding `.metadata`), a DeepSpeed
        /// checkpoint folder, or an `hf://` address.
        src: String,
        /// The output `.safetensors` file (a folder with `--max-shard-size`).
        out: PathBuf,
        /// Also write a `SHA256SUMS` manifest beside the output.
        #[arg(long)]
        checksums: bool,
        /// DeepSpeed: the tag folder to merge (default: the one named in `latest`).
        #[arg(long)]
        tag: Option<String>,
        /// DeepSpeed: also write the merged Adam moments to `optimizer.safetensors` beside OUT.
        #[arg(long)]
        optimizer: bool,
        /// DeepSpeed: shard into OUT (a folder) like huggingface_hub, files of at most this size.
        #[arg(long)]
        max_shard_size: Option<String>,
    },
    /// Convert between safetensors and torch files (`.bin`/`.pt`/`.pth`), one file or sharded.
    ///
    /// The format follows DST's extension (`.safetensors`; `.bin`, `.pt`, `.pth`), or `--to`;
    /// any other DST is a folder of huggingface_hub-style shards. Torch files are read without
    /// executing their pickle.
    Convert {
        /// A safetensors file or sharded folder, a torch file, or a `pytorch_model.bin.index.json` set.
        src: String,
        /// The output file, or a folder for sharded output.
        dst: PathBuf,
        /// Cast floating-point tensors (f64, f32, f16, bf16) to this dtype, with torch's rounding.
        #[arg(long, value_enum)]
        dtype: Option<DtypeArg>,
        /// Shard into DST (a folder) with files of at most this size (`5GB` is 5·10⁹ bytes).
        #[arg(long)]
        max_shard_size: Option<String>,
        /// The output format, when DST's extension does not say it.
        #[arg(long, value_enum)]
        to: Option<ToArg>,
        /// Drop tensors that are exact aliases of another (tied weights) instead of copying them.
        #[arg(long)]
        dedupe: bool,
        /// With `--to dcp`: the number of ranks to lay the checkpoint out for (FSDP2's layout).
        #[arg(long)]
        world_size: Option<u64>,
    },
    /// Rewrite a torch.distributed.checkpoint (DCP) folder for another number of ranks.
    ///
    /// Tensors are laid out as FSDP2 saves them (dim 0 cut by `torch.chunk` rules, one
    /// `__R_0.distcp` per rank); optimizer state and non-tensor values are kept. `.metadata`
    /// is written last.
    ///
    /// A DeepSpeed ZeRO folder (with `latest`) becomes the universal checkpoint DeepSpeed loads
    /// with `load_universal` on any number of ranks: `OUT/<tag>_universal/` and
    /// `OUT/latest_universal`, written last.
    Reshard {
        /// A DCP folder (holding `.metadata`) or a DeepSpeed ZeRO checkpoint folder.
        src: String,
        /// The output folder (created if missing). A previous DCP checkpoint there is replaced.
        out: PathBuf,
        /// The number of ranks to lay the checkpoint out for.
        #[arg(long)]
        world_size: u64,
    },
    /// Check headers, offsets, index completeness and checksums. Exit 0 valid, 1 problems, 2 error.
    Verify {
        path: String,
        /// Print JSON (schema in the README).
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DtypeArg {
    F32,
    F16,
    Bf16,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToArg {
    Safetensors,
    Torch,
    /// A torch.distributed.checkpoint folder (needs `--world-size`).
    Dcp,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(code) => code,
        Err(err) => {
            // A closed pipe (`ckpt inspect x | head`) is not an error worth a message.
            if err
                .chain()
                .any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe))
            {
                return ExitCode::SUCCESS;
            }
            // Our library errors already include their cause; print each cause only once.
            let mut msg = String::new();
            for cause in err.chain() {
                let text = cause.to_string();
                if !msg.ends_with(&text) {
                    if !msg.is_empty() {
                        msg.push_str(": ");
                    }
                    msg.push_str(&text);
                }
            }
            let _ = writeln!(std::io::stderr(), "error: {msg}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<ExitCode> {
    let copy = match cli.copy_method {
        CopyArg::Auto => ckpt::CopyMethod::Auto,
        CopyArg::Mmap => ckpt::CopyMethod::Mapped,
    };
    let notes = !cli.quiet && std::io::stderr().is_terminal();
    let mut out = std::io::stdout().lock();
    match &cli.command {
        Command::Data { cmd } => return data::run(cmd.clone()),
        Command::Inspect { path, json } => {
            let ck = ckpt::Checkpoint::open(path)?;
            if *json {
                output::inspect_json(&mut out, &ck)?;
            } else {
                output::inspect_text(&mut out, &ck)?;
            }
        }
        Command::Split { src, out_dir, max_shard_size, checksums } => {
            let max = ckpt::parse_size(max_shard_size)?;
            let ck = ckpt::Checkpoint::open(src)?;
            let bar = progress::Bar::new(ck.total_bytes(), !cli.quiet);
            let report = |n: u64| bar.inc(n);
            let opts = ckpt::WriteOptions { copy, checksums: *checksums, progress: Some(&report) };
            let done = ckpt::split(&ck, out_dir, max, &opts).with_context(|| format!("splitting {src}"))?;
            bar.finish();
            for (path, _) in &done.files {
                writeln!(out, "{}", path.display())?;
            }
            if let Some(index) = &done.index {
                writeln!(out, "{}", index.display())?;
            }
            if notes {
                eprintln!(
                    "split {} tensors ({} bytes) into {} file(s)",
                    ck.tensors().len(),
                    done.total_size,
                    done.files.len()
                );
            }
        }
        Command::Merge { src, out: dst, checksums, tag, optimizer, max_shard_size } => {
            if ckpt::is_zero_checkpoint(std::path::Path::new(src)) {
                let ck = ckpt::ZeroCheckpoint::open(std::path::Path::new(src), tag.as_deref())?;
                let options = ckpt::ZeroMergeOptions {
                    max_shard_size: max_shard_size.as_deref().map(ckpt::parse_size).transpose()?,
                    optimizer: *optimizer,
                };
                let bar = progress::Bar::new(0, !cli.quiet);
                let report = |n: u64| bar.inc(n);
                let opts = ckpt::WriteOptions { copy, checksums: *checksums, progress: Some(&report) };
                let done = ckpt::merge_zero(&ck, dst, &options, &opts).with_context(|| format!("merging {src}"))?;
                bar.finish();
                for path in &done.files {
                    writeln!(out, "{}", path.display())?;
                }
                if notes {
                    eprintln!(
                        "merged {} tensors ({} bytes) from a ZeRO-{} checkpoint of {} ranks",
                        done.tensors,
                        done.bytes,
                        ck.stage(),
                        ck.world_size()
                    );
                }
                out.flush()?;
                return Ok(ExitCode::SUCCESS);
            }
            if tag.is_some() || *optimizer || max_shard_size.is_some() {
                anyhow::bail!(
                    "`--tag`, `--optimizer` and `--max-shard-size` apply to DeepSpeed checkpoints only; {src} is not one \
                     (hint: `ckpt split` shards a checkpoint)"
                );
            }
            let ck = ckpt::Checkpoint::open(src)?;
            let bar = progress::Bar::new(ck.total_bytes(), !cli.quiet);
            let report = |n: u64| bar.inc(n);
            let opts = ckpt::WriteOptions { copy, checksums: *checksums, progress: Some(&report) };
            let done = ckpt::merge(&ck, dst, &opts).with_context(|| format!("merging {src}"))?;
            bar.finish();
            writeln!(out, "{}", done.path.display())?;
            if notes {
                eprintln!("merged {} tensors ({} bytes) from {} file(s)", done.tensors, done.bytes, ck.files().len());
            }
        }
        Command::Convert { src, dst, to: Some(ToArg::Dcp), world_size, dtype, max_shard_size, dedupe } => {
            if dtype.is_some() || max_shard_size.is_some() || *dedupe {
                anyhow::bail!("`--to dcp` takes only `--world-size`");
            }
            let Some(world) = world_size else {
                anyhow::bail!("`--to dcp` needs `--world-size M`");
            };
            write_dcp(&mut out, notes, || {
                let bar = progress::Bar::new(0, !cli.quiet);
                let report = |n: u64| bar.inc(n);
                let opts = ckpt::WriteOptions { copy, checksums: false, progress: Some(&report) };
                let done = ckpt::to_dcp(src, dst, *world, &opts).with_context(|| format!("converting {src}"));
                bar.finish();
                done
            })?;
        }
        Command::Reshard { src, out: dst, world_size } if ckpt::is_zero_checkpoint(std::path::Path::new(src)) => {
            let ck = ckpt::ZeroCheckpoint::open(std::path::Path::new(src), None)?;
            let bar = progress::Bar::new(0, !cli.quiet);
            let report = |n: u64| bar.inc(n);
            let opts = ckpt::WriteOptions { copy, checksums: false, progress: Some(&report) };
            let done = ckpt::reshard_zero(&ck, dst, *world_size, &opts).with_context(|| format!("resharding {src}"))?;
            bar.finish();
            for path in &done.files {
                writeln!(out, "{}", path.display())?;
            }
            if notes {
                eprintln!(
                    "wrote a universal checkpoint of {} params ({} bytes) from a ZeRO-{} checkpoint of {} ranks; \
                     DeepSpeed loads it on {} ranks with \"checkpoint\": {{\"load_universal\": true}}",
                    done.params,
                    done.bytes,
                    ck.stage(),
                    ck.world_size(),
                    world_size
                );
            }
        }
        Command::Reshard { src, out: dst, world_size } => {
            write_dcp(&mut out, notes, || {
                let bar = progress::Bar::new(0, !cli.quiet);
                let report = |n: u64| bar.inc(n);
                let opts = ckpt::WriteOptions { copy, checksums: false, progress: Some(&report) };
                let done = ckpt::reshard(src, dst, *world_size, &opts).with_context(|| format!("resharding {src}"));
                bar.finish();
                done
            })?;
        }
        Command::Convert { src, dst, dtype, max_shard_size, to, dedupe, world_size } => {
            if world_size.is_some() {
                anyhow::bail!("`--world-size` only applies to `--to dcp`");
            }
            let options = ckpt::ConvertOptions {
                to: to.map(|t| match t {
                    ToArg::Safetensors => ckpt::TargetFormat::Safetensors,
                    ToArg::Torch | ToArg::Dcp => ckpt::TargetFormat::Torch,
                }),
                dtype: dtype.map(|d| match d {
                    DtypeArg::F32 => ckpt::Dtype::F32,
                    DtypeArg::F16 => ckpt::Dtype::F16,
                    DtypeArg::Bf16 => ckpt::Dtype::BF16,
                }),
                max_shard_size: max_shard_size.as_deref().map(ckpt::parse_size).transpose()?,
                dedupe: *dedupe,
            };
            let bar = progress::Bar::new(0, !cli.quiet);
            let report = |n: u64| bar.inc(n);
            let opts = ckpt::WriteOptions { copy, checksums: false, progress: Some(&report) };
            let done = ckpt::convert(src, dst, &options, &opts).with_context(|| format!("converting {src}"))?;
            bar.finish();
            for path in &done.files {
                writeln!(out, "{}", path.display())?;
            }
            if let Some(index) = &done.index {
                writeln!(out, "{}", index.display())?;
            }
            if !cli.quiet {
                for (alias, kept) in &done.aliases {
                    let what = if done.format == ckpt::TargetFormat::Torch { "tied to" } else { "dropped, alias of" };
                    eprintln!("note: `{alias}` {what} `{kept}`");
                }
                if !done.leaves.is_empty() {
                    eprintln!("note: kept {} non-tensor value(s): {}", done.leaves.len(), done.leaves.join(", "));
                }
            }
            if notes {
                eprintln!(
                    "converted {} tensors ({} bytes) into {} file(s)",
                    done.tensors,
                    done.bytes,
                    done.files.len()
                );
            }
        }
        Command::Verify { path, json } => {
            let report = ckpt::verify(path)?;
            if *json {
                output::verify_json(&mut out, &report)?;
            } else {
                output::verify_text(&mut out, &report)?;
            }
            if !report.is_valid() {
                return Ok(ExitCode::from(1));
            }
        }
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// Runs a DCP write and prints the files it made (data files, then `.metadata`).
fn write_dcp(
    out: &mut impl Write,
    notes: bool,
    run: impl FnOnce() -> anyhow::Result<ckpt::DcpOutcome>,
) -> anyhow::Result<()> {
    let done = run()?;
    for path in &done.files {
        writeln!(out, "{}", path.display())?;
    }
    writeln!(out, "{}", done.metadata.display())?;
    if notes {
        eprintln!(
            "wrote {} tensors ({} bytes) and {} non-tensor value(s) for {} ranks into {} file(s)",
            done.tensors,
            done.bytes,
            done.values,
            done.world_size,
            done.files.len()
        );
    }
    Ok(())
}
