//! Element types, named the way safetensors names them.
//!
//! The declaration order matters: safetensors writes tensors sorted by dtype from the last
//! variant to the first (widest alignment first), then by name, so that every tensor stays
//! naturally aligned. `Ord` follows the declaration order to reproduce that layout exactly.

use std::fmt;

/// The dtype of a tensor's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Dtype {
    /// `bool`, one byte.
    Bool,
    /// 4-bit float (e2m1), packed two per byte.
    F4,
    /// 6-bit float (e2m3).
    F6E2M3,
    /// 6-bit float (e3m2).
    F6E3M2,
    /// `uint8`.
    U8,
    /// `int8`.
    I8,
    /// `float8_e5m2`.
    F8E5M2,
    /// `float8_e4m3fn`.
    F8E4M3,
    /// `float8_e8m0fnu` (a power-of-two scale).
    F8E8M0,
    /// `float8_e4m3fnuz`.
    F8E4M3Fnuz,
    /// `float8_e5m2fnuz`.
    F8E5M2Fnuz,
    /// `int16`.
    I16,
    /// `uint16`.
    U16,
    /// IEEE half, `float16`.
    F16,
    /// `bfloat16`.
    BF16,
    /// `int32`.
    I32,
    /// `uint32`.
    U32,
    /// `float32`.
    F32,
    /// `complex64`: two `float32`.
    C64,
    /// `float64`.
    F64,
    /// `int64`.
    I64,
    /// `uint64`.
    U64,
    /// complex128: a torch dtype that safetensors cannot store. Not in [`Dtype::ALL`], which
    /// lists the safetensors dtypes.
    C128,
}

impl Dtype {
    /// Every dtype, in declaration order.
    pub const ALL: [Dtype; 22] = [
        Dtype::Bool,
        Dtype::F4,
        Dtype::F6E2M3,
        Dtype::F6E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E5M2,
        Dtype::F8E4M3,
        Dtype::F8E8M0,
        Dtype::F8E4M3Fnuz,
        Dtype::F8E5M2Fnuz,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// The name safetensors uses in its header.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6E2M3 => "F6_E2M3",
            Dtype::F6E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::F8E4M3Fnuz => "F8_E4M3FNUZ",
            Dtype::F8E5M2Fnuz => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::C128 => "C128",
        }
    }

    /// True for the dtypes a safetensors file can hold.
    pub fn in_safetensors(self) -> bool {
        Dtype::ALL.contains(&self)
    }

    /// Parses a safetensors dtype name; `None` for a name safetensors does not define.
    pub fn from_safetensors_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.safetensors_name() == name)
    }

    /// torch's name for the dtype (`float8_e4m3fn`, `bfloat16`, ...), without `torch.`.
    pub fn torch_name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::F4 => "float4_e2m1fn_x2",
            Dtype::F6E2M3 => "float6_e2m3",
            Dtype::F6E3M2 => "float6_e3m2",
            Dtype::U8 => "uint8",
            Dtype::I8 => "int8",
            Dtype::F8E5M2 => "float8_e5m2",
            Dtype::F8E4M3 => "float8_e4m3fn",
            Dtype::F8E8M0 => "float8_e8m0fnu",
            Dtype::F8E4M3Fnuz => "float8_e4m3fnuz",
            Dtype::F8E5M2Fnuz => "float8_e5m2fnuz",
            Dtype::I16 => "int16",
            Dtype::U16 => "uint16",
            Dtype::F16 => "float16",
            Dtype::BF16 => "bfloat16",
            Dtype::I32 => "int32",
            Dtype::U32 => "uint32",
            Dtype::F32 => "float32",
            Dtype::C64 => "complex64",
            Dtype::F64 => "float64",
            Dtype::I64 => "int64",
            Dtype::U64 => "uint64",
            Dtype::C128 => "complex128",
        }
    }

    /// True for the floating-point dtypes a cast can produce and read (f64, f32, f16, bf16 and
    /// the five FP8 dtypes), with the bits torch's `.to(dtype)` gives on CPU.
    pub fn is_castable(self) -> bool {
        // The cast module implements exactly these (a test there checks the two agree).
        matches!(
            self,
            Dtype::F64
                | Dtype::F32
                | Dtype::F16
                | Dtype::BF16
                | Dtype::F8E4M3
                | Dtype::F8E5M2
                | Dtype::F8E4M3Fnuz
                | Dtype::F8E5M2Fnuz
                | Dtype::F8E8M0
        )
    }

    /// Size of one element in bits (4 and 6 for the sub-byte float formats).
    pub fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6E2M3 | Dtype::F6E3M2 => 6,
            Dtype::Bool
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8E5M2
            | Dtype::F8E4M3
            | Dtype::F8E8M0
            | Dtype::F8E4M3Fnuz
            | Dtype::F8E5M2Fnuz => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
            Dtype::C128 => 128,
        }
    }

    /// Bytes needed by `numel` elements, or `None` on overflow or when the bit count is not a
    /// whole number of bytes (safetensors refuses such tensors too).
    pub fn byte_len(self, numel: u64) -> Option<u64> {
        let bits = numel.checked_mul(self.bits())?;
        (bits % 8 == 0).then_some(bits / 8)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.safetensors_name())
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;

    /// A dtype the way a user writes it: safetensors' name (`F8_E4M3`, `BF16`, case ignored),
    /// torch's (`float8_e4m3fn`, `torch.bfloat16`), or a short float name (`f32`, `f16`,
    /// `bf16`, `f64`, case ignored). The one parser of dtypes for every edge.
    fn from_str(name: &str) -> Result<Dtype, String> {
        let bare = name.strip_prefix("torch.").unwrap_or(name);
        let short = match bare.to_ascii_lowercase().as_str() {
            "f64" | "fp64" | "double" => Some(Dtype::F64),
            "f32" | "fp32" | "float" => Some(Dtype::F32),
            "f16" | "fp16" | "half" => Some(Dtype::F16),
            "bf16" => Some(Dtype::BF16),
            _ => None,
        };
        short
            .or_else(|| Dtype::from_safetensors_name(&bare.to_ascii_uppercase()))
            .or_else(|| Dtype::ALL.into_iter().chain([Dtype::C128]).find(|d| d.torch_name() == bare))
            .ok_or_else(|| format!("unknown dtype `{}`", crate::escape_controls(name)))
    }
}

