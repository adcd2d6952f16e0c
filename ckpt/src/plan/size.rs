//! Shard sizes written the way huggingface_hub reads them.
//!
//! `"5GB"` is 5·10⁹ bytes: units are decimal (`KB`, `MB`, `GB`, `TB`), matched on the last two
//! characters case-insensitively, with a decimal number before them (`"1.5gb"`). A bare integer
//! is a byte count, as the Python API's integer argument is.

use crate::error::{Error, Result, SizeProblem};

/// huggingface_hub's default `max_shard_size`.
pub const DEFAULT_MAX_SHARD_SIZE: &str = "5GB";

/// Parses a shard size into bytes.
pub fn parse_size(input: &str) -> Result<u64> {
    let bad = |problem| Error::BadSize { input: input.to_string(), problem };
    let s = input.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        // All digits: only a count past `u64::MAX` fails.
        return s.parse().map_err(|_| bad(SizeProblem::TooLarge));
    }
    if !s.is_ascii() || s.len() < 2 {
        return Err(bad(SizeProblem::NoUnit));
    }
    let (number, unit) = s.split_at(s.len() - 2);
    let multiplier: f64 = match unit.to_ascii_uppercase().as_str() {
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        other => return Err(bad(SizeProblem::Unit { unit: other.to_string() })),
    };
    let value: f64 =
        number.trim().parse().map_err(|_| bad(SizeProblem::NotANumber { number: number.trim().to_string() }))?;
    if !value.is_finite() || value < 0.0 {
        return Err(bad(SizeProblem::Negative));
    }
    // Python computes `int(value * multiplier)`: a float product truncated toward zero.
    Ok((value * multiplier) as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn decimal_units_like_huggingface_hub() {
        assert_eq!(parse_size("5GB").ok(), Some(5_000_000_000));
        assert_eq!(parse_size("1.5gb").ok(), Some(1_500_000_000));
        assert_eq!(parse_size(" 10 MB ").ok(), Some(10_000_000));
        assert_eq!(parse_size("0.1KB").ok(), Some(100));
        assert_eq!(parse_size("2TB").ok(), Some(2_000_000_000_000));
        assert_eq!(parse_size("1234").ok(), Some(1234));
    }

    #[test]
    fn refusals_name_the_input() {
        for bad in ["5GiB", "GB", "x", "-1GB", "nanGB", "", "5 G B"] {
            let err = parse_size(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.starts_with(&format!("invalid size `{bad}`")), "{bad}: {err}");
        }
    }
}
