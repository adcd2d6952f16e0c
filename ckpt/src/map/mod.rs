//! What happens to a tensor's bytes between reading and writing: float casts with the bits
//! torch gives, and block-scaled FP8 (dequantized or quantized as published FP8 checkpoints
//! store it). Each is a computed target, planned and executed like a range copy.

pub(crate) mod blockscale;
pub(crate) mod cast;