#[cfg(test)]
mod tests {
    use super::Dtype;

    #[test]
    fn names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_safetensors_name(d.safetensors_name()), Some(d));
        }
        assert_eq!(Dtype::from_safetensors_name("F128"), None);
    }

    #[test]
    fn user_names_parse() {
        let parse = |s: &str| s.parse::<Dtype>().ok();
        for d in Dtype::ALL {
            assert_eq!(parse(d.safetensors_name()), Some(d));
            assert_eq!(parse(d.torch_name()), Some(d));
            assert_eq!(parse(&format!("torch.{}", d.torch_name())), Some(d));
        }
        assert_eq!(parse("float8_e4m3fn"), Some(Dtype::F8E4M3));
        assert_eq!(parse("F8_E5M2"), Some(Dtype::F8E5M2));
        assert_eq!(parse("bf16"), Some(Dtype::BF16));
        assert_eq!(parse("F16"), Some(Dtype::F16));
        assert_eq!(parse("float8"), None);
        assert_eq!(parse("bf16"), parse("BF16"));
        assert_eq!(parse("f8_e4m3"), Some(Dtype::F8E4M3));
        let castable: Vec<Dtype> = Dtype::ALL.into_iter().filter(|d| d.is_castable()).collect();
        assert_eq!(castable.len(), 9);
    }

    #[test]
    fn order_matches_the_safetensors_crate() {
        // The on-disk order safetensors writes depends on this; pin it against the crate itself.
        let ours: Vec<String> = Dtype::ALL.iter().map(|d| d.safetensors_name().to_string()).collect();
        let mut theirs: Vec<safetensors::Dtype> = ours
            .iter()
            .map(|n| serde_json::from_value(serde_json::Value::String(n.clone())).expect("known dtype"))
            .collect();
        theirs.sort();
        let theirs: Vec<String> = theirs
            .iter()
            .map(|d| serde_json::to_value(d).expect("serializes").as_str().expect("string").to_string())
            .collect();
        assert_eq!(ours, theirs);
        for d in Dtype::ALL {
            let t: safetensors::Dtype =
                serde_json::from_value(serde_json::Value::String(d.safetensors_name().into())).expect("known");
            assert_eq!(d.bits() as usize, t.bitsize(), "{d}");
        }
    }
}
