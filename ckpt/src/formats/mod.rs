//! On-disk formats. Each module opens with a description of its layout.

pub mod dcp;
pub mod deepspeed;
pub mod hf_index;
pub mod safetensors;
pub mod torch;
