//! The fixture tables, one module per format: every fixture under `fixtures/<format>/` was
//! written by the real tool (`fixtures/gen/`), which also recorded what it reads back; each test
//! opens one fixture and compares what `ckpt` reads, merges or converts with that record.

#[path = "../common/mod.rs"]
mod common;

mod accelerate;
mod accelerate_state;
mod dcp;
mod dcp_nd;
mod deepspeed;
mod fp8;
mod megatron;
mod megatron_arch;
mod megatron_moe;
mod megatron_stages;
mod safetensors;
mod torch;
mod torch_compat;
mod torch_unsafe;
mod torchscript;
mod trainer;
