//! The distributed training core of statekit: a small transformer in tch, trained by MPI
//! ranks in `ddp` or `sharded` (ZeRO-3 / FSDP2) mode, fed by `dataload`, checkpointed through
//! [`ckpt::save_sharded`] in accelerate's FSDP2 `save_state` layout, and resumable to the same
//! bits on the same world size, or elastically on another.
//!
//! The binary is `statekit-train` (see `trainer::Args` for its flags).
//!
//! Without its default feature `trainer` (tch, MPI) the crate is only what reads and writes
//! checkpoints: [`state`], [`state_file`], [`optim`]; that is what the fuzz target
//! (`train/fuzz`) builds, without libtorch.

#[cfg(feature = "trainer")]
pub mod comm;
#[cfg(feature = "trainer")]
pub mod data;
#[doc(hidden)]
pub mod fuzz;
#[cfg(feature = "trainer")]
pub mod model;
pub mod optim;
pub mod state;
pub mod state_file;
#[cfg(feature = "trainer")]
pub mod trainer;
