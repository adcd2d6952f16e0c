//! The closed sets of things that can be wrong with one input, for the [`super::Error`] variants
//! whose detail is one of a few cases: typed, so a caller can match on them, and worded once by
//! `Display` (the phrase each variant's message ends with).

use std::fmt;

use crate::read::dtype::Dtype;

/// Why a shard size does not parse ([`super::Error::BadSize`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SizeProblem {
    /// A byte count past `u64::MAX`.
    TooLarge,
    /// No unit after the number (or nothing at all).
    NoUnit,
    /// A unit that is not a decimal one.
    Unit {
        /// The unit as given.
        unit: String,
    },
    /// What precedes the unit is not a number.
    NotANumber {
        /// The text before the unit.
        number: String,
    },
    /// A negative, infinite or NaN number.
    Negative,
}

impl fmt::Display for SizeProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SizeProblem::TooLarge => write!(f, "number too large to fit in target type"),
            SizeProblem::NoUnit => write!(f, "expected a number followed by `KB`, `MB`, `GB` or `TB`"),
            SizeProblem::Unit { unit } => write!(
                f,
                "unit `{unit}` is not one of `KB`, `MB`, `GB`, `TB` (sizes are decimal: `5GB` is 5·10⁹ bytes)"
            ),
            SizeProblem::NotANumber { number } => write!(f, "`{number}` is not a number"),
            SizeProblem::Negative => write!(f, "the size must be a finite, non-negative number"),
        }
    }
}

/// Why an `hf://` address does not parse ([`super::Error::BadHubUrl`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HubUrlProblem {
    /// Not `hf://ORG/NAME[@REV][/PATH]`: an empty organisation or name.
    Shape,
    /// A push destination that is no `hf://` address.
    NotAPushTarget,
    /// An `@` with nothing after it.
    EmptyRevision,
    /// `@.` or `@..`.
    DotRevision,
    /// A path with a `..` component.
    DotDotPath,
    /// An `@REV` and a revision option that differ.
    RevisionsDiffer {
        /// The revision the address names.
        named: String,
        /// The revision option.
        option: String,
    },
    /// A revision that is no branch, tag or commit name (a `..`, an absolute path).
    BadRevision {
        /// The revision.
        revision: String,
    },
}

impl fmt::Display for HubUrlProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HubUrlProblem::Shape => write!(f, "expected `hf://ORG/NAME[@REV][/PATH]`"),
            HubUrlProblem::NotAPushTarget => write!(f, "a push goes to `hf://ORG/NAME[@BRANCH][/PATH]`"),
            HubUrlProblem::EmptyRevision => write!(f, "empty revision after `@`"),
            HubUrlProblem::DotRevision => write!(f, "`.` and `..` are no revision"),
            HubUrlProblem::DotDotPath => write!(f, "`..` is not allowed in the path"),
            HubUrlProblem::RevisionsDiffer { named, option } => {
                write!(f, "names revision `{named}` and the revision option `{option}`")
            }
            HubUrlProblem::BadRevision { revision } => {
                write!(f, "revision `{revision}` is not a branch, tag or commit name")
            }
        }
    }
}

/// What a downloaded file that is not what the Hub announced got wrong ([`super::Error::HubCorrupt`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HubCorruption {
    /// Another byte count than announced.
    Size {
        /// The bytes that arrived.
        got: u64,
        /// The bytes announced.
        announced: u64,
    },
    /// An LFS file whose SHA-256 is not its ETag.
    Sha256 {
        /// The SHA-256 of the bytes.
        found: String,
        /// The ETag.
        etag: String,
    },
    /// A git file whose blob id is not its ETag.
    GitBlob {
        /// The blob id of the bytes.
        found: String,
        /// The ETag.
        etag: String,
    },
}

impl fmt::Display for HubCorruption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HubCorruption::Size { got, announced } => {
                write!(f, "{got} bytes arrived where the Hub announced {announced}")
            }
            HubCorruption::Sha256 { found, etag } => {
                write!(f, "its SHA-256 is {found}, not {etag} as the Hub's ETag says")
            }
            HubCorruption::GitBlob { found, etag } => {
                write!(f, "its git blob id is {found}, not {etag} as the Hub's ETag says")
            }
        }
    }
}

/// What is wrong with a checksum manifest line ([`super::Error::BadManifest`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ManifestProblem {
    /// Shorter than a checksum.
    Shape,
    /// A checksum that is not 64 hex digits.
    NotHex,
    /// No `  ` or ` *` after the checksum.
    Separator,
    /// A file name that is not a plain name in the manifest's folder.
    NotPlainName,
}

impl fmt::Display for ManifestProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ManifestProblem::Shape => "expected `<sha256>  <file>`",
            ManifestProblem::NotHex => "the checksum is not 64 hex digits",
            ManifestProblem::Separator => "expected two spaces or ` *` after the checksum",
            ManifestProblem::NotPlainName => "the file name must be a plain name in the manifest's folder",
        })
    }
}

/// The JSON kind of a value that is not where a string (or object) was expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum JsonKind {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool,
    /// A number.
    Number,
    /// A string.
    String,
    /// An array.
    Array,
    /// An object.
    Object,
}

