//! `ckpt` on each format's folders end to end, through the binary: one module per format
//! (inspect, merge, reshard, convert, verify, and how usage mistakes are refused).

#[path = "../common/mod.rs"]
mod common;

mod accelerate;
mod dcp;
mod deepspeed;
mod megatron;
mod megatron_hf;
mod megatron_stages;
mod trainer;
