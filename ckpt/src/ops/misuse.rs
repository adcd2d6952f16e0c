//! Options that cannot be carried out as given, found by the library before anything is
//! written, and worded by each edge in its own terms.
//!
//! Every option misuse of the library is one [`crate::Error::Misuse`]: a combination of convert
//! options ([`crate::ConvertOptions::check`]), a value out of range, an open option that does
//! not apply to the source's format, a pattern that does not parse. What the library finds is a
//! [`Misuse`] naming [`Opt`]s, not a sentence: the `ckpt` CLI words it with its flags
//! (`--to dcp`), the Python package with its keywords (`to="dcp"`), and the library's own
//! `Display` with the fields of its option structs.

use std::path::PathBuf;

use crate::read::catalog::Format;
use crate::read::dtype::Dtype;

/// An option of the operations, as a [`Misuse`] names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Opt {
    /// [`crate::ConvertOptions::to`], the output format.
    To,
    /// [`crate::ConvertOptions::dtype`], the cast.
    Dtype,
    /// [`crate::ConvertOptions::max_shard_size`].
    MaxShardSize,
    /// [`crate::ConvertOptions::dedupe`].
    Dedupe,
    /// [`crate::ConvertOptions::world_size`].
    WorldSize,
    /// [`crate::ConvertOptions::blocks`] set to [`crate::BlockScaling::Dequantize`].
    Dequantize,
    /// [`crate::ConvertOptions::blocks`] set to [`crate::BlockScaling::Quantize`].
    Quantize,
    /// [`crate::OpenOptions::allow_globals`].
    AllowGlobals,
    /// [`crate::OpenOptions::as_stored`].
    AsStored,
    /// [`crate::OpenOptions::tag`], DeepSpeed's tag folder.
    Tag,
    /// [`crate::OpenOptions::revision`], a Hub revision.
    Revision,
    /// [`crate::MergeOptions::model`], which model of a `save_state` folder.
    Model,
    /// [`crate::MergeOptions::optimizer`], the optimizer states beside the weights.
    Optimizer,
    /// [`crate::WriteOptions::checksums`], the `SHA256SUMS` manifest.
    Checksums,
    /// [`crate::ConvertOptions::arch`], the Hugging Face family to write.
    Arch,
    /// [`crate::ConvertOptions::vocab_size`], the vocabulary rows to keep.
    VocabSize,
    /// [`crate::ConvertOptions::tensor_parallel`].
    TensorParallel,
    /// [`crate::ConvertOptions::pipeline_parallel`].
    PipelineParallel,
    /// [`crate::ConvertOptions::expert_parallel`].
    ExpertParallel,
}

impl Opt {
    /// The option as the library's structs spell it, with its value when the misuse is about
    /// one value: `` `to` = `dcp` ``.
    pub fn library_spelling(self, value: Option<&str>) -> String {
        let name = match self {
            Opt::To => "to",
            Opt::Dtype => "dtype",
            Opt::MaxShardSize => "max_shard_size",
            Opt::Dedupe => "dedupe",
            Opt::WorldSize => "world_size",
            Opt::Dequantize => "blocks: Dequantize",
            Opt::Quantize => "blocks: Quantize",
            Opt::AllowGlobals => "allow_globals",
            Opt::AsStored => "as_stored",
            Opt::Tag => "tag",
            Opt::Revision => "revision",
            Opt::Model => "model",
            Opt::Optimizer => "optimizer",
            Opt::Checksums => "checksums",
            Opt::Arch => "arch",
            Opt::VocabSize => "vocab_size",
            Opt::TensorParallel => "tensor_parallel",
            Opt::PipelineParallel => "pipeline_parallel",
            Opt::ExpertParallel => "expert_parallel",
        };
        match value {
            Some(v) => format!("`{name}` = `{v}`"),
            None => format!("`{name}`"),
        }
    }
}

