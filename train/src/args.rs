//! The flags of `statekit-train`.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

/// How the ranks share the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Every rank holds and steps the whole model; gradients are all-reduced.
    Ddp,
    /// ZeRO-3 / FSDP2: each rank owns FSDP2's dim-0 chunks of every parameter and of its AdamW
    /// moments; parameters are all-gathered before the forward pass, gradients reduce-scattered.
    Sharded,
}

impl Mode {
    /// The name the state file and messages use.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Ddp => "ddp",
            Mode::Sharded => "sharded",
        }
    }
}

/// Flags of `statekit-train`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "statekit-train",
    version,
    args_override_self = true,
    about = "Train a small transformer on MPI ranks; checkpoints resume to the same bits."
)]
pub struct Args {
    /// Total optimizer steps of the run (a resumed run stops at the same number).
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Windows per rank per micro-batch.
    #[arg(long, default_value_t = 8)]
    pub batch_size: u64,
    /// Tokens per window.
    #[arg(long, default_value_t = 64)]
    pub block_size: i64,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Warmup steps.
    #[arg(long, default_value_t = 20)]
    pub warmup: u64,
    /// Clip gradients to this global norm (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f32,
    /// Seed of the initial weights (and of the data order unless `--data-seed`).
    #[arg(long, default_value_t = 1234)]
    pub seed: i64,
    /// Blocks.
    #[arg(long, default_value_t = 2)]
    pub layers: i64,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: i64,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    pub dim: i64,
    /// A separate output head instead of one tied to the token embedding.
    #[arg(long)]
    pub untied: bool,
    /// Matrix products in bfloat16 (autocast).
    #[arg(long)]
    pub bf16: bool,
    /// How the ranks share the model.
    #[arg(long, value_enum, default_value_t = Mode::Ddp)]
    pub mode: Mode,
    /// `auto`, `cpu` or `cuda`.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Token data `dataload` reads (`.bin` of u16, `.npy`, folders, globs). Default: the
    /// synthetic corpus, written on first use to `statekit-data/synthetic.bin`.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Vocabulary size (default: the synthetic corpus').
    #[arg(long)]
    pub vocab: Option<i64>,
    /// Checkpoint folder.
    #[arg(long)]
    pub ckpt_dir: Option<PathBuf>,
    /// Save every K steps (0: only at the end and on a signal).
    #[arg(long, default_value_t = 0)]
    pub save_every: u64,
    /// Keep the N newest checkpoints (0: all).
    #[arg(long, default_value_t = 0)]
    pub keep_last: usize,
    /// Continue from `CKPT_DIR/latest`.
    #[arg(long)]
    pub resume: bool,
    /// Write checkpoints from a background thread; the loop waits only for the copy.
    #[arg(long)]
    pub async_save: bool,
    /// accelerate's `dispatch_batches`: rank 0 reads and broadcasts every batch.
    #[arg(long)]
    pub dispatch_batches: bool,
    /// accelerate's `split_batches`.
    #[arg(long)]
    pub split_batches: bool,
    /// accelerate's `even_batches=False`.
    #[arg(long)]
    pub no_even_batches: bool,
    /// accelerate's `data_seed`.
    #[arg(long)]
    pub data_seed: Option<i64>,
    /// Torch intra-op threads per rank.
    #[arg(long, default_value_t = 1)]
    pub threads: i32,
    /// Write the sample indices each rank trains on to `DIR/samples-rank{R}.txt` (tests).
    #[arg(long, hide = true)]
    pub log_samples: Option<PathBuf>,
    /// Stop (without saving) after this many steps of this process (tests: a crash point).
    #[arg(long, hide = true)]
    pub stop_after: Option<u64>,
    /// Sleep this many milliseconds inside each checkpoint write (tests: a kill mid-write).
    #[arg(long, hide = true, default_value_t = 0)]
    pub pause_in_save_ms: u64,
    /// Sleep this many milliseconds per step (tests and the demo: room for a signal).
    #[arg(long, hide = true, default_value_t = 0)]
    pub step_sleep_ms: u64,
    /// After `--resume`, save the step resumed from before training on (tests: a re-save of
    /// the checkpoint `latest` names; also writes it in this run's world size).
    #[arg(long, hide = true)]
    pub save_on_resume: bool,
}
