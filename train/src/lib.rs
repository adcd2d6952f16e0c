//! The distributed training core of statekit: a small transformer in tch, trained by MPI
//! ranks in `ddp` or `sharded` (ZeRO-3 / FSDP2) mode, fed by `dataload`, checkpointed through
//! [`ckpt::save_sharded`] in accelerate's FSDP2 `save_state` layout, and resumable to the same
//! bits on the same world size, or elastically on another.
//!
//! The binary is `statekit-train`: [`Args`] are its flags, [`run`] runs one rank of the job,
//! and [`Refused`] is the error of a checkpoint refused at `--resume` (every rank stops, rank 0
//! having said why in one line). Everything else is private:
//!
//! - `args`: the flags; `trainer`: set-up, the loop, the report;
//! - `rank`: a rank's share of the state (two sets of weights, buffers allocated once, its
//!   checkpoint writer), with its step, save and resume; `saver`: the `--async-save` thread;
//! - `state`: the checkpoint folder and its commit protocol (through [`ckpt::StagedFolder`]);
//!   `state_file`: `statekit_state.json` and its checks;
//! - `optim`: AdamW, the schedule, clipping; `model`: the transformer; `data`: batches from
//!   `dataload`; `comm`: MPI; `shards`: who owns which elements; `host`: the one module with
//!   `unsafe` (host buffers lent as bytes and copied into tensors without a copy in between).
//!
//! Without its default feature `trainer` (tch, MPI) the crate is only what reads and writes
//! checkpoints (`state`, `state_file`, `optim`); that is what the fuzz target (`train/fuzz`)
//! builds, without libtorch.

#![warn(missing_docs, unreachable_pub)]

#[cfg(feature = "trainer")]
mod args;
#[cfg(feature = "trainer")]
mod comm;
#[cfg(feature = "trainer")]
mod data;
#[doc(hidden)]
pub mod fuzz;
mod host;
#[cfg(feature = "trainer")]
mod model;
// Without the trainer only the state file's types (AdamW's and the schedule's settings) are used.
#[cfg_attr(not(feature = "trainer"), allow(dead_code))]
mod optim;
#[cfg(feature = "trainer")]
mod rank;
#[cfg(feature = "trainer")]
mod saver;
#[cfg(feature = "trainer")]
mod shards;
// Without the trainer nothing calls the writer and the reader: they are still built (and
// linted), for the fuzz target's build to check the same files.
#[cfg_attr(not(feature = "trainer"), allow(dead_code))]
mod state;
mod state_file;
#[cfg(feature = "trainer")]
mod trainer;

#[cfg(feature = "trainer")]
pub use args::{Args, Mode};
#[cfg(feature = "trainer")]
pub use trainer::{run, Refused};
