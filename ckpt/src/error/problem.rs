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
    /// A dtype another rank named that this build does not know.
    UnknownDtype {
        /// The name it sent.
        name: String,
    },
    /// An entry two ranks gave with other dtypes or shapes, or as a tensor and as a value.
    DiffersAcrossRanks,
    /// A non-tensor value two ranks both gave.
    ValueOnTwoRanks,
    /// Rows `from..to` that two ranks both gave.
    RowsOnTwoRanks {
        /// The first of them.
        from: u64,
        /// Past the last.
        to: u64,
    },
    /// Rows `from..to` that no rank gave.
    RowsOnNoRank {
        /// The first of them.
        from: u64,
        /// Past the last.
        to: u64,
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
            SaveTensorProblem::UnknownDtype { name } => write!(f, "has unknown dtype `{name}`"),
            SaveTensorProblem::DiffersAcrossRanks => write!(f, "has another dtype, shape or kind than on another rank"),
            SaveTensorProblem::ValueOnTwoRanks => write!(f, "is a value saved by two ranks"),
            SaveTensorProblem::RowsOnTwoRanks { from, to } => write!(f, "has rows {from}..{to} on two ranks"),
            SaveTensorProblem::RowsOnNoRank { from, to } => write!(f, "has rows {from}..{to} on no rank"),
        }
    }
}

/// What is wrong with a sharded checkpoint's index ([`super::Error::BadIndex`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IndexProblem {
    /// Not JSON: what the JSON parser said (its words, with the line and column).
    NotJson {
        /// The parser's message.
        parser: String,
    },
    /// JSON, but not an object.
    NotAnObject,
    /// A `metadata` that is not an object.
    MetadataNotAnObject,
    /// No `weight_map` object.
    NoWeightMap,
    /// A `weight_map` that lists one tensor twice.
    ListedTwice {
        /// The tensor.
        tensor: String,
    },
    /// A `weight_map` entry whose file is not a string.
    FileNotAString {
        /// The tensor.
        tensor: String,
    },
}

impl fmt::Display for IndexProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IndexProblem::NotJson { parser } => write!(f, "not JSON: {parser}"),
            IndexProblem::NotAnObject => write!(f, "expected a JSON object"),
            IndexProblem::MetadataNotAnObject => write!(f, "`metadata` must be an object"),
            IndexProblem::NoWeightMap => write!(f, "`weight_map` is missing or not an object"),
            IndexProblem::ListedTwice { tensor } => write!(f, "`weight_map` lists tensor `{tensor}` twice"),
            IndexProblem::FileNotAString { tensor } => write!(f, "`weight_map` entry `{tensor}` is not a string"),
        }
    }
}

/// What is wrong with a tensor's entry in a catalog ([`super::Error::BadTensorEntry`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EntryProblem {
    /// A safetensors header entry that does not parse: what the JSON parser said.
    NotParsed {
        /// The parser's message.
        parser: String,
    },
    /// A shape whose element count overflows, or whose bytes are no whole number (a safetensors
    /// entry, which names its dtype).
    ShapeBytes {
        /// The shape.
        shape: Vec<u64>,
        /// The dtype.
        dtype: Dtype,
    },
    /// A shape whose byte count overflows.
    ShapeOverflows {
        /// The shape.
        shape: Vec<u64>,
    },
    /// A byte range in a source file the checkpoint does not have.
    UnknownFile,
    /// A byte range past the end of its file.
    PastFile {
        /// Where the range starts.
        start: u64,
        /// Where it ends (saturated).
        end: u64,
        /// The file's length.
        file_len: u64,
    },
    /// Byte ranges whose lengths overflow when summed.
    CountOverflows,
    /// Byte ranges that hold another count than the shape needs.
    ByteCount {
        /// The bytes the ranges hold.
        total: u64,
        /// The bytes the shape needs.
        need: u64,
    },
}

impl fmt::Display for EntryProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntryProblem::NotParsed { parser } => f.write_str(parser),
            EntryProblem::ShapeBytes { shape, dtype } => {
                write!(f, "shape {shape:?} of `{dtype}` overflows or is not a whole number of bytes")
            }
            EntryProblem::ShapeOverflows { shape } => write!(f, "shape {shape:?} overflows"),
            EntryProblem::UnknownFile => write!(f, "names an unknown source file"),
            EntryProblem::PastFile { start, end, file_len } => {
                write!(f, "bytes {start}..{end} lie past the end of the {file_len}-byte file")
            }
            EntryProblem::CountOverflows => write!(f, "byte count overflows"),
            EntryProblem::ByteCount { total, need } => write!(f, "holds {total} bytes, its shape needs {need}"),
        }
    }
}

