//! What happens to a tensor between reading and writing: model maps, which assemble the
//! tensors an operation writes from boxes of the tensors a checkpoint stores ([`model`]), the
//! model architectures whose tables build such maps between frameworks' names ([`arch`]), float
//! casts with the bits torch gives, and block-scaled FP8 (dequantized or quantized as published
//! FP8 checkpoints store it). Each is planned and executed like a range copy.

pub(crate) mod arch;
pub(crate) mod blockscale;
pub(crate) mod cast;
pub(crate) mod model;
