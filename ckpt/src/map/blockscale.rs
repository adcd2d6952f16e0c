//! Block-scaled FP8, as published FP8 checkpoints store it.
//!
//! A 2-D linear weight `W` of shape `[R, C]` is stored as FP8 (`F8_E4M3`), and beside it an f32
//! tensor `W_scale_inv` (for `x.weight`, `x.weight_scale_inv`) of shape
//! `[ceil(R / B), ceil(C / B)]`: one scale per `B × B` block (B is 128 in every published model),
//! the blocks at the right and bottom edges partial. The real value of an element is its FP8
//! value times its block's scale.
//!
//! - Dequantizing computes, per element, `f32(w) * scale` in f32 and casts the product to the
//!   target dtype with torch's rounding: exactly `(w.float() * s_full).to(dtype)` in torch,
//!   where `s_full` repeats each scale over its block. The scale tensors are dropped.
//! - Quantizing takes each block's `amax = max |f32(w)|` (NaN if the block holds one, as
//!   `torch.amax` gives it), `scale = amax / 448` (1 for an all-zero block, so it divides
//!   cleanly), and writes `(f32(w) / scale).to(float8_e4m3fn)` and the scales as f32.
//!
//! Both stream: a gather reads one band of `B` rows at a time, so memory is bounded by a band
//! of the widest weight (and, while quantizing, by its scales, which a first pass over the
//! weight computes).

use std::sync::Arc;

use crate::error::{BlockScaleProblem, Error, Result};
use crate::map::cast::{self, fp8};
use crate::read::catalog::TensorInfo;
use crate::read::dtype::Dtype;
use crate::read::io::Sources;

/// What [`crate::convert`] does with block-scaled FP8 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlockScaling {
    /// Every FP8 weight with a `_scale_inv` beside it becomes `to` (f32, f16 or bf16); the
    /// scales are dropped.
    Dequantize {
        /// The dtype to write the weights as.
        to: Dtype,
        /// The block edge the scales were computed over.
        block: u64,
    },
    /// Every 2-D float `*weight` (but embeddings, norms and the head, unless `all_2d`)
    /// becomes `F8_E4M3` with an f32 `_scale_inv` per block.
    Quantize {
        /// The block edge.
        block: u64,
        /// Quantize embeddings and the head too.
        all_2d: bool,
    },
}

/// The suffix that names a weight's scales.
pub(crate) const SCALE_SUFFIX: &str = "_scale_inv";

/// The largest finite `float8_e4m3fn`.
const E4M3_MAX: f32 = 448.0;

/// What a gather computes from a weight's bytes instead of copying or casting them.
#[derive(Debug)]
pub(crate) enum Compute {
    /// The weight is FP8; multiply each element by its block's scale.
    Dequantize { scale: Vec<f32>, cols: u64, block: u64 },
    /// The weight is wide; divide each element by its block's scale and narrow to e4m3fn.
    Quantize { scale: Vec<f32>, cols: u64, block: u64 },
    /// The bytes themselves (the scales a quantization computed).
    Bytes(Vec<u8>),
}

/// `ceil(n / b)`.
fn blocks(n: u64, b: u64) -> u64 {
    n.div_ceil(b)
}

/// The shape of the scales of a `[rows, cols]` weight in blocks of `b`.
pub(crate) fn scale_shape(shape: &[u64], b: u64) -> Option<Vec<u64>> {
    match shape {
        [r, c] => Some(vec![blocks(*r, b), blocks(*c, b)]),
        _ => None,
    }
}

fn bad_scale(weight: &TensorInfo, scale: &TensorInfo, problem: BlockScaleProblem) -> Error {
    Error::BadBlockScale { weight: weight.name.clone(), scale: scale.name.clone(), problem }
}

