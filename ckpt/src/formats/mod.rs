//! On-disk formats. Each module opens with a description of its layout.

pub mod hf_index;
pub mod safetensors;