/// What is wrong with a tensor of a torch file ([`super::Error::BadTorchTensor`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TorchTensorProblem {
    /// Its storage's record is not in the archive.
    MissingRecord {
        /// The record's name.
        record: String,
    },
    /// Its storage's record is compressed, so it cannot be read in place.
    CompressedRecord {
        /// The record's name.
        record: String,
    },
    /// Its storage is not in the file (a legacy file).
    MissingStorage {
        /// The storage's key.
        key: String,
    },
    /// Its storage was not kept while the file was read.
    StorageVanished,
    /// A storage whose declared size is not its record's.
    StorageSize {
        /// The storage's key.
        key: String,
        /// The elements it declares.
        numel: u64,
        /// The bytes of one element.
        elem: u64,
        /// The bytes its record holds.
        len: u64,
    },
    /// A dtype of less than a byte per element.
    Dtype {
        /// The dtype.
        dtype: Dtype,
    },
    /// A view that reaches past its storage.
    PastStorage {
        /// The view's offset, in elements.
        offset: u64,
        /// Its shape.
        shape: Vec<u64>,
        /// Its strides.
        strides: Vec<u64>,
        /// The storage's length in bytes.
        len: u64,
        /// The storage's key.
        key: String,
    },
}

impl fmt::Display for TorchTensorProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TorchTensorProblem::MissingRecord { record } => write!(f, "its storage record `{record}` is missing"),
            TorchTensorProblem::CompressedRecord { record } => {
                write!(f, "storage record `{record}` is compressed; only stored records can be read in place")
            }
            TorchTensorProblem::MissingStorage { key } => write!(f, "its storage `{key}` is not in the file"),
            TorchTensorProblem::StorageVanished => write!(f, "storage vanished"),
            TorchTensorProblem::StorageSize { key, numel, elem, len } => {
                write!(f, "storage `{key}` declares {numel} elements of {elem} bytes but its record holds {len} bytes")
            }
            TorchTensorProblem::Dtype { dtype } => write!(f, "dtype `{dtype}` is not supported"),
            TorchTensorProblem::PastStorage { offset, shape, strides, len, key } => write!(
                f,
                "offset {offset} with shape {shape:?} and strides {strides:?} reaches past its {len}-byte storage `{key}`"
            ),
        }
    }
}

/// What is wrong with a box of a tensor ([`super::Error::BadBox`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BoxProblem {
    /// The box's storage reaches past the end of its file.
    StoragePastFile {
        /// Where the box sits in the tensor.
        offsets: Vec<u64>,
    },
    /// Another number of strides than dims.
    StrideCount {
        /// Where the box sits in the tensor.
        offsets: Vec<u64>,
        /// Its strides.
        strides: usize,
        /// Its dims.
        dims: usize,
    },
    /// The box's strided view reaches past its storage.
    ViewPastStorage {
        /// Where the box sits in the tensor.
        offsets: Vec<u64>,
    },
    /// The boxes do not tile the tensor.
    Tiling(fsdp_state::TilingError),
    /// A DCP safetensors shard whose sharding info has no `saved_offsets` list for the tensor.
    NoSavedOffsets,
    /// A `saved_offsets` entry that is not an offset.
    NotAnOffset {
        /// The entry, as JSON.
        value: String,
    },
    /// `saved_offsets` of another rank than the tensor's shape.
    OffsetDims {
        /// The offsets.
        offsets: Vec<u64>,
        /// The tensor's shape in this shard.
        shape: Vec<u64>,
    },
    /// A tensor that two shards place in different output files.
    OutputFileDiffers {
        /// Its output file here (from 1).
        index: u64,
        /// Of how many.
        of: u64,
        /// Its output file in another shard.
        other_index: u64,
        /// Of how many, there.
        other_of: u64,
    },
    /// A tensor that the sharding info lists but the shard does not hold.
    NotInFile,
    /// A box with another number of dims than another shard's box of the tensor.
    DimsDiffer {
        /// Its dims.
        dims: usize,
        /// The other box's.
        other: usize,
    },
}