/// Checks `scale` against `weight` and reads it as f32 values.
pub(crate) fn read_scales(srcs: &Sources, weight: &TensorInfo, scale: &TensorInfo, block: u64) -> Result<Vec<f32>> {
    let want = scale_shape(&weight.shape, block)
        .ok_or_else(|| bad_scale(weight, scale, BlockScaleProblem::WeightNot2d { shape: weight.shape.clone() }))?;
    if scale.shape != want {
        let problem =
            BlockScaleProblem::Shape { found: scale.shape.clone(), weight: weight.shape.clone(), block, want };
        return Err(bad_scale(weight, scale, problem));
    }
    if !cast::is_castable(scale.stored) || fp8::Format::of(scale.stored).is_some() {
        return Err(bad_scale(weight, scale, BlockScaleProblem::Dtype { dtype: scale.stored }));
    }
    let mut raw = Vec::new();
    for (file, off, len) in scale.runs() {
        raw.extend_from_slice(srcs.read(file, off, len)?);
    }
    let mut f32s = Vec::with_capacity(raw.len());
    cast::cast_into(&raw, scale.stored, Dtype::F32, &mut f32s);
    Ok(f32s.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

/// Streams `t`'s stored bytes in windows of `window` bytes (the last one shorter), releasing
/// the source pages behind it.
pub(crate) fn for_each_window(
    srcs: &Sources,
    t: &TensorInfo,
    window: usize,
    mut f: impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let mut buf: Vec<u8> = Vec::with_capacity(window);
    for (file, off, len) in t.runs() {
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min((window - buf.len()) as u64);
            buf.extend_from_slice(srcs.read(file, off + done, n)?);
            done += n;
            if buf.len() == window {
                f(&buf)?;
                buf.clear();
            }
        }
        srcs.release(file, off, len);
    }
    if !buf.is_empty() {
        f(&buf)?;
    }
    Ok(())
}

/// Bytes of one band of `block` rows of a `[_, cols]` tensor of `elem`-byte elements.
fn band_bytes(cols: u64, block: u64, elem: u64) -> usize {
    usize::try_from(cols.saturating_mul(block).saturating_mul(elem)).unwrap_or(usize::MAX).max(1)
}

/// Widens a window of `from` elements to f32 values.
fn as_f32(bytes: &[u8], from: Dtype, tmp: &mut Vec<u8>, out: &mut Vec<f32>) {
    tmp.clear();
    cast::cast_into(bytes, from, Dtype::F32, tmp);
    out.clear();
    out.extend(tmp.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
}

/// The per-block scales of a wide 2-D weight, `amax / 448` (1 for an all-zero block).
pub(crate) fn quantize_scales(srcs: &Sources, w: &TensorInfo, block: u64) -> Result<Vec<f32>> {
    let (rows, cols) = match w.shape[..] {
        [r, c] => (r, c),
        _ => return Ok(Vec::new()),
    };
    let scols = blocks(cols, block) as usize;
    let mut scale = vec![0f32; blocks(rows, block) as usize * scols];
    let elem = w.stored.bits() / 8;
    let (mut tmp, mut vals) = (Vec::new(), Vec::new());
    let mut band = 0usize;
    for_each_window(srcs, w, band_bytes(cols, block, elem), |bytes| {
        as_f32(bytes, w.stored, &mut tmp, &mut vals);
        let amax = &mut scale[band * scols..(band + 1) * scols];
        for row in vals.chunks(cols as usize) {
            for (bi, seg) in row.chunks(block as usize).enumerate() {
                for &x in seg {
                    // NaN wins, as in `torch.amax`.
                    let a = x.abs();
                    if a.is_nan() || a > amax[bi] {
                        amax[bi] = if amax[bi].is_nan() { amax[bi] } else { a };
                    }
                }
            }
        }
        band += 1;
        Ok(())
    })?;
    for s in &mut scale {
        *s /= E4M3_MAX;
        if *s == 0.0 {
            *s = 1.0;
        }
    }
    Ok(scale)
}

/// Writes `t` (a weight, through `compute`) as `to` into `out`, band by band, through `emit`.
pub(crate) fn run(
    srcs: &Sources,
    t: &TensorInfo,
    to: Dtype,
    compute: &Compute,
    mut emit: impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    match compute {
        Compute::Bytes(b) => emit(b),
        Compute::Dequantize { scale, cols, block } => {
            let Some(format) = fp8::Format::of(t.stored) else { return Ok(()) };
            let table: Vec<f32> = (0..=255u8).map(|b| f32::from_bits(fp8::to_f32(format, b))).collect();
            let scols = blocks(*cols, *block) as usize;
            let (cols, block) = (*cols as usize, *block as usize);
            // The product narrowed as `cast_into` narrows an f32, without a second buffer.
            let put: fn(f32, &mut Vec<u8>) = match to {
                Dtype::BF16 => |x, o| o.extend_from_slice(&cast::f32_to_bf16(x.to_bits()).to_le_bytes()),
                Dtype::F16 => |x, o| o.extend_from_slice(&cast::f32_to_f16(x.to_bits()).to_le_bytes()),
                Dtype::F64 => |x, o| o.extend_from_slice(&f64::from(x).to_bits().to_le_bytes()),
                _ => |x, o| o.extend_from_slice(&x.to_le_bytes()),
            };
            let mut out = Vec::new();
            let mut band = 0usize;
            for_each_window(srcs, t, band_bytes(cols as u64, block as u64, 1), |bytes| {
                out.clear();
                out.reserve(bytes.len() * (to.bits() / 8) as usize);
                let srow = &scale[band * scols..(band + 1) * scols];
                for row in bytes.chunks(cols) {
                    for (seg, &s) in row.chunks(block).zip(srow) {
                        for &b in seg {
                            put(table[usize::from(b)] * s, &mut out);
                        }
                    }
                }
                band += 1;
                emit(&out)
            })
        }
        Compute::Quantize { scale, cols, block } => {
            let scols = blocks(*cols, *block) as usize;
            let (cols_u, block_u) = (*cols as usize, *block as usize);
            let (mut tmp, mut vals) = (Vec::new(), Vec::new());
            let mut out = Vec::new();
            let mut band = 0usize;
            let elem = t.stored.bits() / 8;
            for_each_window(srcs, t, band_bytes(*cols, *block, elem), |bytes| {
                as_f32(bytes, t.stored, &mut tmp, &mut vals);
                out.clear();
                let srow = &scale[band * scols..(band + 1) * scols];
                for row in vals.chunks(cols_u) {
                    for (seg, &s) in row.chunks(block_u).zip(srow) {
                        out.extend(seg.iter().map(|&x| fp8::from_f32(fp8::Format::E4M3Fn, (x / s).to_bits())));
                    }
                }
                band += 1;
                emit(&out)
            })
        }
    }
}

/// True for the weights `--quantize` turns into FP8: 2-D wide floats named `*weight`, and
/// unless `all_2d`, not an embedding, a norm or the output head.
pub(crate) fn quantizable(t: &TensorInfo, all_2d: bool) -> bool {
    let special = ["embed", "norm", "lm_head", "wte", "wpe"].iter().any(|s| t.name.contains(s));
    t.shape.len() == 2 && cast::is_wide(t.stored) && t.name.ends_with("weight") && (all_2d || !special)
}

/// Shared handle for a gather's computation.
pub(crate) type SharedCompute = Arc<Compute>;
