//! `dataload::Mixture` as a Python object; `statekit.mixture` wraps it (`statekit.data.Mixture`).
//!
//! Every call is O(block) (a block is at most 2^20 positions, 64 for weights no smaller than
//! 1/64 of the total): the order is a pure function of the definition and the position, so
//! nothing is precomputed per sample and nothing is held but the definition's segments.

use dataload::{Mixture as Inner, MixtureSpec, Source, WeightChange};
use pyo3::prelude::*;

use crate::args::{self, MAX_LEN};
use crate::datasets::TokenSource;
use crate::errors;

/// A weighted mixture of sources (`dataload::Mixture`).
#[pyclass(module = "statekit._native", name = "Mixture", frozen)]
#[derive(Debug)]
pub(crate) struct Mixture {
    inner: Inner,
}

/// Compiles `spec`, refusing a definition whose length Python's `len` cannot count (or whose
/// `once` sources add up past it) before the library sees it.
fn compile(spec: MixtureSpec) -> PyResult<Inner> {
    let once_total = spec
        .once
        .iter()
        .filter_map(|&i| spec.sizes.get(i))
        .try_fold(0u64, |acc, &n| acc.checked_add(n).filter(|&t| t <= MAX_LEN));
    if once_total.is_none() {
        return Err(errors::usage(
            "the sources read once hold more than the 2^63 - 1 samples Python's `len` counts together",
        ));
    }
    if let Some(l) = spec.length {
        if l > MAX_LEN {
            return Err(errors::usage(format!(
                "`length` is {l}, more than the 2^63 - 1 samples Python's `len` counts"
            )));
        }
    }
    errors::unpanicked("the mixture's definition", || Inner::new(spec).map_err(errors::dataload))
}