impl fmt::Display for BoxProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key DCP's Hugging Face storage keeps its sharding info under.
        const SHARDING_KEY: &str = "DCP_SHARDING_INFO";
        match self {
            BoxProblem::StoragePastFile { offsets } => {
                write!(f, "the storage of the box at offsets {offsets:?} lies past the end of the file")
            }
            BoxProblem::StrideCount { offsets, strides, dims } => {
                write!(f, "the box at offsets {offsets:?} has {strides} strides for {dims} dims")
            }
            BoxProblem::ViewPastStorage { offsets } => {
                write!(f, "the view of the box at offsets {offsets:?} reaches past its storage")
            }
            BoxProblem::Tiling(e) => write!(f, "{e}"),
            BoxProblem::NoSavedOffsets => write!(f, "`{SHARDING_KEY}` has no `saved_offsets` list for it"),
            BoxProblem::NotAnOffset { value } => write!(f, "`saved_offsets` holds {value}, not an offset"),
            BoxProblem::OffsetDims { offsets, shape } => write!(
                f,
                "`saved_offsets` {offsets:?} has {} dims, its shape {shape:?} has {}",
                offsets.len(),
                shape.len()
            ),
            BoxProblem::OutputFileDiffers { index, of, other_index, other_of } => {
                write!(f, "it is in output file {index} of {of} here and {other_index} of {other_of} in another shard")
            }
            BoxProblem::NotInFile => write!(f, "`{SHARDING_KEY}` lists it but the file holds no such tensor"),
            BoxProblem::DimsDiffer { dims, other } => {
                write!(f, "its box has {dims} dims where another shard's has {other}")
            }
        }
    }
}

/// What is wrong with a zip archive ([`super::Error::BadZip`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ZipProblem {
    /// A central directory over the limits on its entries or bytes.
    DirectoryTooLarge {
        /// Its entries.
        count: u64,
        /// Its bytes.
        size: u64,
    },
    /// A central directory entry that does not parse.
    BadCentralEntry {
        /// Its offset in the central directory.
        at: usize,
    },
    /// A record that runs past the end of the file.
    PastFile {
        /// Where it starts.
        offset: u64,
        /// Its bytes.
        len: u64,
        /// The file's length.
        file_len: u64,
    },
    /// A record larger than memory can address.
    RecordTooLarge,
    /// No end-of-central-directory record.
    NoEndRecord,
    /// An end record cut short.
    TruncatedEndRecord,
    /// No zip64 end record where its locator points.
    NoZip64EndRecord {
        /// Where the locator points.
        at: u64,
    },
    /// An entry without its local header.
    NoLocalHeader {
        /// The entry's name.
        entry: String,
        /// Where its header should be.
        at: u64,
    },
    /// An entry compressed with a method other than stored or deflate.
    CompressionMethod {
        /// The entry's name.
        entry: String,
        /// The method.
        method: u16,
    },
    /// A stored entry whose compressed and plain sizes differ.
    StoredSizes {
        /// The entry's name.
        entry: String,
        /// Its compressed size.
        compressed: u64,
        /// Its plain size.
        size: u64,
    },
    /// Two entries whose bytes overlap.
    Overlap {
        /// The first entry.
        first: String,
        /// The second.
        second: String,
    },
    /// A deflate stream that does not inflate.
    CorruptDeflate {
        /// The entry's name.
        entry: String,
        /// What the inflater said, as its status enum names it.
        status: String,
    },
}

