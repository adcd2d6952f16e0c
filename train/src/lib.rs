//! The distributed training core of statekit: a small transformer in tch, trained by MPI
//! ranks in `ddp` or `sharded` (ZeRO-3 / FSDP2) mode, fed by `dataload`, checkpointed through
//! [`ckpt::save_sharded`] in accelerate's FSDP2 `save_state` layout, and resumable to the same
//! bits on the same world size, or elastically on another.
//!
//! The binary is `statekit-train` (see [`trainer::Args`] for its flags).

pub mod comm;
pub mod data;
pub mod model;
pub mod optim;
pub mod state;
pub mod trainer;