fn weights(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<f64>> {
    let mut out = Vec::new();
    for (k, item) in
        obj.try_iter().map_err(|_| errors::usage(format!("`{name}` must be a sequence of numbers")))?.enumerate()
    {
        let item = item?;
        let v: f64 = item.extract().map_err(|_| {
            let repr = item.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
            errors::usage(format!("`{name}[{k}]` must be a number, not {repr}"))
        })?;
        out.push(v);
    }
    Ok(out)
}

impl Mixture {
    /// `position` as a position of the order (`< len`), else a `ValueError` naming it.
    fn position(&self, i: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
        let p = args::uint(i, name, 0, MAX_LEN)?;
        if p >= self.inner.len() {
            return Err(errors::usage(format!(
                "position {p} is past the end of the mixture ({} samples)",
                self.inner.len()
            )));
        }
        Ok(p)
    }
}

#[pymethods]
impl Mixture {
    /// `sizes`: each source's length; `weights`: one per source; `once`: the sources read once
    /// (by index); `length`: the mixture's (None when every source is read once: their total);
    /// `changes`: `(at, weights)` pairs, new weights from position `at` on.
    #[new]
    #[pyo3(signature = (sizes, weights, seed=None, once=None, length=None, changes=None))]
    fn new(
        py: Python<'_>,
        sizes: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        seed: Option<&Bound<'_, PyAny>>,
        once: Option<&Bound<'_, PyAny>>,
        length: Option<&Bound<'_, PyAny>>,
        changes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let sizes = args::uint_list(sizes, "sizes", MAX_LEN)?;
        let weights = self::weights(weights, "weights")?;
        let seed = args::opt_uint(seed, "seed", 0, u64::MAX)?.unwrap_or(0);
        let once = match once {
            None => Vec::new(),
            Some(o) => args::uint_list(o, "once", MAX_LEN)?.into_iter().map(|i| i as usize).collect(),
        };
        let length = args::opt_uint(length, "length", 0, MAX_LEN)?;
        let mut parsed = Vec::new();
        if let Some(c) = changes {
            for (k, item) in
                c.try_iter().map_err(|_| errors::usage("`changes` must be a sequence of (at, weights)"))?.enumerate()
            {
                let item = item?;
                let (at, w): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item
                    .extract()
                    .map_err(|_| errors::usage(format!("`changes[{k}]` must be a pair (at, weights)")))?;
                parsed.push(WeightChange {
                    at: args::uint(&at, &format!("changes[{k}].at"), 0, MAX_LEN)?,
                    weights: self::weights(&w, &format!("changes[{k}].weights"))?,
                });
            }
        }
        let spec = MixtureSpec { sizes, weights, seed, once, length, changes: parsed };
        let inner = py.detach(|| compile(spec))?;
        Ok(Self { inner })
    }

    /// A mixture from its definition as JSON (what `spec_json` and a loader state hold).
    #[staticmethod]
    fn from_json(py: Python<'_>, spec: &str) -> PyResult<Self> {
        let spec: MixtureSpec =
            serde_json::from_str(spec).map_err(|e| errors::usage(format!("bad mixture definition: {e}")))?;
        let inner = py.detach(|| compile(spec))?;
        Ok(Self { inner })
    }

    /// The definition, as JSON (`dataload::MixtureSpec`).
    fn spec_json(&self) -> PyResult<String> {
        serde_json::to_string(self.inner.spec()).map_err(|e| errors::usage(e.to_string()))
    }

    fn __len__(&self) -> usize {
        usize::try_from(self.inner.len()).unwrap_or(usize::MAX)
    }

    /// Number of sources.
    #[getter]
    fn sources(&self) -> usize {
        self.inner.sources()
    }

    /// `(source, sample of that source)` at position `i` of the order.
    fn locate(&self, i: &Bound<'_, PyAny>) -> PyResult<(usize, u64)> {
        let p = self.position(i, "i")?;
        errors::unpanicked("Mixture.locate", || self.inner.locate(p).map_err(errors::dataload))
    }

    /// `locate` of every position of `indices`, as two lists: the sources and the samples.
    fn locate_many(&self, py: Python<'_>, indices: &Bound<'_, PyAny>) -> PyResult<(Vec<usize>, Vec<u64>)> {
        let positions = args::uint_list(indices, "indices", MAX_LEN)?;
        if let Some(&p) = positions.iter().find(|&&p| p >= self.inner.len()) {
            return Err(errors::usage(format!(
                "position {p} is past the end of the mixture ({} samples)",
                self.inner.len()
            )));
        }
        let inner = &self.inner;
        let located = errors::unpanicked("Mixture.locate_many", || {
            py.detach(|| inner.locate_many(&positions)).map_err(errors::dataload)
        })?;
        Ok(located.into_iter().unzip())
    }

    /// How many samples each source has given before position `i` (`i <= len`).
    fn positions(&self, i: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let p = args::uint(i, "i", 0, MAX_LEN)?;
        if p > self.inner.len() {
            return Err(errors::usage(format!(
                "position {p} is past the end of the mixture ({} samples)",
                self.inner.len()
            )));
        }
        errors::unpanicked("Mixture.positions", || self.inner.positions(p).map_err(errors::dataload))
    }

    /// The block size in force at position `i`: over any prefix each source's count is within
    /// one block's share of its weight.
    fn block_at(&self, i: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.inner.block_at(args::uint(i, "i", 0, MAX_LEN)?))
    }

    /// Reads the token windows at positions `indices` of a mixture of token sources (`sources`,
    /// in the definition's order, each as long as the definition says) into `inputs` and
    /// `targets`, as `TokenSource.read_batch_into` does for one source: each source's windows
    /// are read in one batch, with the GIL released.
    fn read_tokens_into(
        &self,
        py: Python<'_>,
        sources: Vec<Bound<'_, TokenSource>>,
        indices: &Bound<'_, PyAny>,
        inputs: &Bound<'_, PyAny>,
        targets: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let spec = self.inner.spec();
        if sources.len() != spec.sizes.len() {
            return Err(errors::usage(format!(
                "{} token sources for a mixture of {}",
                sources.len(),
                spec.sizes.len()
            )));
        }
        let windows: Vec<&dataload::TokenWindows> = sources.iter().map(|s| s.get().windows()).collect();
        let block = windows.first().map_or(0, |w| w.block_size());
        for (k, (w, &n)) in windows.iter().zip(&spec.sizes).enumerate() {
            if w.len() != n {
                return Err(errors::usage(format!("token source {k} has {} windows, the mixture says {n}", w.len())));
            }
            if w.block_size() != block {
                return Err(errors::usage(format!(
                    "token source {k} has windows of {} tokens, source 0 of {block}",
                    w.block_size()
                )));
            }
        }
        let positions = args::uint_list(indices, "indices", MAX_LEN)?;
        if let Some(&p) = positions.iter().find(|&&p| p >= self.inner.len()) {
            return Err(errors::usage(format!(
                "position {p} is past the end of the mixture ({} samples)",
                self.inner.len()
            )));
        }
        let want = positions.len().checked_mul(block).and_then(|n| n.checked_mul(8));
        let Some(want) = want else {
            return Err(errors::usage(format!("{} windows of {block} tokens are too many", positions.len())));
        };
        let mut inputs = crate::buffer::BytesMut::get(inputs, "`inputs`", Some(want))?;
        let mut targets = crate::buffer::BytesMut::get(targets, "`targets`", Some(want))?;
        crate::buffer::disjoint([(&inputs, "`inputs`".to_string()), (&targets, "`targets`".to_string())])?;
        let (inputs, targets) = (inputs.as_mut_slice(), targets.as_mut_slice());
        let inner = &self.inner;
        errors::unpanicked("Mixture.read_tokens_into", || {
            py.detach(|| -> dataload::Result<()> {
                let located = inner.locate_many(&positions)?;
                // Each source's rows of the batch and its samples, read in one batch per source.
                let mut rows: Vec<Vec<usize>> = vec![Vec::new(); windows.len()];
                let mut samples: Vec<Vec<u64>> = vec![Vec::new(); windows.len()];
                for (row, (src, j)) in located.into_iter().enumerate() {
                    rows[src].push(row);
                    samples[src].push(j);
                }
                let row_bytes = block * 8;
                for ((w, rows), samples) in windows.iter().zip(&rows).zip(&samples) {
                    if rows.is_empty() {
                        continue;
                    }
                    let batch = w.read_batch(samples)?;
                    for (r, &row) in rows.iter().enumerate() {
                        let at = row * row_bytes;
                        let (src_in, src_tg) =
                            (&batch.inputs[r * block..(r + 1) * block], &batch.targets[r * block..(r + 1) * block]);
                        for (d, v) in inputs[at..at + row_bytes].chunks_exact_mut(8).zip(src_in) {
                            d.copy_from_slice(&v.to_le_bytes());
                        }
                        for (d, v) in targets[at..at + row_bytes].chunks_exact_mut(8).zip(src_tg) {
                            d.copy_from_slice(&v.to_le_bytes());
                        }
                    }
                }
                Ok(())
            })
            .map_err(errors::dataload)
        })
    }
}