impl fmt::Display for ZipProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZipProblem::DirectoryTooLarge { count, size } => {
                write!(f, "central directory of {count} entries and {size} bytes is over the limit")
            }
            ZipProblem::BadCentralEntry { at } => write!(f, "bad central entry at byte {at}"),
            ZipProblem::PastFile { offset, len, file_len } => {
                write!(f, "a record at byte {offset} of {len} bytes runs past the end of the {file_len}-byte file")
            }
            ZipProblem::RecordTooLarge => write!(f, "record too large"),
            ZipProblem::NoEndRecord => write!(f, "no end-of-central-directory record"),
            ZipProblem::TruncatedEndRecord => write!(f, "truncated end record"),
            ZipProblem::NoZip64EndRecord { at } => write!(f, "zip64 end record expected at byte {at}"),
            ZipProblem::NoLocalHeader { entry, at } => write!(f, "`{entry}`: no local header at byte {at}"),
            ZipProblem::CompressionMethod { entry, method } => {
                write!(f, "`{entry}`: unsupported compression method {method}")
            }
            ZipProblem::StoredSizes { entry, compressed, size } => {
                write!(f, "`{entry}`: stored entry with {compressed} compressed and {size} plain bytes")
            }
            ZipProblem::Overlap { first, second } => write!(f, "entries `{first}` and `{second}` overlap"),
            ZipProblem::CorruptDeflate { entry, status } => write!(f, "`{entry}`: corrupt deflate stream ({status})"),
        }
    }
}

/// Why a safetensors header is not JSON object text ([`super::Error::BadHeaderJson`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderJsonProblem {
    /// The bytes are not UTF-8.
    NotUtf8(std::str::Utf8Error),
    /// Not JSON, or a header that cannot be serialised: what the JSON parser (or serialiser)
    /// said, in its words, with the line and column.
    Json {
        /// The parser's message.
        parser: String,
    },
}

impl HeaderJsonProblem {
    /// The problem serde_json found.
    pub(crate) fn json(e: &serde_json::Error) -> HeaderJsonProblem {
        HeaderJsonProblem::Json { parser: e.to_string() }
    }
}

impl fmt::Display for HeaderJsonProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderJsonProblem::NotUtf8(e) => write!(f, "not UTF-8 ({e})"),
            HeaderJsonProblem::Json { parser } => f.write_str(parser),
        }
    }
}

/// What is wrong with a DCP item ([`super::Error::BadDcpChunk`]). Where another reader of this
/// crate found the problem (the zip reader, the value walker), its words come along as `cause`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChunkProblem {
    /// The data file is not a plain file.
    NotAPlainFile,
    /// The item runs past the end of its data file.
    PastFile {
        /// Where the item starts.
        at: u64,
        /// Its bytes.
        len: u64,
        /// The data file's length.
        file_len: u64,
    },
    /// The item is not a zip archive.
    NotAnArchive {
        /// Where the item starts.
        at: u64,
        /// What the zip reader said.
        cause: String,
    },
    /// The item's archive has no `data.pkl`.
    NoDataPkl {
        /// Where the item starts.
        at: u64,
    },
    /// The item's `data.pkl` cannot be read: what the zip reader said.
    Unreadable {
        /// What the zip reader said.
        cause: String,
    },
    /// The item's pickle does not decode.
    Pickle {
        /// The pickle's record.
        record: String,
        /// Where the item starts.
        at: u64,
        /// The byte of the pickle where decoding stopped.
        byte: usize,
        /// What the pickle reader said.
        cause: String,
    },
    /// A non-tensor item whose value cannot be read: what the value walker said.
    Value {
        /// Where the item starts.
        at: u64,
        /// What the value walker said.
        cause: String,
    },
    /// A tensor inside a non-tensor item that cannot be located.
    ValueTensor {
        /// Where the item starts.
        at: u64,
        /// The tensor's path in the value.
        name: String,
        /// Why.
        cause: Box<ChunkProblem>,
    },
    /// A tensor item that does not hold a tensor.
    NotATensor {
        /// Where the item starts.
        at: u64,
    },
    /// A tensor item of another shape than its chunk.
    Shape {
        /// Where the item starts.
        at: u64,
        /// The shape it holds.
        shape: Vec<u64>,
        /// The chunk's offsets.
        offsets: Vec<u64>,
        /// The chunk's sizes.
        sizes: Vec<u64>,
    },
    /// A storage record the item's tensor names that is not in its archive.
    NoStorageRecord {
        /// Where the item starts.
        at: u64,
        /// The record.
        record: String,
    },
    /// A compressed storage record (only stored records can be read in place).
    CompressedStorage {
        /// Where the item starts.
        at: u64,
        /// The record.
        record: String,
    },
    /// A storage record of another size than its storage declares.
    StorageSize {
        /// Where the item starts.
        at: u64,
        /// The record.
        record: String,
        /// The elements the storage declares.
        numel: u64,
        /// The record's bytes.
        size: u64,
    },
    /// A dtype of less than a byte per element.
    Dtype {
        /// The dtype.
        dtype: Dtype,
    },
}

