//! Float casts that give the bits torch's `.to(dtype)` gives on CPU.
//!
//! Finite values round to nearest, ties to even, with overflow to infinity and gradual
//! underflow into subnormals. From f64, torch goes through f32 first (so f64 → f16 rounds
//! twice, exactly as torch does). NaNs follow torch 2.13's vectorized CPU kernels, which are the
//! ones a real tensor goes through:
//!
//! - to f16 (from f32, bf16, f64 or FP8): sign kept, quiet bit set, top payload bits kept
//!   (`vcvtps2ph`);
//! - f32 or f64 to bf16: every NaN becomes `0xFFFF`;
//! - f16 or FP8 to bf16: every NaN becomes `0x7FC0`;
//! - to f32: sign kept, quiet bit set, payload widened; bf16 → f32 is a plain shift.
//!
//! For tensors shorter than a vector (a handful of elements) torch's scalar fallback may pick a
//! different NaN; values other than NaN never differ.
//!
//! The FP8 dtypes (see [`fp8`]) go through f32 both ways, as torch's CPU kernels do (f64 and
//! f16 sources round to f32 first). What torch 2.13 does at the edges, checked against it for
//! every byte and a sweep of wide inputs (`fixtures/gen/fp8_casts.py`):
//!
//! - `float8_e4m3fn` **saturates**: every finite value beyond ±448 and ±inf become ±448; only
//!   NaN becomes NaN (`0x7F`, sign kept);
//! - `float8_e5m2` overflows to ±inf, NaN becomes `0x7F` with its sign;
//! - the `fnuz` types have one NaN (`0x80`) that overflow, ±inf and NaN all become, and no
//!   negative zero (a negative value that rounds to zero is `0x00`);
//! - `float8_e8m0fnu` keeps only the exponent: the sign is dropped, the significand rounds
//!   (up from one half, or at one half of a normal value), ±inf and NaN become `0xFF`, and
//!   0, subnormals and 2^-127 become `0x00` (2^-127).

use crate::read::dtype::Dtype;

pub(crate) mod fp8;

/// True for the dtypes `--dtype` converts (f64, f32, f16, bf16 and every FP8); everything
/// else is copied as is.
pub(crate) fn is_castable(d: Dtype) -> bool {
    d.is_castable()
}

/// True for the wide floats (f64, f32, f16, bf16).
pub(crate) fn is_wide(d: Dtype) -> bool {
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
    if let Some(f) = fp8::Format::of(from) {
        // 256 inputs: decode each once, then every element is a table lookup.
        let table = fp8::decode_table(f, to);
        let width = (to.bits() / 8) as usize;
        for &b in src {
            out.extend_from_slice(&table[usize::from(b) * width..][..width]);
        }
        return;
    }
    let into_fp8 = fp8::Format::of(to);
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
        if let Some(f) = into_fp8 {
            out.push(fp8::from_f32(f, bits32));
            continue;
        }
        push_wide(bits32, to, out);
    }
}

