//! What each variant of [`Error`] is: its kind, which the edges act on, and its name, which the
//! Python bindings expose.

use super::Error;

/// What an [`Error`] is about, for the edges that act on it: the CLI's exit code, the Python
/// bindings' exception class, and `verify`, which reports [`ErrorKind::InvalidData`] as the
/// checkpoint's problems.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The checkpoint is defective or hostile: a reader would trip on it.
    InvalidData,
    /// The source is not there, or is not a checkpoint this library reads.
    NotFound,
    /// What was asked cannot be done with this input: an option, a size, a dtype the output
    /// format cannot store, an output that is the source.
    Usage,
    /// The file system failed under a valid request.
    Io,
    /// Another rank of a job failed (and reports why), or the collective between the ranks did.
    Collective,
}

impl Error {
    /// The kind of this error. Every variant names its kind here, so a new variant decides
    /// what it is instead of falling into a default.
    pub fn kind(&self) -> ErrorKind {
        match self {
            // A rank's failure is of the kind of what failed, on every rank.
            Error::ShardedSave { source, .. } => source.kind(),
            Error::Reported { kind, .. } => *kind,
            Error::HeaderTooSmall { .. }
            | Error::HeaderTooLarge { .. }
            | Error::HeaderBeyondFile { .. }
            | Error::BadHeaderJson { .. }
            | Error::BadTensorEntry { .. }
            | Error::UnknownDtype { .. }
            | Error::DuplicateTensor { .. }
            | Error::DuplicateInFile { .. }
            | Error::SizeMismatch { .. }
            | Error::BadOffset { .. }
            | Error::LengthMismatch { .. }
            | Error::BadMetadata { .. }
            | Error::BadIndex { .. }
            | Error::MissingShard { .. }
            | Error::TensorNotInShard { .. }
            | Error::DuplicateAcrossShards { .. }
            | Error::UnlistedTensor { .. }
            | Error::UnsafeShardPath { .. }
            | Error::ExpandedView { .. }
            | Error::NotARegularFile { .. }
            | Error::PlantedLink { .. }
            | Error::MetadataConflict { .. }
            | Error::ChecksumMismatch { .. }
            | Error::BadManifest { .. }
            | Error::BadZip { .. }
            | Error::RecordBeyondFile { .. }
            | Error::RecordTooLarge { .. }
            | Error::BadChecksum { .. }
            | Error::InflateOverrun { .. }
            | Error::RefusedGlobal { .. }
            | Error::GlobalNotAllowed { .. }
            | Error::BadPickle { .. }
            | Error::BadTorchFile { .. }
            | Error::BadTorchTensor { .. }
            | Error::BadBlockScale { .. }
            | Error::BadZeroCheckpoint { .. }
            | Error::ZeroDtype { .. }
            | Error::MissingRankFile { .. }
            | Error::BadDcpMetadata { .. }
            | Error::DcpMetadataTooLarge { .. }
            | Error::DcpItemDtype { .. }
            | Error::BadDcpChunk { .. }
            | Error::BadBox { .. }
            | Error::BoxDtypeMismatch { .. }
            | Error::BadSaveState { .. }
            | Error::MissingRngFile { .. }
            | Error::RankBeyondLimit { .. }
            | Error::BadMegatron { .. }
            | Error::MissingMegatronRank { .. }
            | Error::BadModelMap { .. }
            | Error::BadHfConfig { .. }
            | Error::HubCorrupt { .. } => ErrorKind::InvalidData,
            Error::NotACheckpoint { .. }
            | Error::UnknownSafetensorsLayout { .. }
            | Error::NotInHubCache { .. }
            | Error::HubNotFound { .. } => ErrorKind::NotFound,
            Error::BadSize { .. }
            | Error::BadHubUrl { .. }
            | Error::HubAuth { .. }
            | Error::OutputIsSource { .. }
            | Error::NotInSafetensors { .. }
            | Error::Misuse { .. }
            | Error::OutputExists { .. }
            | Error::OptimizerCollides { .. }
            | Error::AlreadyQuantized { .. }
            | Error::NotInTorch { .. }
            | Error::WrongBufferLen { .. }
            | Error::PushOffline { .. }
            | Error::NothingToPush { .. }
            | Error::NotReshardable { .. }
            | Error::BadSaveTensor { .. }
            | Error::DestinationLocked { .. }
            | Error::NoHfArchitecture { .. } => ErrorKind::Usage,
            Error::Io { .. } | Error::HubRequest { .. } => ErrorKind::Io,
            Error::Collective { .. }
            | Error::OtherRank { .. }
            | Error::PlanMismatch { .. }
            | Error::DestinationsDiffer { .. } => ErrorKind::Collective,
        }
    }

