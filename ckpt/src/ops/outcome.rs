//! What an operation wrote: one type for every operation.

use std::path::PathBuf;

/// What an operation wrote.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Outcome {
    /// Every file written, in order; the commit marker (the index, `.metadata`, `latest`) last.
    pub files: Vec<PathBuf>,
    /// Tensors written.
    pub tensors: usize,
    /// Tensor bytes written (each storage once).
    pub bytes: u64,
    /// Names of the non-tensor values carried over.
    pub values: Vec<String>,
    /// `(alias, kept)`: tied tensors dropped (safetensors, with `dedupe`) or sharing the kept
    /// tensor's storage (torch).
    pub aliases: Vec<(String, String)>,
    /// For sharded outputs (DCP, universal): the world size they were laid out for.
    pub world_size: Option<u64>,
    /// What each rank of the [`crate::Job`] did, by rank (empty without one).
    pub ranks: Vec<crate::RankShare>,
    /// Whether nothing was written: a [`crate::Job::dry_run`] that only planned.
    pub dry_run: bool,
}