/// Options that cannot be carried out as given.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Misuse {
    /// DCP output takes a world size and nothing else; `extra` is another option given.
    DcpTakesOnlyWorldSize {
        /// The first other option given.
        extra: Opt,
    },
    /// DCP output without a world size.
    DcpNeedsWorldSize,
    /// A world size for an output that is not DCP.
    WorldSizeWithoutDcp,
    /// An option of another output format for one that keeps tensors as its tool stores them
    /// (a Megatron run folder).
    NotForTarget {
        /// The option given.
        option: Opt,
        /// The output format (`megatron`).
        to: &'static str,
    },
    /// The output format asked for is not the one the destination's extension names.
    ToContradictsExtension {
        /// The format asked for (`safetensors`, `torch`).
        to: &'static str,
        /// The destination's extension, without its dot.
        ext: String,
    },
    /// A shard size with a destination that names one file.
    ShardsNeedAFolder,
    /// A cast to a dtype that is not a float.
    NotAFloatDtype {
        /// The dtype asked for.
        dtype: Dtype,
    },
    /// A cast together with block scaling.
    CastWithBlocks {
        /// Which block scaling was given.
        blocks: Opt,
    },
    /// Dequantizing to a dtype narrower than f16.
    DequantizeToNarrow {
        /// The dtype asked for.
        dtype: Dtype,
    },
    /// A block size of 0 for block scaling.
    ZeroBlock {
        /// Which block scaling was given.
        blocks: Opt,
    },
    /// A world size of 0, or over [`crate::MAX_WORLD_SIZE`].
    WorldSizeOutOfRange {
        /// The world size asked for.
        world: u64,
    },
    /// An option that applies to other formats than the source's.
    OptionNotForFormat {
        /// The option given.
        option: Opt,
        /// The source.
        source: PathBuf,
        /// The source's format.
        format: Format,
    },
    /// A revision for a source that is a path, not an `hf://` address.
    RevisionForPath {
        /// The source as given.
        source: String,
    },
    /// An `allow_globals` pattern that is neither a dotted name, a prefix ending in `.*`, nor `*`.
    BadGlobalPattern {
        /// The pattern as given.
        pattern: String,
    },
    /// A checksum manifest for an output whose files are not all in one folder: a manifest
    /// lists plain file names in its own folder (what `sha256sum -c` and `verify` check), and
    /// this output (a DeepSpeed universal checkpoint's `zero/<param>/` folders) has files in
    /// `folder` too.
    ChecksumsSpanFolders {
        /// A folder of the output other than the manifest's (relative to it, when inside it).
        folder: std::path::PathBuf,
    },
    /// A Hugging Face model asked of a source whose format does not say what model it holds
    /// (only Megatron checkpoints do: their saved `args`).
    HfFromFormat {
        /// The source.
        source: PathBuf,
        /// The source's format.
        format: Format,
    },
    /// An option a Hugging Face output does not take (`extra`).
    NotForHf {
        /// The option given.
        extra: Opt,
    },
    /// An option that only applies to a Hugging Face output (`arch`, `vocab_size`).
    OnlyForHf {
        /// The option given.
        option: Opt,
    },
    /// A vocabulary of 0 rows, or of more than the word embeddings hold.
    VocabBeyondRows {
        /// The rows asked for.
        asked: u64,
        /// The rows the checkpoint holds.
        rows: u64,
    },
    /// A parallel size for an output other than Megatron's legacy layout.
    OnlyForMegatronLegacy {
        /// The option given.
        option: Opt,
    },
    /// A parallel size of 0, or over [`crate::MAX_WORLD_SIZE`].
    ParallelOutOfRange {
        /// The option given.
        option: Opt,
        /// The size asked for.
        size: u64,
    },
    /// A parallel size that does not divide what megatron splits over those ranks.
    DoesNotSplit {
        /// The option given.
        option: Opt,
        /// The size asked for.
        size: u64,
        /// What is split (`attention heads`).
        what: &'static str,
        /// How many of them the model has.
        count: u64,
    },
}

/// What an option that [`Misuse::OptionNotForFormat`] refuses applies to.
fn applies_to(option: Opt) -> &'static str {
    match option {
        Opt::AllowGlobals => "torch files (`.bin`, `.pt`, `.ckpt`, and their sharded sets)",
        Opt::AsStored => "Megatron `torch_dist` checkpoints",
        Opt::Tag => "DeepSpeed checkpoints",
        Opt::Model => "accelerate `save_state` folders",
        Opt::Optimizer => "merges of DeepSpeed and Megatron checkpoints and accelerate `save_state` folders",
        Opt::MaxShardSize => "merges of DeepSpeed checkpoints (`split` shards any checkpoint)",
        Opt::Revision => "`hf://` sources",
        Opt::To => "Megatron `torch_dist` checkpoints",
        _ => "other checkpoints",
    }
}