impl fmt::Display for ChunkProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChunkProblem::NotAPlainFile => write!(f, "its data file is not a plain file"),
            ChunkProblem::PastFile { at, len, file_len } => {
                write!(f, "item at byte {at} of {len} bytes runs past the end of the {file_len}-byte file")
            }
            ChunkProblem::NotAnArchive { at, cause } => {
                write!(f, "item at byte {at} is not a `torch.save` archive: {cause}")
            }
            ChunkProblem::NoDataPkl { at } => write!(f, "item at byte {at} has no `data.pkl` record"),
            ChunkProblem::Unreadable { cause } => f.write_str(cause),
            ChunkProblem::Pickle { record, at, byte, cause } => {
                write!(f, "`{record}` of the item at byte {at}: byte {byte}: {cause}")
            }
            ChunkProblem::Value { at, cause } => write!(f, "non-tensor item at byte {at}: {cause}"),
            ChunkProblem::ValueTensor { at, name, cause } => {
                write!(f, "non-tensor item at byte {at}: tensor `{name}` in it: {cause}")
            }
            ChunkProblem::NotATensor { at } => write!(f, "the item at byte {at} does not hold a tensor"),
            ChunkProblem::Shape { at, shape, offsets, sizes } => write!(
                f,
                "the item at byte {at} holds shape {shape:?} where the chunk at offsets {offsets:?} has sizes {sizes:?}"
            ),
            ChunkProblem::NoStorageRecord { at, record } => {
                write!(f, "the item at byte {at} has no storage record `{record}`")
            }
            ChunkProblem::CompressedStorage { at, record } => {
                write!(f, "storage record `{record}` of the item at byte {at} is compressed")
            }
            ChunkProblem::StorageSize { at, record, numel, size } => {
                write!(
                    f,
                    "storage `{record}` of the item at byte {at} declares {numel} elements but holds {size} bytes"
                )
            }
            ChunkProblem::Dtype { dtype } => write!(f, "dtype `{dtype}` is not supported"),
        }
    }
}

/// What is wrong with a Hugging Face `config.json` ([`super::Error::BadHfConfig`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HfConfigProblem {
    /// The folder has no `config.json`.
    NoConfig,
    /// The file is not JSON.
    NotJson {
        /// The parser's words.
        cause: String,
    },
    /// A setting the model needs is absent.
    Missing,
    /// A setting that must be a whole number is not.
    NotANumber {
        /// The value as JSON.
        found: String,
    },
    /// `model_type` names no family of the tables.
    UnknownFamily {
        /// The `model_type`.
        found: String,
        /// The families read.
        known: String,
    },
    /// An activation other than SiLU.
    Activation {
        /// The `hidden_act`.
        found: String,
    },
    /// A setting turned on that megatron's layout of the family has no place for.
    NoPlace {
        /// The family.
        family: &'static str,
    },
    /// Key/value heads that do not divide the attention heads (or none).
    Heads {
        /// The `num_key_value_heads` (or `num_attention_heads`).
        found: u64,
    },
    /// A weights dtype that is not a float.
    Dtype {
        /// The dtype named.
        found: String,
    },
}

impl fmt::Display for HfConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HfConfigProblem::NoConfig => {
                write!(f, "is missing: a Hugging Face folder's `config.json` says what the model is")
            }
            HfConfigProblem::NotJson { cause } => write!(f, "is not JSON: {cause}"),
            HfConfigProblem::Missing => write!(f, "is missing"),
            HfConfigProblem::NotANumber { found } => write!(f, "is {found}, not a whole number"),
            HfConfigProblem::UnknownFamily { found, known } => {
                write!(f, "is `{}`, not one of the families read ({known})", found.escape_debug())
            }
            HfConfigProblem::Activation { found } => {
                write!(f, "is `{}`; the tables read SiLU-gated MLPs", found.escape_debug())
            }
            HfConfigProblem::NoPlace { family } => {
                write!(f, "is on, which megatron's {family} layout has no place for")
            }
            HfConfigProblem::Heads { found } => write!(f, "is {found}, which does not divide the heads"),
            HfConfigProblem::Dtype { found } => write!(f, "is `{}`, not a float dtype", found.escape_debug()),
        }
    }
}
