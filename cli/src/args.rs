//! The command line: every subcommand's arguments, parsed by clap.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::data;

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

/// A world size: from 1 to [`ckpt::MAX_WORLD_SIZE`], refused at the edge (exit 2) rather
/// than sizing per-rank tables from a typo.
pub fn world_size() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..=ckpt::MAX_WORLD_SIZE)
}

/// How a source is opened: every option of [`ckpt::OpenOptions`] a user sets, declared once and
/// taken by every command that reads a checkpoint. The library refuses an option that does not
/// apply to the source it opens (a tag for a folder that is not DeepSpeed's), so none is ignored.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct OpenArgs {
    /// DeepSpeed checkpoints: the tag folder to read (default: the one named in `latest`).
    #[arg(long)]
    pub tag: Option<String>,
    /// Torch files: read a global beyond torch's weights-only list as inert data (a dotted
    /// name, a prefix ending in `.*`, or `*` for any; repeatable). Nothing is imported or
    /// called: objects become records of their class and state, numpy arrays tensors.
    #[arg(long = "allow-global", value_name = "PATTERN")]
    pub allow_global: Vec<String>,
    /// Megatron `torch_dist` checkpoints: every tensor under its stored key and global shape
    /// (stacked layers, the optimizer's tensors), as torch's `dcp_to_torch_save` gives them,
    /// instead of the model megatron holds on one rank.
    #[arg(long)]
    pub as_stored: bool,
    /// `hf://` sources: the branch, tag or commit to read (as `@REV` does; this one may hold
    /// a `/`, as `refs/pr/1` does).
    #[arg(long)]
    pub revision: Option<String>,
}

impl OpenArgs {
    /// The library's options.
    pub fn options(&self) -> anyhow::Result<ckpt::OpenOptions> {
        Ok(ckpt::OpenOptions {
            tag: self.tag.clone(),
            allow_globals: ckpt::AllowGlobals::new(&self.allow_global)?,
            as_stored: self.as_stored,
            revision: self.revision.clone(),
            ..Default::default()
        })
    }
}

/// `--json`, declared once for every command that prints a JSON document (`inspect`, `verify`,
/// the commands that write, `data plan`, `data state`).
#[derive(clap::Args, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JsonArg {
    /// Print JSON instead of text (each command's schema is in the README).
    #[arg(long)]
    pub json: bool,
}

/// `--max-shard-size`, declared once for the commands that shard their output.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ShardArgs {
    /// Shard the output into a folder of huggingface_hub-style files of at most this size, in
    /// huggingface_hub's units (`5GB` is 5·10⁹ bytes; a bare number is bytes). Without it
    /// `split` and `convert` to a folder shard at 5GB, and `merge` writes one file.
    // Kept as text and parsed once by `bytes`, after the ranks of a job have started, so that
    // a bad size is reported once, by rank 0, as every other refused option is.
    #[arg(long, value_name = "SIZE")]
    pub max_shard_size: Option<String>,
}