impl Misuse {
    /// The sentence, with each option spelled by `spell` (the option, and the value the
    /// sentence is about, if any).
    pub fn describe(&self, spell: &dyn Fn(Opt, Option<&str>) -> String) -> String {
        let dcp = || spell(Opt::To, Some("dcp"));
        let hf = || spell(Opt::To, Some("hf"));
        match self {
            Misuse::DcpTakesOnlyWorldSize { .. } => format!("{} takes only {}", dcp(), spell(Opt::WorldSize, None)),
            Misuse::DcpNeedsWorldSize => format!("{} needs {}", dcp(), spell(Opt::WorldSize, Some("M"))),
            Misuse::WorldSizeWithoutDcp => format!("{} only applies to {}", spell(Opt::WorldSize, None), dcp()),
            Misuse::NotForTarget { option, to } => format!(
                "{} does not apply to {}, which keeps the tensors as the tool stores them",
                spell(*option, None),
                spell(Opt::To, Some(to))
            ),
            Misuse::ToContradictsExtension { to, ext } => {
                format!("{} contradicts the `.{ext}` extension", spell(Opt::To, Some(to)))
            }
            Misuse::ShardsNeedAFolder => {
                format!("{} shards into a folder, not into a file name", spell(Opt::MaxShardSize, None))
            }
            Misuse::NotAFloatDtype { dtype } => {
                format!("{} must be a float dtype (f64, f32, f16, bf16 or FP8), not `{dtype}`", spell(Opt::Dtype, None))
            }
            Misuse::CastWithBlocks { blocks } => {
                format!("{} and {} do not combine", spell(Opt::Dtype, None), spell(*blocks, None))
            }
            Misuse::DequantizeToNarrow { dtype } => {
                format!("{} writes f32, f16 or bf16, not `{dtype}`", spell(Opt::Dequantize, None))
            }
            Misuse::ZeroBlock { blocks } => format!("the block size of {} must be at least 1", spell(*blocks, None)),
            Misuse::WorldSizeOutOfRange { world } => {
                format!("{} must be from 1 to {}, not {world}", spell(Opt::WorldSize, None), crate::MAX_WORLD_SIZE)
            }
            Misuse::OptionNotForFormat { option, source, format } => format!(
                "{} applies to {} only; {} is {}",
                spell(*option, None),
                applies_to(*option),
                source.display(),
                format.name()
            ),
            Misuse::RevisionForPath { source } => {
                format!(
                    "{} applies to {} only; {source} is a path",
                    spell(Opt::Revision, None),
                    applies_to(Opt::Revision)
                )
            }
            Misuse::BadGlobalPattern { pattern } => format!(
                "{}: `{pattern}` is not a dotted name (`omegaconf.dictconfig.DictConfig`), a prefix ending in `.*` \
                 (`omegaconf.*`), or `*`",
                spell(Opt::AllowGlobals, None)
            ),
            Misuse::ChecksumsSpanFolders { folder } => format!(
                "{} writes one `SHA256SUMS` for the files of one folder, and this output has files in \
                 `{}` too",
                spell(Opt::Checksums, None),
                crate::escape_controls(&folder.display().to_string())
            ),
            Misuse::HfFromFormat { source, format } => format!(
                "{} converts Megatron checkpoints (whose saved `args` say what model they hold) only; {} is {}",
                hf(),
                source.display(),
                format.name()
            ),
            Misuse::NotForHf { extra } => format!("{} does not take {}", hf(), spell(*extra, None)),
            Misuse::OnlyForHf { option } => format!("{} only applies to {}", spell(*option, None), hf()),
            Misuse::OnlyForMegatronLegacy { option } => {
                format!("{} only applies to {}", spell(*option, None), spell(Opt::To, Some("megatron-legacy")))
            }
            Misuse::ParallelOutOfRange { option, size } => {
                format!("{} must be from 1 to {}, not {size}", spell(*option, None), crate::MAX_WORLD_SIZE)
            }
            Misuse::DoesNotSplit { option, size, what, count } => format!(
                "{} cannot cut the model: its {count} {what} do not divide over {size} ranks",
                spell(*option, Some(&size.to_string()))
            ),
            Misuse::VocabBeyondRows { asked, rows } => format!(
                "{} keeps the first rows of the word embeddings: from 1 to {rows} here, not {asked}",
                spell(Opt::VocabSize, None)
            ),
        }
    }

    /// Whether the sentence names the source it is about, so that the error need not prefix
    /// the destination (`cannot convert to DST: ...`).
    pub fn names_its_source(&self) -> bool {
        matches!(
            self,
            Misuse::OptionNotForFormat { .. }
                | Misuse::RevisionForPath { .. }
                | Misuse::BadGlobalPattern { .. }
                | Misuse::HfFromFormat { .. }
        )
    }
}

impl std::fmt::Display for Misuse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe(&Opt::library_spelling))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_edge_spells_the_options_its_own_way() {
        let m = Misuse::DcpNeedsWorldSize;
        assert_eq!(m.to_string(), "`to` = `dcp` needs `world_size` = `M`");
        let flags = |o: Opt, v: Option<&str>| match (o, v) {
            (Opt::To, Some(v)) => format!("`--to {v}`"),
            (Opt::WorldSize, Some(v)) => format!("`--world-size {v}`"),
            _ => "`--other`".into(),
        };
        assert_eq!(m.describe(&flags), "`--to dcp` needs `--world-size M`");
    }
}
