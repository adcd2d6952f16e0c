//! A [`Mixture`] as one [`Source`]: sample `k` of the mixture is sample `locate(k)` of one of
//! its sources, whatever their kinds (token windows, Arrow, Parquet, JSONL side by side).
//!
//! A batch of a mixture holds samples of several sources, which collate differently, so it is
//! a [`MixtureBatch`]: per source that contributed, the rows of the batch it fills and its own
//! collated batch (a `TokenBatch`, a `RecordBatch`, …) to downcast.

use std::any::Any;
use std::fmt;

use crate::error::{DataloadError, Result};
use crate::mixture::Mixture;
use crate::source::{FileFingerprint, Fingerprint, Source};

/// A source of any kind, its batches as `Any`.
trait AnySource: Send + Sync + fmt::Debug {
    fn len(&self) -> u64;
    fn fingerprint(&self) -> &Fingerprint;
    fn read_any(&self, indices: &[u64]) -> Result<Box<dyn Any + Send>>;
}

impl<S: Source> AnySource for S {
    fn len(&self) -> u64 {
        Source::len(self)
    }
    fn fingerprint(&self) -> &Fingerprint {
        Source::fingerprint(self)
    }
    fn read_any(&self, indices: &[u64]) -> Result<Box<dyn Any + Send>> {
        Ok(Box::new(self.read_batch(indices)?))
    }
}

/// One source's part of a [`MixtureBatch`].
#[derive(Debug)]
pub struct MixturePart {
    /// The source, by index.
    pub source: usize,
    /// Which rows of the batch these are, in order.
    pub rows: Vec<usize>,
    /// The source's own collated batch of them (downcast to its `Source::Batch`).
    pub batch: Box<dyn Any + Send>,
}

/// A batch of a mixture: one part per source that contributed, in source order.
#[derive(Debug)]
pub struct MixtureBatch {
    /// Rows in the batch.
    pub len: usize,
    /// The parts.
    pub parts: Vec<MixturePart>,
}

/// A mixture over sources of any kinds (see the module docs).
pub struct MixtureSource {
    mixture: Mixture,
    sources: Vec<Box<dyn AnySource>>,
    fingerprint: Fingerprint,
}

impl fmt::Debug for MixtureSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MixtureSource").field("len", &self.mixture.len()).field("sources", &self.sources).finish()
    }
}

/// Starts a [`MixtureSource`]: add the sources in the order of the mixture's definition.
#[derive(Debug)]
pub struct MixtureSourceBuilder {
    mixture: Mixture,
    sources: Vec<Box<dyn AnySource>>,
}

impl MixtureSourceBuilder {
    /// Adds the next source.
    pub fn source<S: Source>(mut self, source: S) -> Self {
        self.sources.push(Box::new(source));
        self
    }

    /// Checks that the sources are the definition's, by number and length.
    pub fn build(self) -> Result<MixtureSource> {
        let sizes = &self.mixture.spec().sizes;
        if sizes.len() != self.sources.len() {
            return Err(DataloadError::BadMixture {
                field: "sizes",
                reason: format!("{} sources for a mixture of {}", self.sources.len(), sizes.len()),
            });
        }
        for (i, (s, &n)) in self.sources.iter().zip(sizes).enumerate() {
            if s.len() != n {
                return Err(DataloadError::BadMixture {
                    field: "sizes",
                    reason: format!("source {i} has {} samples, the mixture says {n}", s.len()),
                });
            }
        }
        // The mixture's identity: its definition (but its weight changes, which a resume may
        // add to: the loader checks those against the state), and every source's files under
        // `s{i}/`.
        let spec = crate::MixtureSpec { changes: Vec::new(), ..self.mixture.spec().clone() };
        let options = serde_json::to_string(&spec).unwrap_or_default();
        let options = self.sources.iter().fold(options, |acc, s| {
            let f = s.fingerprint();
            format!("{acc};{}({})", f.format, f.options)
        });
        let files = self
            .sources
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                s.fingerprint().files.iter().map(move |f| FileFingerprint {
                    name: format!("s{i}/{}", f.name),
                    size: f.size,
                    rows: f.rows,
                })
            })
            .collect();
        let fingerprint = Fingerprint { format: "mixture", options, files };
        Ok(MixtureSource { mixture: self.mixture, sources: self.sources, fingerprint })
    }
}

impl MixtureSource {
    /// A builder for the sources of `mixture`.
    pub fn builder(mixture: Mixture) -> MixtureSourceBuilder {
        MixtureSourceBuilder { mixture, sources: Vec::new() }
    }

    /// The mixture.
    pub fn mixture(&self) -> &Mixture {
        &self.mixture
    }
}

impl Source for MixtureSource {
    type Batch = MixtureBatch;

    fn len(&self) -> u64 {
        self.mixture.len()
    }

    fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    fn mixture(&self) -> Option<&crate::MixtureSpec> {
        Some(self.mixture.spec())
    }

    fn read_batch(&self, indices: &[u64]) -> Result<MixtureBatch> {
        let located = self.mixture.locate_many(indices)?;
        let mut rows: Vec<Vec<usize>> = vec![Vec::new(); self.sources.len()];
        let mut samples: Vec<Vec<u64>> = vec![Vec::new(); self.sources.len()];
        for (row, (src, j)) in located.into_iter().enumerate() {
            rows[src].push(row);
            samples[src].push(j);
        }
        let mut parts = Vec::new();
        for (source, (rows, samples)) in rows.into_iter().zip(samples).enumerate() {
            if rows.is_empty() {
                continue;
            }
            let batch = self.sources[source].read_any(&samples)?;
            parts.push(MixturePart { source, rows, batch });
        }
        Ok(MixtureBatch { len: indices.len(), parts })
    }
}
