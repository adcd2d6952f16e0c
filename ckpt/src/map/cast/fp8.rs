//! The FP8 dtypes torch 2.13 has, to and from f32, bit for bit as its CPU kernels.
//!
//! Four are sign/exponent/mantissa formats that differ in their exponent bias and in what the
//! top codes mean (`e4m3fn`: no infinity, `S.1111.111` is NaN; `e5m2`: IEEE-like; the `fnuz`
//! pair: `0x80` is the only NaN, no infinity, no negative zero). `e8m0fnu` is an unsigned
//! exponent alone (a power-of-two scale), `0xFF` its NaN.

use crate::read::dtype::Dtype;

/// One FP8 encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    E4M3Fn,
    E5M2,
    E4M3Fnuz,
    E5M2Fnuz,
    E8M0Fnu,
}

impl Format {
    /// The FP8 format of `d`, if it is one.
    pub(crate) fn of(d: Dtype) -> Option<Format> {
        Some(match d {
            Dtype::F8E4M3 => Format::E4M3Fn,
            Dtype::F8E5M2 => Format::E5M2,
            Dtype::F8E4M3Fnuz => Format::E4M3Fnuz,
            Dtype::F8E5M2Fnuz => Format::E5M2Fnuz,
            Dtype::F8E8M0 => Format::E8M0Fnu,
            _ => return None,
        })
    }

    /// (mantissa bits, exponent bias) of the sign/exponent/mantissa formats.
    fn layout(self) -> (u32, i32) {
        match self {
            Format::E4M3Fn => (3, 7),
            Format::E5M2 => (2, 15),
            Format::E4M3Fnuz => (3, 8),
            Format::E5M2Fnuz => (2, 16),
            Format::E8M0Fnu => (0, 127),
        }
    }
}

const F32_NAN_FNUZ: u32 = 0x7f80_0001;

/// The f32 bits of FP8 byte `b`, as torch widens it.
pub(crate) fn to_f32(f: Format, b: u8) -> u32 {
    let b = u32::from(b);
    if f == Format::E8M0Fnu {
        return match b {
            0 => 0x0040_0000,
            0xff => F32_NAN_FNUZ,
            e => e << 23,
        };
    }
    let (mbits, bias) = f.layout();
    let sign = (b & 0x80) << 24;
    let exp = (b & 0x7f) >> mbits;
    let man = b & ((1 << mbits) - 1);
    match f {
        Format::E4M3Fn if b & 0x7f == 0x7f => return sign | 0x7ff0_0000,
        Format::E5M2 if exp == 0x1f => {
            // e5m2 is the top byte of an f16: widen the way f16 is widened.
            return if man == 0 { sign | 0x7f80_0000 } else { sign | 0x7fc0_0000 | (man << 21) };
        }
        Format::E4M3Fnuz | Format::E5M2Fnuz if b == 0x80 => return F32_NAN_FNUZ,
        _ => {}
    }
    if exp == 0 {
        // Subnormal: man · 2^(1 - bias - mbits), exact in f32.
        if man == 0 {
            return sign;
        }
        let v = man as f32 * f32::from_bits(((127 + 1 - bias - mbits as i32) as u32) << 23);
        return sign | v.to_bits();
    }
    sign | (((exp as i32 - bias + 127) as u32) << 23) | (man << (23 - mbits))
}

/// The FP8 byte torch gives for the f32 with bits `x`.
pub(crate) fn from_f32(f: Format, x: u32) -> u8 {
    if f == Format::E8M0Fnu {
        return e8m0_from_f32(x);
    }
    let sign = ((x >> 24) & 0x80) as u8;
    let abs = x & 0x7fff_ffff;
    let nan = abs > 0x7f80_0000;
    let inf = abs == 0x7f80_0000;
    let (mbits, bias) = f.layout();
    // The largest finite magnitude code, and what a value beyond it becomes.
    let (max, beyond) = match f {
        Format::E4M3Fn => (0x7e, sign | 0x7e),
        Format::E5M2 => (0x7b, sign | 0x7c),
        _ => (0x7f, 0x80),
    };
    if nan {
        return match f {
            Format::E4M3Fn | Format::E5M2 => sign | 0x7f,
            _ => 0x80,
        };
    }
    if inf {
        return beyond;
    }
    let code = round_magnitude(abs, mbits, bias);
    if code > max {
        return beyond;
    }
    match f {
        Format::E4M3Fnuz | Format::E5M2Fnuz if code == 0 => 0,
        _ => sign | code as u8,
    }
}

/// The magnitude code (exponent and mantissa fields, maybe past the largest finite one) of the
/// finite f32 magnitude `abs`, rounded to nearest, ties to even.
fn round_magnitude(abs: u32, mbits: u32, bias: i32) -> u32 {
    let e32 = (abs >> 23) as i32;
    // Significand with its implicit bit, and its unbiased exponent.
    let (sig, unb) = if e32 == 0 { (abs & 0x7f_ffff, -126) } else { ((abs & 0x7f_ffff) | 0x80_0000, e32 - 127) };
    let emin = 1 - bias;
    if unb - emin > 40 {
        return u32::MAX; // far beyond any FP8 range
    }
    // Drop the bits below the target's resolution at this exponent (2^(e - mbits), with e at
    // least emin for subnormals); the field arithmetic then carries into the exponent.
    if unb >= emin {
        let shift = 23 - mbits;
        let code = (((unb + bias) as u32) << mbits) | ((sig >> shift) & ((1 << mbits) - 1));
        return round_half_even(code, sig, shift);
    }
    let shift = (23 - mbits as i32 + (emin - unb)) as u32;
    if shift > 25 {
        return 0; // below half the smallest subnormal
    }
    round_half_even(sig >> shift, sig, shift)
}

/// Rounds the truncated `code` up when the bits of `sig` below `shift` are more than half, or
/// exactly half and `code` is odd.
fn round_half_even(code: u32, sig: u32, shift: u32) -> u32 {
    let rest = sig & ((1u32 << shift) - 1);
    let half = 1u32 << (shift - 1);
    if rest > half || (rest == half && code & 1 == 1) {
        code + 1
    } else {
        code
    }
}

/// torch's `fp8e8m0fnu_from_fp32_value`: the exponent field, rounded up when the first dropped
/// bit is set and either a lower bit is set or the value is normal.
fn e8m0_from_f32(x: u32) -> u8 {
    let exp = (x >> 23) & 0xff;
    if exp == 0xff {
        return 0xff;
    }
    let guard = x & 0x40_0000 != 0;
    let lower = x & 0x3f_ffff != 0;
    let up = guard && (lower || exp > 0);
    (exp + u32::from(up)) as u8
}

/// The 256 values of `f` cast to `to` (a wide float or another FP8), little-endian, one
/// element of `to` per input byte in byte order.
pub(crate) fn decode_table(f: Format, to: Dtype) -> Vec<u8> {
    let width = (to.bits() / 8) as usize;
    let mut table = Vec::with_capacity(256 * width);
    for b in 0..=255u8 {
        let bits = to_f32(f, b);
        if let Some(g) = Format::of(to) {
            table.push(from_f32(g, bits));
        } else if to == Dtype::BF16 && f32::from_bits(bits).is_nan() {
            table.extend_from_slice(&0x7fc0u16.to_le_bytes());
        } else {
            super::push_wide(bits, to, &mut table);
        }
    }
    table
}
