//! Hostile inputs, one module per format or per class of attack: malformed and malicious files
//! (`fixtures/hostile/<format>/`, written by `fixtures/gen/hostile_*.py`, or made at test time),
//! each refused with its exact message through the catalog reader, the operations and `verify`,
//! never a panic, and within a bound of time or memory where the attack is about size.

#[path = "../common/mod.rs"]
mod common;

mod accelerate;
mod crc;
mod dcp;
mod dcp_nd;
mod deepspeed;
mod hf_to_megatron;
mod megatron;
mod megatron_hf;
mod megatron_legacy;
mod megatron_moe;
mod peak_memory;
mod pickle_budget;
mod safetensors;
mod torch;
