//! The only module with `unsafe`: host buffers seen as what the checkpoint writer and libtorch
//! take, without a copy.
//!
//! A checkpoint is the rank's `f32` buffers as little-endian bytes, which on a little-endian
//! machine they already are: [`le_bytes`] lends them as bytes instead of converting them (the
//! copy an asynchronous save used to stall for). A step writes the parameters into the model's
//! tensors: [`copy_to_tensor`] copies from the buffer itself instead of through a new tensor
//! per parameter per step.
#![allow(unsafe_code)]

#[cfg(not(target_endian = "little"))]
compile_error!("checkpoints are little-endian `f32`, lent without conversion: a little-endian target is needed");

/// `values` as their little-endian bytes, borrowed.
pub(crate) fn le_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: `u8` has alignment 1 and every byte of an `f32` is initialised, so the
    // `size_of_val(values)` bytes from its start are a valid `[u8]`; the result borrows `values`
    // (same lifetime, shared), so the memory is neither freed nor written while it is seen.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

/// Copies `src` into the `f32` tensor `dst` (any device) of as many elements, without
/// allocating a tensor for it. Panics when the lengths differ.
#[cfg(feature = "trainer")]
pub(crate) fn copy_to_tensor(dst: &tch::Tensor, src: &[f32]) {
    assert_eq!(dst.numel(), src.len(), "copy_to_tensor: lengths differ");
    assert_eq!(dst.kind(), tch::Kind::Float, "copy_to_tensor: not an f32 tensor");
    let size = dst.size();
    let mut strides = vec![1i64; size.len()];
    for i in (0..size.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * size[i + 1];
    }
    // SAFETY: the blob is a contiguous view of exactly `src.len()` `f32`s (the sizes multiply to
    // `dst.numel()`, checked above, with row-major strides), on the CPU where `src` lives. It is
    // only read (the source of `copy_`), and dropped before this function returns, while `src`
    // is still borrowed; a blob never frees the memory it views. `copy_` from a pageable host
    // buffer is synchronous, so nothing reads `src` after the call.
    let blob = unsafe {
        tch::Tensor::from_blob(src.as_ptr().cast::<u8>(), &size, &strides, tch::Kind::Float, tch::Device::Cpu)
    };
    let mut dst = dst.shallow_clone();
    tch::no_grad(|| dst.copy_(&blob));
}