impl ShardArgs {
    /// The size in bytes, parsed by the library's one rule ([`ckpt::parse_size`]).
    pub fn bytes(&self) -> ckpt::Result<Option<u64>> {
        self.max_shard_size.as_deref().map(ckpt::parse_size).transpose()
    }
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
        /// A `.safetensors` file, an index, a folder, or `hf://ORG/NAME[@REV][/PATH]` (read on
        /// the Hub by its headers when not in the cache, not downloaded).
        path: String,
        #[command(flatten)]
        json: JsonArg,
        #[command(flatten)]
        open: OpenArgs,
    },
    /// Split a checkpoint into huggingface_hub-style shards with an index.
    Split {
        /// A `.safetensors` file, a sharded folder or its index, or an `hf://` address.
        src: String,
        /// Output folder (created if missing). A previous checkpoint there is replaced.
        out_dir: PathBuf,
        #[command(flatten)]
        shards: ShardArgs,
        #[command(flatten)]
        write: WriteArgs,
        #[command(flatten)]
        open: OpenArgs,
    },
    /// Merge any checkpoint (shards, DCP, DeepSpeed ZeRO, Megatron, accelerate, Trainer) into one file, bit-exact.
    ///
    /// Sharded safetensors and torch files, DCP folders (FSDP2, tensor parallel, DTensors on any
    /// dims, DCP's HF storage), accelerate `save_state` and `Trainer` folders (their model, and
    /// `--optimizer`) are merged into one `.safetensors` file (or shards, `--max-shard-size`).
    ///
    /// A DeepSpeed checkpoint folder (with `latest`, or a tag folder) is merged the way
    /// `zero_to_fp32.py --safe_serialization` merges it: fp32 master weights, buffers, frozen
    /// and tied parameters (a tied alias is written as its own copy).
    ///
    /// A Megatron-Core checkpoint (a run folder with `latest_checkpointed_iteration.txt`, an
    /// `iter_N` folder, a `torch_dist` folder, or a legacy save's `mp_rank_*` files) is merged
    /// into the model megatron holds on one rank (tensor and pipeline parallel 1), or with
    /// `--as-stored` into its stored tensors.
    Merge {
        /// A sharded folder, its index file, a DCP folder (holding `.metadata`), a DeepSpeed
        /// checkpoint folder, an accelerate `save_state` folder, or an `hf://` address.
        src: String,
        /// The output `.safetensors` file (a folder with `--max-shard-size`).
        out: PathBuf,
        /// An accelerate `save_state` folder: which model to merge (0 is `model.safetensors`,
        /// `pytorch_model_fsdp_0/` or `pytorch_model/`; 1 the second prepared model, ...).
        #[arg(long, value_name = "N")]
        model: Option<usize>,
        /// DeepSpeed, Megatron, or an accelerate `save_state` folder: also write the merged
        /// optimizer state (Adam moments; Megatron: fp32 main params too) to
        /// `optimizer.safetensors` beside OUT.
        #[arg(long)]
        optimizer: bool,
        // DeepSpeed only (the library refuses it elsewhere): shards into OUT, a folder, as
        // `zero_to_fp32 --max_shard_size` does.
        #[command(flatten)]
        shards: ShardArgs,
        #[command(flatten)]
        write: WriteArgs,
        #[command(flatten)]
        open: OpenArgs,
    },
    /// Convert between safetensors and torch files (`.bin`/`.pt`/`.pth`), one file or sharded.
    ///
    /// The format follows DST's extension (`.safetensors`; `.bin`, `.pt`, `.pth`), or `--to`;
    /// any other DST is a folder of huggingface_hub-style shards. Torch files are read without
    /// executing their pickle.
    ///
    /// `--to hf` writes a Megatron checkpoint (`torch_dist` or legacy, any parallel layout) as a
    /// Hugging Face model folder: `config.json` from the saved `args` and the weights under the
    /// Hub's names (Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, recognized from the
    /// `args` or named with `--arch`).
    #[command(group(clap::ArgGroup::new("blocks").args(["dequantize", "quantize"])))]
    Convert {
        /// A safetensors file or sharded folder, a torch file, or a `pytorch_model.bin.index.json` set.
        src: String,
        /// The output file, or a folder for sharded output.
        dst: PathBuf,
        /// Cast floating-point tensors (f64, f32, f16, bf16, FP8) to this dtype, with the bits
        /// torch's `.to(dtype)` gives: `f32`, `f16`, `bf16`, `f64`, torch's names
        /// (`float8_e4m3fn`, `float8_e5m2`, `float8_e4m3fnuz`, `float8_e5m2fnuz`,
        /// `float8_e8m0fnu`, `bfloat16`, ...) or safetensors' (`F8_E4M3`, `F8_E5M2`, `BF16`, ...).
        #[arg(long, value_parser = cast_dtype)]
        dtype: Option<ckpt::Dtype>,
        /// Dequantize block-scaled FP8 weights (an FP8 `W` with an f32 `W_scale_inv` per block)
        /// to this dtype (f32, f16, bf16), dropping the scales.
        #[arg(long, value_parser = cast_dtype, conflicts_with_all = ["dtype", "quantize"])]
        dequantize: Option<ckpt::Dtype>,
        /// Quantize the 2-D linear weights to block-scaled FP8 (`fp8-e4m3`: per-block
        /// amax / 448, scales as f32 `W_scale_inv`); embeddings, norms and the head are kept.
        #[arg(long, value_enum, conflicts_with = "dtype")]
        quantize: Option<QuantArg>,
        /// With `--quantize`: also quantize embeddings and the head (every 2-D `*weight`).
        #[arg(long, requires = "quantize")]
        quantize_all: bool,
        /// The block edge of `--dequantize`/`--quantize` (default 128).
        #[arg(long, value_name = "N", requires = "blocks")]
        block_size: Option<u64>,
        #[command(flatten)]
        shards: ShardArgs,
        /// The output format, when DST's extension does not say it: `safetensors`, `torch`,
        /// `dcp` (a torch.distributed.checkpoint folder; needs `--world-size`), `hf` (a Hugging
        /// Face model folder of a Megatron checkpoint: `config.json` and safetensors under the
        /// Hub's names, which transformers, vLLM and SGLang load), `megatron` (a Megatron-LM
        /// `torch_dist` run folder, of a Megatron checkpoint or a Hugging Face folder), or
        /// `megatron-legacy` (Megatron-LM's per-rank `mp_rank_*` files, cut for
        /// `--tensor-parallel`, `--pipeline-parallel` and `--expert-parallel`).
        #[arg(long, value_parser = str::parse::<ckpt::TargetFormat>)]
        to: Option<ckpt::TargetFormat>,
        /// With `--to hf`: the architecture to write (`llama`, `qwen2`, `qwen3`, `mixtral`,
        /// `qwen2_moe`, `qwen3_moe`) instead of the one recognized from the saved `args`.
        #[arg(long, value_name = "NAME", value_parser = str::parse::<ckpt::Arch>)]
        arch: Option<ckpt::Arch>,
        /// With `--to hf`: keep the first N rows of the vocabulary (embeddings and output layer)
        /// instead of all the checkpoint's rows, padding included.
        #[arg(long, value_name = "N")]
        vocab_size: Option<u64>,
        /// With `--to megatron-legacy`: the tensor-parallel ranks to cut the model for (default 1).
        #[arg(long, value_name = "T")]
        tensor_parallel: Option<u64>,
        /// With `--to megatron-legacy`: the pipeline stages, each `num_layers / P` layers (default 1).
        #[arg(long, value_name = "P")]
        pipeline_parallel: Option<u64>,
        /// With `--to megatron-legacy`: the expert-parallel ranks of a mixture-of-experts model
        /// (default 1).
        #[arg(long, value_name = "E")]
        expert_parallel: Option<u64>,
        /// Drop tensors that are exact aliases of another (tied weights) instead of copying them.
        #[arg(long)]
        dedupe: bool,
        /// With `--to dcp`: the number of ranks to lay the checkpoint out for (FSDP2's layout).
        #[arg(long, value_parser = world_size())]
        world_size: Option<u64>,
        #[command(flatten)]
        write: WriteArgs,
        #[command(flatten)]
        open: OpenArgs,
    },
    /// Rewrite a DCP, DeepSpeed ZeRO, accelerate or Trainer checkpoint for another number of ranks.
    ///
    /// A torch.distributed.checkpoint (DCP) folder: tensors are laid out as FSDP2 saves them
    /// (dim 0 cut by `torch.chunk` rules, one `__R_0.distcp` per rank); optimizer state and
    /// non-tensor values are kept. `.metadata` is written last.
    ///
    /// A DeepSpeed ZeRO folder (with `latest`) becomes the universal checkpoint DeepSpeed loads
    /// with `load_universal` on any number of ranks: `OUT/<tag>_universal/` and
    /// `OUT/latest_universal`, written last. An accelerate `save_state` or `Trainer` folder is
    /// rewritten whole: its model and optimizer folders as above, one RNG file per new rank, and
    /// its data position for the new world size.
    Reshard {
        /// A DCP folder (holding `.metadata`), a DeepSpeed ZeRO checkpoint folder, or an
        /// accelerate `save_state` or `Trainer` folder.
        src: String,
        /// The output folder (created if missing). A previous DCP checkpoint there is replaced.
        out: PathBuf,
        /// The number of ranks to lay the checkpoint out for.
        #[arg(long, value_parser = world_size())]
        world_size: u64,
        #[command(flatten)]
        write: WriteArgs,
        #[command(flatten)]
        open: OpenArgs,
    },
    /// Push a folder (a converted model, a split) to a Hub repository as one commit.
    ///
    /// Large files go by LFS; files the branch already holds with the same bytes are skipped; a
    /// repository that does not exist is created. Takes a token with write access (`HF_TOKEN`,
    /// or the token file under `HF_HOME`); `HF_ENDPOINT` names the Hub. Prints the commit's URL.
    Push {
        /// The folder to push (hidden files, a name starting with `.`, stay behind).
        local_dir: PathBuf,
        /// `hf://ORG/NAME[@BRANCH][/PATH]`: the repository, and the folder in it to push into.
        dst: String,
        /// The branch to commit to (default: the address's, else `main`).
        #[arg(long)]
        revision: Option<String>,
        /// The commit message (default: `Upload ORG/NAME with ckpt`).
        #[arg(long)]
        message: Option<String>,
    },
    /// Check headers, offsets, indexes, CRC32s and checksums. Exit 0 valid, 1 problems, 2 error.
    Verify {
        path: String,
        #[command(flatten)]
        json: JsonArg,
        /// Check the headers and indexes only (no CRC32s, no checksum manifest): an `hf://`
        /// model not in the cache is then read by range requests, not downloaded.
        #[arg(long)]
        headers_only: bool,
        #[command(flatten)]
        open: OpenArgs,
    },
}