/// Appends f32 `bits32` converted to the wide dtype `to`.
fn push_wide(bits32: u32, to: Dtype, out: &mut Vec<u8>) {
    match to {
        Dtype::F32 => out.extend_from_slice(&bits32.to_le_bytes()),
        Dtype::F16 => out.extend_from_slice(&f32_to_f16(bits32).to_le_bytes()),
        Dtype::BF16 => out.extend_from_slice(&f32_to_bf16(bits32).to_le_bytes()),
        Dtype::F64 => out.extend_from_slice(&f64::from(f32::from_bits(bits32)).to_bits().to_le_bytes()),
        _ => {}
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

pub(crate) fn f32_to_f16(x: u32) -> u16 {
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

pub(crate) fn f32_to_bf16(x: u32) -> u16 {
    if f32::from_bits(x).is_nan() {
        return 0xffff;
    }
    let bias = 0x7fff + ((x >> 16) & 1);
    (x.wrapping_add(bias) >> 16) as u16
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_castable_dtypes_are_the_ones_implemented() {
        for d in crate::read::dtype::Dtype::ALL {
            assert_eq!(d.is_castable(), super::is_wide(d) || super::fp8::Format::of(d).is_some(), "{d}");
        }
    }

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

/// Every FP8 cast against what torch 2.13 gives (`fixtures/fp8/casts.safetensors`, written by
/// `fixtures/gen/fp8_casts.py`).
#[cfg(test)]
mod torch_fp8 {
    use super::cast_into;
    use crate::read::dtype::Dtype;

    const FP8: [Dtype; 5] = [Dtype::F8E4M3, Dtype::F8E5M2, Dtype::F8E4M3Fnuz, Dtype::F8E5M2Fnuz, Dtype::F8E8M0];
    const WIDE: [Dtype; 4] = [Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::F64];

    fn fixture() -> Vec<u8> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/fp8/casts.safetensors");
        std::fs::read(path).expect("fixtures/fp8/casts.safetensors (make fixtures)")
    }

    fn tensor<'a>(st: &'a safetensors::SafeTensors<'a>, name: &str) -> &'a [u8] {
        st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}")).data()
    }

    fn cast(src: &[u8], from: Dtype, to: Dtype) -> Vec<u8> {
        let mut out = Vec::new();
        cast_into(src, from, to, &mut out);
        out
    }

    /// The first element where `ours` and `torch` differ, as (index, input, ours, torch).
    fn first_diff(input: &[u8], from: Dtype, ours: &[u8], torch: &[u8], to: Dtype) -> Option<String> {
        assert_eq!(ours.len(), torch.len(), "{from} → {to}: lengths");
        let (wi, wo) = ((from.bits() / 8) as usize, (to.bits() / 8) as usize);
        let bad = ours.chunks(wo).zip(torch.chunks(wo)).position(|(a, b)| a != b)?;
        Some(format!(
            "{from} → {to}: element {bad}: input {:02x?}, ours {:02x?}, torch {:02x?}",
            &input[bad * wi..][..wi],
            &ours[bad * wo..][..wo],
            &torch[bad * wo..][..wo]
        ))
    }

    #[test]
    fn every_fp8_byte_widens_and_narrows_as_torch() {
        let bytes = fixture();
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("fixture parses");
        let all: Vec<u8> = (0..=255u8).collect();
        let mut problems = Vec::new();
        for from in FP8 {
            for to in WIDE.into_iter().chain(FP8.into_iter().filter(|&d| d != from)) {
                let name = format!("fp8.{from}.to.{to}");
                let ours = cast(&all, from, to);
                problems.extend(first_diff(&all, from, &ours, tensor(&st, &name), to));
            }
        }
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn every_f16_and_bf16_pattern_and_the_f32_f64_sweep_narrow_as_torch() {
        let bytes = fixture();
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("fixture parses");
        let all16: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        let in32 = tensor(&st, "in.f32");
        let in64 = tensor(&st, "in.f64");
        assert!(in32.len() / 4 > 20_000 && in64.len() / 8 > 20_000, "the sweep is not empty");
        let mut problems = Vec::new();
        for to in FP8 {
            for (from, input) in
                [(Dtype::F16, &all16[..]), (Dtype::BF16, &all16[..]), (Dtype::F32, in32), (Dtype::F64, in64)]
            {
                let ours = cast(input, from, to);
                let torch = tensor(&st, &format!("{from}.to.{to}"));
                problems.extend(first_diff(input, from, &ours, torch, to));
            }
        }
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn round_trips_of_every_finite_fp8_value_are_exact() {
        let all: Vec<u8> = (0..=255u8).collect();
        for d in FP8 {
            for wide in WIDE {
                let back = cast(&cast(&all, d, wide), wide, d);
                for (b, r) in all.iter().zip(&back) {
                    let format = super::fp8::Format::of(d).expect("an FP8 dtype");
                    let v = f32::from_bits(super::fp8::to_f32(format, *b));
                    // f16 cannot hold e5m2fnuz's top binade or e8m0's extremes.
                    let outside_f16 =
                        wide == Dtype::F16 && (v.abs() > 65504.0 || (v != 0.0 && v.abs() < 2f32.powi(-24)));
                    if !v.is_nan() && !outside_f16 {
                        assert_eq!(r, b, "{d} {b:#04x} through {wide}");
                    }
                }
            }
        }
    }
}