impl JsonKind {
    /// The kind of `v`.
    pub(crate) fn of(v: &serde_json::Value) -> JsonKind {
        match v {
            serde_json::Value::Null => JsonKind::Null,
            serde_json::Value::Bool(_) => JsonKind::Bool,
            serde_json::Value::Number(_) => JsonKind::Number,
            serde_json::Value::String(_) => JsonKind::String,
            serde_json::Value::Array(_) => JsonKind::Array,
            serde_json::Value::Object(_) => JsonKind::Object,
        }
    }
}

impl fmt::Display for JsonKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            JsonKind::Null => "null",
            JsonKind::Bool => "a boolean",
            JsonKind::Number => "a number",
            JsonKind::String => "a string",
            JsonKind::Array => "an array",
            JsonKind::Object => "an object",
        })
    }
}

/// What is wrong with a safetensors `__metadata__` ([`super::Error::BadMetadata`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetadataProblem {
    /// It is not an object.
    NotAnObject {
        /// What it is.
        found: JsonKind,
    },
    /// A value that is not a string.
    NotAString {
        /// The key.
        key: String,
        /// What its value is.
        found: JsonKind,
    },
}

impl fmt::Display for MetadataProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetadataProblem::NotAnObject { found } => write!(f, "expected an object, found {found}"),
            MetadataProblem::NotAString { key, found } => write!(f, "value of `{key}` is {found}"),
        }
    }
}

/// What is wrong with an FP8 weight's block scales ([`super::Error::BadBlockScale`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlockScaleProblem {
    /// The weight is FP8 but the checkpoint has no scales for it.
    Missing,
    /// The weight is not 2-D.
    WeightNot2d {
        /// The weight's shape.
        shape: Vec<u64>,
    },
    /// The scales' shape is not the weight's in blocks.
    Shape {
        /// The scales' shape.
        found: Vec<u64>,
        /// The weight's shape.
        weight: Vec<u64>,
        /// The block size.
        block: u64,
        /// The shape the scales need.
        want: Vec<u64>,
    },
    /// Scales that are not a wide float.
    Dtype {
        /// Their dtype.
        dtype: Dtype,
    },
}

impl fmt::Display for BlockScaleProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockScaleProblem::Missing => write!(f, "the weight is FP8 but the checkpoint has no such scales"),
            BlockScaleProblem::WeightNot2d { shape } => write!(f, "the weight has shape {shape:?}, not 2-D"),
            BlockScaleProblem::Shape { found, weight, block, want } => write!(
                f,
                "the scales have shape {found:?}, but a weight of shape {weight:?} in blocks of {block} needs {want:?}"
            ),
            BlockScaleProblem::Dtype { dtype } => write!(f, "the scales are {dtype}, not a wide float"),
        }
    }
}

/// What is wrong with a tensor handed to a save ([`super::Error::BadSaveTensor`]); `Display` gives the
/// phrase that follows the tensor's name.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SaveTensorProblem {
    /// The tensor's name appears twice in one save.
    NamedTwice,
    /// Its bytes are not what its shape and dtype hold (`holds` is `None` past 2^64 bytes).
    ByteLen {
        /// The bytes given.
        len: u64,
        /// Its shape.
        shape: Vec<u64>,
        /// Its dtype.
        dtype: Dtype,
        /// The bytes its shape and dtype hold.
        holds: Option<u64>,
    },
    /// A dtype the save cannot write.
    Dtype {
        /// The dtype.
        dtype: Dtype,
    },
    /// A row (every dim past the first) of more than 2^64 bytes.
    RowTooLarge,
    /// A 0-d tensor whose bytes are not one element's, or given at a row past 0.
    ScalarBytes {
        /// The bytes one element takes.
        row: u64,
        /// The bytes given.
        len: u64,
        /// The row the slice was given at.
        at: u64,
    },
    /// A slice whose bytes are not whole rows.
    PartialRows {
        /// The bytes given.
        len: u64,
        /// The bytes of one row.
        row: u64,
    },
    /// A slice whose rows reach past the tensor's first dim.
    RowsBeyond {
        /// The slice's first row.
        at: u64,
        /// Its rows.
        rows: u64,
        /// The tensor's rows.
        n0: u64,
    },
}

impl fmt::Display for SaveTensorProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SaveTensorProblem::NamedTwice => write!(f, "is named twice"),
            SaveTensorProblem::ByteLen { len, shape, dtype, holds } => {
                let holds = holds.map_or_else(|| "more than 2^64".to_string(), |w| w.to_string());
                write!(f, "has {len} bytes, but shape {shape:?} of `{}` holds {holds}", dtype.safetensors_name())
            }
            SaveTensorProblem::Dtype { dtype } => write!(f, "has dtype `{dtype}`, which cannot be saved"),
            SaveTensorProblem::RowTooLarge => write!(f, "has rows of more than 2^64 bytes"),
            SaveTensorProblem::ScalarBytes { row, len, at } => {
                write!(f, "is 0-d and holds {row} bytes, not {len} at row {at}")
            }
            SaveTensorProblem::PartialRows { len, row } => write!(f, "has {len} bytes, not whole rows of {row} bytes"),
            SaveTensorProblem::RowsBeyond { at, rows, n0 } => {
                write!(f, "has rows {at}..+{rows}, beyond its {n0} rows")
            }
        }
    }
}
