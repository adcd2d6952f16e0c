//! Float casts that give the bits torch's `.to(dtype)` gives on CPU.
//!
//! Finite values round to nearest, ties to even, with overflow to infinity and gradual
//! underflow into subnormals. From f64, torch goes through f32 first (so f64 → f16 rounds
//! twice, exactly as torch does). NaNs follow torch 2.13's vectorized CPU kernels, which are the
//! ones a real tensor goes through:
//!
//! - to f16 (from f32, bf16 or f64): sign kept, quiet bit set, top payload bits kept
//!   (`vcvtps2ph`);
//! - f32 or f64 to bf16: every NaN becomes `0xFFFF`;
//! - f16 to bf16: every NaN becomes `0x7FC0`;
//! - to f32: sign kept, quiet bit set, payload widened; bf16 → f32 is a plain shift.
//!
//! For tensors shorter than a vector (a handful of elements) torch's scalar fallback may pick a
//! different NaN; values other than NaN never differ.

use crate::dtype::Dtype;

/// True for the dtypes `--dtype` converts; everything else is copied as is.
pub(crate) fn is_castable(d: Dtype) -> bool {
    matches!(d, Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16)
}

/// Appends `src` (little-endian elements of `from`) converted to `to`. Both must be castable
/// and `src` a whole number of elements.
pub(crate) fn cast_into(src: &[u8], from: Dtype, to: Dtype, out: &mut Vec<u8>) {
    if from == to {
        out.extend_from_slice(src);
        return;
    }
    let elem = (from.bits() / 8) as usize;
    out.reserve(src.len() / elem.max(1) * (to.bits() / 8) as usize);
    for e in src.chunks_exact(elem.max(1)) {
        let bits32 = match from {
            Dtype::F64 => f64_to_f32(u64::from_le_bytes(e.try_into().unwrap_or([0; 8]))),
            Dtype::F32 => u32::from_le_bytes(e.try_into().unwrap_or([0; 4])),
            Dtype::F16 => {
                let h = u16::from_le_bytes(e.try_into().unwrap_or([0; 2]));
                if to == Dtype::BF16 && h & 0x7c00 == 0x7c00 && h & 0x3ff != 0 {
                    out.extend_from_slice(&0x7fc0u16.to_le_bytes());
                    continue;
                }
                f16_to_f32(h)
            }
            Dtype::BF16 => u32::from(u16::from_le_bytes(e.try_into().unwrap_or([0; 2]))) << 16,
            _ => 0,
        };
        match to {
            Dtype::F32 => out.extend_from_slice(&bits32.to_le_bytes()),
            Dtype::F16 => out.extend_from_slice(&f32_to_f16(bits32).to_le_bytes()),
            Dtype::BF16 => out.extend_from_slice(&f32_to_bf16(bits32).to_le_bytes()),
            Dtype::F64 => out.extend_from_slice(&f64::from(f32::from_bits(bits32)).to_bits().to_le_bytes()),
            _ => {}
        }
    }
}

fn f64_to_f32(x: u64) -> u32 {
    let v = f64::from_bits(x);
    if v.is_nan() {
        let sign = ((x >> 32) as u32) & 0x8000_0000;
        return sign | 0x7fc0_0000 | ((x >> 29) as u32 & 0x003f_ffff);
    }
    (v as f32).to_bits()
}

fn f16_to_f32(h: u16) -> u32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from(h >> 10) & 0x1f;
    let man = u32::from(h & 0x3ff);
    match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value m · 2^-24, exact in f32.
            let v = m as f32 * f32::from_bits(0x3380_0000);
            sign | v.to_bits()
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    }
}

fn f32_to_f16(x: u32) -> u16 {
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = x & 0x7f80_0000;
    let man = x & 0x007f_ffff;
    if exp == 0x7f80_0000 {
        return if man == 0 { sign | 0x7c00 } else { sign | 0x7e00 | (man >> 13) as u16 };
    }
    let e = (exp >> 23) as i32 - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // Subnormal or zero in f16: shift the full significand right, round to nearest even.
        let shift = (14 - e) as u32;
        if shift > 24 {
            return sign;
        }
        let m = man | 0x0080_0000;
        let mut h = m >> shift;
        let round = 1u32 << (shift - 1);
        if m & round != 0 && m & (3 * round - 1) != 0 {
            h += 1;
        }
        return sign | h as u16;
    }
    let h = ((e as u32) << 10) | (man >> 13);
    let round = 0x1000u32;
    // A carry out of the mantissa correctly bumps the exponent (up to infinity).
    let h = if man & round != 0 && man & (3 * round - 1) != 0 { h + 1 } else { h };
    sign | h as u16
}

fn f32_to_bf16(x: u32) -> u16 {
    if f32::from_bits(x).is_nan() {
        return 0xffff;
    }
    let bias = 0x7fff + ((x >> 16) & 1);
    (x.wrapping_add(bias) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(v: f32, to: Dtype) -> Vec<u8> {
        let mut out = Vec::new();
        cast_into(&v.to_le_bytes(), Dtype::F32, to, &mut out);
        out
    }

    #[test]
    fn rounding_edges() {
        // 1 + 2^-11 is a tie between 1 and 1 + 2^-10 in f16: even wins.
        assert_eq!(one(1.0 + 2f32.powi(-11), Dtype::F16), 0x3c00u16.to_le_bytes());
        assert_eq!(one(1.0 + 3.0 * 2f32.powi(-11), Dtype::F16), 0x3c02u16.to_le_bytes());
        assert_eq!(one(65520.0, Dtype::F16), 0x7c00u16.to_le_bytes());
        assert_eq!(one(65519.0, Dtype::F16), 0x7bffu16.to_le_bytes());
        assert_eq!(one(2f32.powi(-24), Dtype::F16), 1u16.to_le_bytes());
        assert_eq!(one(2f32.powi(-25), Dtype::F16), 0u16.to_le_bytes());
        assert_eq!(one(-0.0, Dtype::BF16), 0x8000u16.to_le_bytes());
        assert_eq!(one(f32::INFINITY, Dtype::BF16), 0x7f80u16.to_le_bytes());
    }

    #[test]
    fn f16_round_trips_through_f32() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if h & 0x7c00 == 0x7c00 && h & 0x3ff != 0 {
                continue;
            }
            assert_eq!(f32_to_f16(f), h, "{h:#06x}");
        }
    }
}