/// The flags every command that writes a checkpoint shares, declared once: each command passes
/// all of them to the library's [`ckpt::WriteOptions`].
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct WriteArgs {
    /// Also write a `SHA256SUMS` manifest of the written files beside them, which `ckpt verify`
    /// and `sha256sum -c` check.
    #[arg(long)]
    pub checksums: bool,
    /// Write broadcast views (`expand`) at full size instead of refusing ones far larger than
    /// the storage they read (a tiny file must not start a write of gigabytes).
    #[arg(long)]
    pub allow_expanded: bool,
    // `--json`: what was written (schema `statekit.outcome/2`), not its paths.
    #[command(flatten)]
    pub json: JsonArg,
    /// Plan the write and print each rank's share (files, bytes read and written); write
    /// nothing.
    #[arg(long)]
    pub dry_run: bool,
}

impl Command {
    /// The shared write flags of a command that writes a checkpoint.
    pub fn write(&self) -> Option<WriteArgs> {
        match self {
            Command::Split { write, .. }
            | Command::Merge { write, .. }
            | Command::Convert { write, .. }
            | Command::Reshard { write, .. } => Some(*write),
            Command::Data { .. } | Command::Inspect { .. } | Command::Verify { .. } | Command::Push { .. } => None,
        }
    }