    /// The variant's name, as the Python bindings expose it (`.variant`). Every variant is
    /// named here, so a new variant must be given its name.
    pub fn variant_name(&self) -> &'static str {
        match self {
            Error::Io { .. } => "Io",
            Error::HeaderTooSmall { .. } => "HeaderTooSmall",
            Error::HeaderTooLarge { .. } => "HeaderTooLarge",
            Error::HeaderBeyondFile { .. } => "HeaderBeyondFile",
            Error::BadHeaderJson { .. } => "BadHeaderJson",
            Error::BadTensorEntry { .. } => "BadTensorEntry",
            Error::UnknownDtype { .. } => "UnknownDtype",
            Error::DuplicateTensor { .. } => "DuplicateTensor",
            Error::DuplicateInFile { .. } => "DuplicateInFile",
            Error::SizeMismatch { .. } => "SizeMismatch",
            Error::BadOffset { .. } => "BadOffset",
            Error::LengthMismatch { .. } => "LengthMismatch",
            Error::BadMetadata { .. } => "BadMetadata",
            Error::BadIndex { .. } => "BadIndex",
            Error::MissingShard { .. } => "MissingShard",
            Error::TensorNotInShard { .. } => "TensorNotInShard",
            Error::DuplicateAcrossShards { .. } => "DuplicateAcrossShards",
            Error::UnlistedTensor { .. } => "UnlistedTensor",
            Error::UnsafeShardPath { .. } => "UnsafeShardPath",
            Error::NotACheckpoint { .. } => "NotACheckpoint",
            Error::UnknownSafetensorsLayout { .. } => "UnknownSafetensorsLayout",
            Error::BadSize { .. } => "BadSize",
            Error::BadHubUrl { .. } => "BadHubUrl",
            Error::NotInHubCache { .. } => "NotInHubCache",
            Error::HubAuth { .. } => "HubAuth",
            Error::HubNotFound { .. } => "HubNotFound",
            Error::HubRequest { .. } => "HubRequest",
            Error::HubCorrupt { .. } => "HubCorrupt",
            Error::OutputIsSource { .. } => "OutputIsSource",
            Error::ExpandedView { .. } => "ExpandedView",
            Error::NotARegularFile { .. } => "NotARegularFile",
            Error::PlantedLink { .. } => "PlantedLink",
            Error::MetadataConflict { .. } => "MetadataConflict",
            Error::ChecksumMismatch { .. } => "ChecksumMismatch",
            Error::BadManifest { .. } => "BadManifest",
            Error::BadZip { .. } => "BadZip",
            Error::RecordBeyondFile { .. } => "RecordBeyondFile",
            Error::RecordTooLarge { .. } => "RecordTooLarge",
            Error::BadChecksum { .. } => "BadChecksum",
            Error::InflateOverrun { .. } => "InflateOverrun",
            Error::RefusedGlobal { .. } => "RefusedGlobal",
            Error::GlobalNotAllowed { .. } => "GlobalNotAllowed",
            Error::BadPickle { .. } => "BadPickle",
            Error::BadTorchFile { .. } => "BadTorchFile",
            Error::BadTorchTensor { .. } => "BadTorchTensor",
            Error::NotInSafetensors { .. } => "NotInSafetensors",
            Error::Misuse { .. } => "Misuse",
            Error::OutputExists { .. } => "OutputExists",
            Error::OptimizerCollides { .. } => "OptimizerCollides",
            Error::AlreadyQuantized { .. } => "AlreadyQuantized",
            Error::NotInTorch { .. } => "NotInTorch",
            Error::WrongBufferLen { .. } => "WrongBufferLen",
            Error::PushOffline { .. } => "PushOffline",
            Error::NothingToPush { .. } => "NothingToPush",
            Error::NotReshardable { .. } => "NotReshardable",
            Error::BadSaveTensor { .. } => "BadSaveTensor",
            Error::BadBlockScale { .. } => "BadBlockScale",
            Error::BadZeroCheckpoint { .. } => "BadZeroCheckpoint",
            Error::ZeroDtype { .. } => "ZeroDtype",
            Error::MissingRankFile { .. } => "MissingRankFile",
            Error::BadDcpMetadata { .. } => "BadDcpMetadata",
            Error::DcpMetadataTooLarge { .. } => "DcpMetadataTooLarge",
            Error::DcpItemDtype { .. } => "DcpItemDtype",
            Error::BadDcpChunk { .. } => "BadDcpChunk",
            Error::BadBox { .. } => "BadBox",
            Error::BoxDtypeMismatch { .. } => "BoxDtypeMismatch",
            Error::Collective { .. } => "Collective",
            Error::OtherRank { .. } => "OtherRank",
            Error::PlanMismatch { .. } => "PlanMismatch",
            Error::DestinationLocked { .. } => "DestinationLocked",
            Error::DestinationsDiffer { .. } => "DestinationsDiffer",
            Error::ShardedSave { .. } => "ShardedSave",
            Error::Reported { .. } => "Reported",
            Error::BadSaveState { .. } => "BadSaveState",
            Error::MissingRngFile { .. } => "MissingRngFile",
            Error::RankBeyondLimit { .. } => "RankBeyondLimit",
            Error::BadMegatron { .. } => "BadMegatron",
            Error::MissingMegatronRank { .. } => "MissingMegatronRank",
            Error::BadModelMap { .. } => "BadModelMap",
            Error::NoHfArchitecture { .. } => "NoHfArchitecture",
            Error::BadHfConfig { .. } => "BadHfConfig",
        }
    }
}
