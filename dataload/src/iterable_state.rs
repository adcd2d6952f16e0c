//! The saved position of an iterable loader (the Python package's `"statekit.iterable"` state).
//!
//! ```json
//! {"format": "statekit.iterable", "version": 1, "epoch": 2, "batches": 5}
//! ```
//!
//! `epoch` is accelerate's `iteration`, `batches` the batches of it this rank was handed. A
//! stream has no position to compute, so this header is all `dataload` reads: the Python
//! loader adds a `"stream"` entry beside it (the dataset's own torchdata state, and the first
//! chunk an `IterableDatasetShard` pads with), which holds Python objects and stays there.
//! States written before the header had a version have none; they read as version 1.

use serde_json::{json, Value};

use crate::error::{DataloadError, Result};

/// Value of an iterable loader state's `format` field.
pub const ITERABLE_STATE_FORMAT: &str = "statekit.iterable";
/// The iterable loader state version this build writes and reads.
pub const ITERABLE_STATE_VERSION: u32 = 1;

/// The largest count a state may hold: what Python's `len` and torch's indices count.
const MAX_COUNT: u64 = i64::MAX as u64;

/// An iterable loader's position: the epoch, and the batches of it handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IterableState {
    /// accelerate's `iteration`: the epoch being read.
    pub epoch: u64,
    /// Batches of the epoch this rank was handed.
    pub batches: u64,
}

impl IterableState {
    /// The state's fields as JSON (format and version first).
    pub fn to_json(&self) -> String {
        json!({
            "format": ITERABLE_STATE_FORMAT,
            "version": ITERABLE_STATE_VERSION,
            "epoch": self.epoch,
            "batches": self.batches,
        })
        .to_string()
    }

    /// Parses the state's fields (other keys are the caller's), refusing another format, an
    /// unknown version and counts that are not ints in `[0, 2^63 - 1]`.
    pub fn from_json(text: &str) -> Result<Self> {
        let malformed = |reason: String| DataloadError::MalformedState { reason };
        let value: Value = serde_json::from_str(text).map_err(|e| malformed(e.to_string()))?;
        if value.get("format").and_then(Value::as_str) != Some(ITERABLE_STATE_FORMAT) {
            return Err(malformed(format!(
                "not an iterable loader state (its `format` is not `{ITERABLE_STATE_FORMAT}`)"
            )));
        }
        match value.get("version") {
            None => {}
            Some(v) => match v.as_u64() {
                Some(v) if v == u64::from(ITERABLE_STATE_VERSION) => {}
                Some(v) => {
                    return Err(DataloadError::UnsupportedVersion {
                        found: u32::try_from(v).unwrap_or(u32::MAX),
                        supported: ITERABLE_STATE_VERSION,
                    })
                }
                None => return Err(malformed(format!("`version` must be an int, not {v}"))),
            },
        }
        let count = |name: &str| {
            let v = value.get(name).unwrap_or(&Value::Null);
            v.as_u64()
                .filter(|&n| n <= MAX_COUNT)
                .ok_or_else(|| malformed(format!("`{name}` must be an int in [0, 2^63 - 1], not {v}")))
        };
        Ok(Self { epoch: count("epoch")?, batches: count("batches")? })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let s = IterableState { epoch: 2, batches: 5 };
        assert_eq!(s.to_json(), r#"{"format":"statekit.iterable","version":1,"epoch":2,"batches":5}"#);
        assert_eq!(IterableState::from_json(&s.to_json()).unwrap(), s);
    }

    #[test]
    fn a_state_without_version_is_version_1() {
        let s = IterableState::from_json(r#"{"format": "statekit.iterable", "epoch": 0, "batches": 3}"#).unwrap();
        assert_eq!(s, IterableState { epoch: 0, batches: 3 });
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        for (text, want) in [
            (
                r#"{"format": "statekit.dataload"}"#,
                "malformed loader state: not an iterable loader state (its `format` is not `statekit.iterable`)",
            ),
            ("null", "malformed loader state: not an iterable loader state (its `format` is not `statekit.iterable`)"),
            (
                r#"{"format": "statekit.iterable", "version": 2, "epoch": 0, "batches": 0}"#,
                "unsupported loader state version 2 (this build reads version 1)",
            ),
            (
                r#"{"format": "statekit.iterable", "epoch": -1, "batches": 0}"#,
                "malformed loader state: `epoch` must be an int in [0, 2^63 - 1], not -1",
            ),
            (
                r#"{"format": "statekit.iterable", "epoch": 0, "batches": 9223372036854775808}"#,
                "malformed loader state: `batches` must be an int in [0, 2^63 - 1], not 9223372036854775808",
            ),
            (
                r#"{"format": "statekit.iterable", "epoch": true, "batches": 0}"#,
                "malformed loader state: `epoch` must be an int in [0, 2^63 - 1], not true",
            ),
            (
                r#"{"format": "statekit.iterable", "epoch": 0}"#,
                "malformed loader state: `batches` must be an int in [0, 2^63 - 1], not null",
            ),
        ] {
            assert_eq!(IterableState::from_json(text).unwrap_err().to_string(), want, "{text}");
        }
    }
}