    /// `--json`: the command prints its JSON document instead of text.
    pub fn json(&self) -> bool {
        match self {
            Command::Inspect { json, .. } | Command::Verify { json, .. } => json.json,
            _ => self.write().is_some_and(|w| w.json.json),
        }
    }
}

/// `--dtype` and `--dequantize`: a float dtype by torch's, safetensors' or a short name.
pub fn cast_dtype(s: &str) -> Result<ckpt::Dtype, String> {
    match s.parse::<ckpt::Dtype>() {
        Ok(d) if d.is_castable() => Ok(d),
        Ok(d) => Err(format!("`{d}` is not a float dtype a cast can produce")),
        Err(e) => Err(e),
    }
    .map_err(|e| {
        format!("{e}\nhint: use f32, f16, bf16, f64, float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz, float8_e8m0fnu (or F8_E4M3, ...)")
    })
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantArg {
    /// `float8_e4m3fn` weights, f32 scales.
    #[value(name = "fp8-e4m3")]
    Fp8E4m3,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// The long flags of subcommand `name` (`data plan` as `["data", "plan"]`).
    fn flags(path: &[&str]) -> Vec<String> {
        let mut cmd = Cli::command();
        for name in path {
            cmd = cmd.find_subcommand(name).cloned().unwrap_or_else(|| panic!("no subcommand {name}"));
        }
        cmd.get_arguments().filter_map(|a| a.get_long().map(str::to_owned)).collect()
    }

    #[test]
    fn shared_flag_groups_reach_every_command_that_takes_them() {
        let group = |flags: &[&str], commands: &[&[&str]]| {
            for path in commands {
                let have = self::flags(path);
                for f in flags {
                    assert!(have.iter().any(|h| h == f), "`{}` lacks `--{f}`", path.join(" "));
                }
            }
        };
        let writers: &[&[&str]] = &[&["split"], &["merge"], &["convert"], &["reshard"]];
        group(&["checksums", "json", "dry-run", "allow-expanded"], writers);
        group(&["tag", "allow-global", "as-stored", "revision"], &[writers, &[&["inspect"], &["verify"]]].concat());
        group(&["max-shard-size"], &[&["split"], &["merge"], &["convert"]]);
        group(&["json"], &[&["inspect"], &["verify"], &["data", "plan"], &["data", "state"]]);
        // Where a flag cannot apply, clap refuses it rather than the command ignoring it.
        assert!(!flags(&["reshard"]).iter().any(|f| f == "max-shard-size"));
    }
}
