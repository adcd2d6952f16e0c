//! What an operation asks a source's format, and the answers it can get: the vocabulary of the
//! seam between the operations and the formats (their interface, `FormatOps`). It names no
//! format, so both sides can use it without importing each other.

use std::path::Path;

use crate::error::Result;
use crate::ops::outcome::Outcome;
use crate::read::catalog::{Checkpoint, TensorInfo};
use crate::write::WriteOptions;

/// Options for [`crate::merge`].
#[derive(Clone, Debug, Default)]
pub struct MergeOptions {
    /// Shard the merged weights into the output folder with files of at most this many bytes
    /// (DeepSpeed checkpoints, as `zero_to_fp32 --max_shard_size` does).
    pub max_shard_size: Option<u64>,
    /// Also write the merged Adam moments (`<param>.exp_avg`, `<param>.exp_avg_sq`) to
    /// `optimizer.safetensors` beside the weights (DeepSpeed checkpoints; for an accelerate
    /// `save_state` folder, the optimizer of the merged model, whatever its format; for a
    /// Megatron checkpoint, `optimizer.state.{param,exp_avg,exp_avg_sq}.<stored key>`, whatever
    /// form its optimizer was saved in).
    pub optimizer: bool,
    /// Which model of an accelerate `save_state` folder to merge (default 0).
    pub model: Option<usize>,
}

/// A format's own way of writing an output, run when the operation writes it: its outcome.
pub(crate) type OwnWrite<'a> = Box<dyn FnOnce(&WriteOptions<'_>) -> Result<Outcome> + 'a>;

/// How a format merges one of its sources into one state dict.
pub(crate) enum Merge<'a> {
    /// The catalog as stored, planned and written like any other (into `zero_to_fp32`'s shards
    /// with [`MergeOptions::max_shard_size`]), with the optimizer's state per parameter written
    /// beside it when it was asked for.
    Catalog {
        /// The optimizer's state per parameter, as tensors of the source's files.
        optimizer: Option<Vec<TensorInfo>>,
    },
    /// Members of a folder merged in its place, each as its own format merges it: a model, and
    /// the optimizer's own checkpoint beside it (an accelerate `save_state` folder).
    Members {
        /// The model merged into the destination.
        model: &'a Checkpoint,
        /// The options the model is merged with.
        options: MergeOptions,
        /// The optimizer merged into `optimizer.safetensors` beside it.
        optimizer: Option<&'a Checkpoint>,
    },
    /// An output only the format knows how to write (torch's consolidation of DCP's Hugging
    /// Face storage into a folder).
    Own(OwnWrite<'a>),
}

impl std::fmt::Debug for Merge<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Merge::Catalog { optimizer } => {
                f.debug_struct("Catalog").field("optimizer", &optimizer.as_ref().map(Vec::len)).finish()
            }
            Merge::Members { model, optimizer, .. } => f
                .debug_struct("Members")
                .field("model", &model.root)
                .field("optimizer", &optimizer.map(|o| o.root.as_path()))
                .finish(),
            Merge::Own(_) => f.write_str("Own"),
        }
    }
}

/// Whether `out` names a folder to merge into rather than one safetensors file.
pub(crate) fn names_a_folder(out: &Path) -> bool {
    out.is_dir() || out.extension().is_none_or(|e| !e.eq_ignore_ascii_case("safetensors"))
}
