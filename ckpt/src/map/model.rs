//! Model maps: the catalog a checkpoint is written from, assembled from the catalog it was read
//! as.
//!
//! A checkpoint is read as its *source* tensors, under the names and shapes it stores them (a
//! Megatron `torch_dist` folder: one stacked tensor per layer key; a legacy Megatron save: each
//! tensor-parallel rank's piece; a DCP folder: its flattened keys). What an operation writes is
//! often another set of *target* tensors: the model megatron holds on one rank, a Hugging Face
//! architecture's names and fused or split projections. A [`ModelMap`] says how: it lists the
//! target tensors (name, shape, an optional cast), each assembled from [`Piece`]s, and a piece
//! is a box of the target that is a region of one source tensor:
//!
//! - a row range (or a range of any one dim): [`Piece::range`], a tensor-parallel rank's slice;
//! - a slice of a stacked axis, the axis taken out: [`Piece::index`], one layer; of several:
//!   [`Piece::indices`], one expert of one layer;
//! - the inverse, a new size-1 axis put in: [`Piece::stacked`];
//! - strided groups, every `period` rows a run of `len` rows: [`Piece::groups`], megatron's
//!   per-query-group interleaved QKV, gathered into Q, K and V, and back:
//!   [`Piece::interleaved`];
//! - in general, any axis-aligned strided view: each target dim walks one source dim with a
//!   step (a transpose, every other row), every source dim not walked held at one index.
//!
//! Applying a map ([`ModelMap::apply`]) composes each piece with the source tensor's own boxes
//! (strided views of stored bytes, or byte ranges) into boxes of the target that are strided
//! views of the *stored* bytes, so the target catalog is planned and executed like any other:
//! streaming, with bounded memory, dealt to the ranks of a job by bytes, byte-identical at any
//! world size. Nothing is read while a map is applied. The pieces of a target must tile it
//! exactly, and every source tensor must be read by some target unless the map drops it by
//! name ([`ModelMap::leave_out`]): a map that would lose a tensor, or write one twice or with a
//! hole, is refused naming the tensor ([`crate::Error::BadModelMap`]).
//!
//! ```text
//! source                                   target
//! decoder.layers.mlp.fc.weight  [L, f, h]  decoder.layers.0.mlp.fc.weight [f, h] ← index(0, layer 0)
//!                                          decoder.layers.1.mlp.fc.weight [f, h] ← index(0, layer 1)
//! qkv.weight [G·(q+2)·d, h]                q.weight [G·q·d, h] ← groups(G, period (q+2)·d, at 0, q·d rows)
//!                                          k.weight [G·d, h]   ← groups(G, period (q+2)·d, at q·d, d rows)
//! ```
//!
//! In code (a crate-internal API; formats build their maps):
//!
//! ```ignore
//! let mut map = ModelMap::new("one-rank model");
//! for layer in 0..2 {
//!     map.push(Target::new(format!("layers.{layer}.w"), vec![4, 8], vec![Piece::index("layers.w", &[2, 4, 8], 0, layer)]));
//! }
//! let tensors = map.apply(&root, &sources)?; // then Checkpoint::new as for any catalog
//! ```
//!
//! A format's one-rank or logical view is a map; so will be the architecture tables that turn
//! a Megatron model into a Hugging Face one and back (both directions are maps: `index` and
//! `stacked`, `groups` and its inverse, a concatenation of pieces).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use crate::error::{Error, MapProblem, Result};
use crate::read::catalog::{Chunk, TensorBox, TensorData, TensorInfo};
use crate::read::dtype::Dtype;
use crate::read::shape;
use fsdp_state::Region;

/// How one dim of a piece walks its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Axis {
    /// Along source dim `dim`, `step` source elements per target element.
    Source { dim: usize, step: u64 },
    /// A dim of size 1 the source does not have (a stacked axis put in).
    New,
}

/// A box of a target tensor and the region of one source tensor it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Where the piece sits in the target.
    pub at: Region,
    /// The source tensor it reads, by name.
    pub source: String,
    /// The source index of the piece's first element, one per source dim; a source dim no
    /// axis walks is held at this index.
    pub from: Vec<u64>,
    /// How each target dim walks the source, one per target dim.
    pub axes: Vec<Axis>,
}

impl Piece {
    /// The whole source tensor of `shape`, as it is.
    pub(crate) fn whole(source: impl Into<String>, shape: &[u64]) -> Piece {
        Piece {
            at: Region::whole(shape),
            source: source.into(),
            from: vec![0; shape.len()],
            axes: (0..shape.len()).map(|dim| Axis::Source { dim, step: 1 }).collect(),
        }
    }

    /// Indices `range` of dim `dim` of the source tensor of `shape` (every other dim whole),
    /// placed at index `to` of the same dim of the target.
    pub(crate) fn range(
        source: impl Into<String>,
        shape: &[u64],
        dim: usize,
        range: std::ops::Range<u64>,
        to: u64,
    ) -> Piece {
        let mut p = Piece::whole(source, shape);
        if let (Some(o), Some(s), Some(f)) = (p.at.offsets.get_mut(dim), p.at.sizes.get_mut(dim), p.from.get_mut(dim)) {
            *o = to;
            *s = range.end.saturating_sub(range.start);
            *f = range.start;
        }
        p
    }

    /// Index `index` of the stacked axis `axis` of the source tensor of `shape`: a tensor of
    /// the other dims (one layer of a stacked layer key, one expert).
    pub(crate) fn index(source: impl Into<String>, shape: &[u64], axis: usize, index: u64) -> Piece {
        Piece::indices(source, shape, &[(axis, index)])
    }

    /// The whole source tensor of `shape` as index `index` of a new axis `axis` of the target
    /// (one layer's tensor into a stacked layer key).
    pub(crate) fn stacked(source: impl Into<String>, shape: &[u64], axis: usize, index: u64) -> Piece {
        let mut p = Piece::whole(source, shape);
        let axis = axis.min(shape.len());
        p.at.offsets.insert(axis, index);
        p.at.sizes.insert(axis, 1);
        p.axes.insert(axis, Axis::New);
        p
    }

    /// Strided groups of dim 0: for each of `groups` groups `g`, rows
    /// `g·period + start .. g·period + start + len` of the source tensor of `shape`, placed one
    /// after the other from row `to` of the target (megatron's fused QKV interleaves each query
    /// group's Q, K and V rows; Q is every group's first `q·d` rows).
    pub(crate) fn groups(
        source: &str,
        shape: &[u64],
        groups: u64,
        period: u64,
        start: u64,
        len: u64,
        to: u64,
    ) -> Vec<Piece> {
        (0..groups)
            .map(|g| {
                let first = g.saturating_mul(period).saturating_add(start);
                Piece::range(source, shape, 0, first..first.saturating_add(len), to.saturating_add(g * len))
            })
            .collect()
    }

    /// The inverse of [`Piece::groups`]: rows `g·len .. (g+1)·len` of the source tensor of
    /// `shape`, for each of `groups` groups `g`, placed at rows `g·period + start` of the target
    /// (Q, K and V of a Hugging Face model interleaved into megatron's fused QKV).
    pub(crate) fn interleaved(
        source: &str,
        shape: &[u64],
        groups: u64,
        period: u64,
        start: u64,
        len: u64,
    ) -> Vec<Piece> {
        (0..groups)
            .map(|g| {
                let first = g.saturating_mul(len);
                let to = g.saturating_mul(period).saturating_add(start);
                Piece::range(source, shape, 0, first..first.saturating_add(len), to)
            })
            .collect()
    }

    /// Index `index` of each stacked axis `axis` of `held` (a layer, then an expert) of the
    /// source tensor of `shape`: a tensor of the other dims.
    pub(crate) fn indices(source: impl Into<String>, shape: &[u64], held: &[(usize, u64)]) -> Piece {
        let mut from = vec![0; shape.len()];
        for &(axis, index) in held {
            if let Some(f) = from.get_mut(axis) {
                *f = index;
            }
        }
        let dims: Vec<usize> = (0..shape.len()).filter(|d| !held.iter().any(|h| h.0 == *d)).collect();
        let sizes: Vec<u64> = dims.iter().map(|&d| shape[d]).collect();
        Piece {
            at: Region::whole(&sizes),
            source: source.into(),
            from,
            axes: dims.into_iter().map(|dim| Axis::Source { dim, step: 1 }).collect(),
        }
    }

    /// The piece moved by `by` in the target (a source's pieces placed in a concatenation).
    pub(crate) fn shifted(mut self, by: &[u64]) -> Piece {
        for (o, b) in self.at.offsets.iter_mut().zip(by) {
            *o = o.saturating_add(*b);
        }
        self
    }

    /// The piece put at index `index` of a new size-1 axis `axis` of the target (one layer's
    /// or one expert's piece placed in a stacked tensor).
    pub(crate) fn lifted(mut self, axis: usize, index: u64) -> Piece {
        let axis = axis.min(self.axes.len());
        self.at.offsets.insert(axis, index);
        self.at.sizes.insert(axis, 1);
        self.axes.insert(axis, Axis::New);
        self
    }

    /// The source index of the piece's last element on each source dim, when the piece has
    /// elements and walks each source dim at most once; `None` otherwise.
    fn last(&self) -> Option<Vec<u64>> {
        let mut last = self.from.clone();
        let mut walked = HashSet::new();
        for (axis, &n) in self.axes.iter().zip(&self.at.sizes) {
            match *axis {
                Axis::Source { dim, step } => {
                    if step == 0 || !walked.insert(dim) {
                        return None;
                    }
                    let l = last.get_mut(dim)?;
                    *l = l.checked_add(n.checked_sub(1)?.checked_mul(step)?)?;
                }
                Axis::New if n == 1 => {}
                Axis::New => return None,
            }
        }
        Some(last)
    }
}

/// A tensor of the target catalog and the pieces it is assembled from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    pub name: String,
    pub shape: Vec<u64>,
    /// The dtype it is written as, when not its sources'.
    pub cast: Option<Dtype>,
    pub pieces: Vec<Piece>,
}

impl Target {
    pub(crate) fn new(name: impl Into<String>, shape: Vec<u64>, pieces: Vec<Piece>) -> Target {
        Target { name: name.into(), shape, cast: None, pieces }
    }

    /// The source tensor `source` of `shape` under the name `name`, as it is.
    pub(crate) fn renamed(name: impl Into<String>, source: impl Into<String>, shape: &[u64]) -> Target {
        Target::new(name, shape.to_vec(), vec![Piece::whole(source, shape)])
    }
}

/// The target catalog, tensor by tensor, and the source tensors left out on purpose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ModelMap {
    /// What the map builds, for the refusal of a tensor it leaves out (`one-rank model`).
    view: &'static str,
    targets: Vec<Target>,
    dropped: HashSet<String>,
}

impl ModelMap {
    pub(crate) fn new(view: &'static str) -> ModelMap {
        ModelMap { view, targets: Vec::new(), dropped: HashSet::new() }
    }

    /// Every tensor of `sources` as it is, under its own name: a view that is the stored one.
    pub(crate) fn identity(view: &'static str, sources: &[TensorInfo]) -> ModelMap {
        let mut map = ModelMap::new(view);
        map.targets = sources.iter().map(|t| Target::renamed(t.name.clone(), t.name.clone(), &t.shape)).collect();
        map
    }

    /// Adds a target tensor, after those already there (the order they are written in).
    pub(crate) fn push(&mut self, target: Target) {
        self.targets.push(target);
    }

    /// Inserts target tensors at position `at` of those already there.
    pub(crate) fn splice(&mut self, at: usize, targets: Vec<Target>) {
        let at = at.min(self.targets.len());
        self.targets.splice(at..at, targets);
    }

    /// How many target tensors it has so far.
    pub(crate) fn len(&self) -> usize {
        self.targets.len()
    }

    /// Leaves the source tensor `source` out of the target on purpose (an optimizer's tensor
    /// in a model's view, a copy another rank also holds).
    pub(crate) fn leave_out(&mut self, source: impl Into<String>) {
        self.dropped.insert(source.into());
    }

    /// The target tensors, each made of boxes of the stored bytes that `sources` (the catalog
    /// as read) describe. Nothing is read. A piece that reads a missing source or outside one,
    /// pieces that overlap or leave a hole, and a source no target reads and the map does not
    /// drop are refused, naming the tensor; `root` names the checkpoint. The targets' boxes are
    /// checked again by [`crate::read::catalog::Checkpoint::new`], as every catalog's are.
    pub(crate) fn apply(&self, root: &Path, sources: &[TensorInfo]) -> Result<Vec<TensorInfo>> {
        let bad = |tensor: &str, problem: MapProblem| Error::BadModelMap {
            path: root.to_path_buf(),
            tensor: tensor.into(),
            problem: Box::new(problem),
        };
        let mut by_name: HashMap<&str, usize> = HashMap::with_capacity(sources.len());
        for (i, t) in sources.iter().enumerate() {
            if by_name.insert(t.name.as_str(), i).is_some() {
                return Err(Error::DuplicateTensor { path: root.to_path_buf(), tensor: t.name.clone() });
            }
        }
        let mut read = vec![false; sources.len()];
        let mut out = Vec::with_capacity(self.targets.len());
        for target in &self.targets {
            let mut found = Vec::with_capacity(target.pieces.len());
            for p in &target.pieces {
                let Some(&i) = by_name.get(p.source.as_str()) else {
                    return Err(bad(&target.name, MapProblem::UnknownSource { source_name: p.source.clone() }));
                };
                check_piece(p, target, &sources[i]).map_err(|e| bad(&target.name, e))?;
                read[i] = true;
                found.push(&sources[i]);
            }
            out.push(assemble(target, &found).map_err(|e| bad(&target.name, e))?);
        }
        if let Some(left) = sources.iter().zip(&read).find(|(t, r)| !**r && !self.dropped.contains(&t.name)) {
            return Err(bad(&left.0.name, MapProblem::Unplaced { view: self.view }));
        }
        Ok(out)
    }
}

/// A piece fits its target's dims and its source's shape.
fn check_piece(p: &Piece, target: &Target, source: &TensorInfo) -> std::result::Result<(), MapProblem> {
    let rank = |expected: usize, found: usize| MapProblem::PieceRank {
        source_name: p.source.clone(),
        at: p.at.offsets.clone(),
        expected,
        found,
    };
    let n = target.shape.len();
    if p.axes.len() != n || p.at.offsets.len() != n || p.at.sizes.len() != n {
        return Err(rank(n, p.axes.len().max(p.at.offsets.len()).max(p.at.sizes.len())));
    }
    if p.from.len() != source.shape.len() {
        return Err(rank(source.shape.len(), p.from.len()));
    }
    if p.at.is_empty() {
        return Ok(());
    }
    let inside = p.last().is_some_and(|last| last.iter().zip(&source.shape).all(|(&l, &s)| l < s));
    if !inside {
        return Err(MapProblem::PieceOutside {
            source_name: p.source.clone(),
            at: p.at.offsets.clone(),
            sizes: p.at.sizes.clone(),
            shape: source.shape.clone(),
        });
    }
    Ok(())
}

/// One target tensor from its pieces' sources (`found`, one per piece).
fn assemble(target: &Target, found: &[&TensorInfo]) -> std::result::Result<TensorInfo, MapProblem> {
    let regions: Vec<Region> = target.pieces.iter().map(|p| p.at.clone()).collect();
    // One piece that is the whole target tiles it whatever it reads.
    let one_whole = matches!(regions.as_slice(), [r] if r.is_whole(&target.shape));
    if !one_whole {
        fsdp_state::check_tiling(&target.shape, &regions).map_err(MapProblem::Tiling)?;
    }
    // A tensor takes its dtype from its sources, so even one without elements has a piece.
    let Some(first) = found.first() else { return Err(MapProblem::NoPieces) };
    if let Some(other) = found.iter().find(|t| t.stored != first.stored || t.dtype != first.dtype) {
        return Err(MapProblem::MixedDtypes {
            first: first.name.clone(),
            first_dtype: first.dtype,
            other: other.name.clone(),
            other_dtype: other.dtype,
        });
    }
    let dtype = target.cast.unwrap_or(first.dtype);
    if dtype != first.stored && !(first.stored.is_castable() && dtype.is_castable()) {
        return Err(MapProblem::BadCast { stored: first.stored, to: dtype });
    }
    let named =
        |data| TensorInfo { name: target.name.clone(), dtype, shape: target.shape.clone(), stored: first.stored, data };
    // A source taken whole and as it is keeps its description (byte ranges stay ranges).
    if let [p] = target.pieces.as_slice() {
        if first.shape == target.shape && *p == Piece::whole(p.source.clone(), &target.shape) {
            return Ok(named(first.data.clone()));
        }
    }
    let mut boxes = Vec::new();
    for (p, source) in target.pieces.iter().zip(found) {
        if p.at.is_empty() {
            continue;
        }
        for b in source_boxes(source)?.iter() {
            boxes.extend(compose(p, b));
        }
    }
    Ok(named(TensorData::Boxes(boxes)))
}

/// A source tensor's stored bytes as boxes: its own, or its byte ranges cut into boxes.
fn source_boxes(t: &TensorInfo) -> std::result::Result<std::borrow::Cow<'_, [TensorBox]>, MapProblem> {
    match &t.data {
        TensorData::Boxes(b) => Ok(std::borrow::Cow::Borrowed(b)),
        TensorData::Ranges(chunks) => {
            let bits = t.stored.bits();
            if !bits.is_multiple_of(8) || bits == 0 {
                return Err(MapProblem::SubByte { dtype: t.stored });
            }
            Ok(std::borrow::Cow::Owned(range_boxes(&t.shape, bits / 8, chunks)))
        }
    }
}

/// Byte ranges whose concatenation is the row-major tensor of `shape`, as boxes: each range
/// holds a run of the tensor's flat elements, which is at most two boxes per dim (a partial
/// row at each end, whole rows between). A range that is not a whole number of elements
/// yields a box its bytes cannot hold, which the catalog's check refuses.
fn range_boxes(shape: &[u64], elem: u64, chunks: &[Chunk]) -> Vec<TensorBox> {
    let Some(strides) = shape::contiguous_strides(shape) else { return Vec::new() };
    let mut out = Vec::new();
    let mut at = 0u64;
    for c in chunks {
        let n = c.len.div_ceil(elem);
        let mut regions = Vec::new();
        flat_regions(shape, at, at.saturating_add(n), &mut Vec::new(), &mut regions);
        for region in regions {
            let start: u64 = region.offsets.iter().zip(&strides).map(|(&o, &s)| o.saturating_mul(s)).sum();
            out.push(TensorBox {
                region,
                file: c.file,
                base: c.offset,
                len: c.len,
                offset: start - at,
                strides: strides.clone(),
            });
        }
        at = at.saturating_add(n);
    }
    out
}

/// The boxes of flat elements `a..b` of a row-major tensor of `shape`, each with `prefix` (the
/// indices of the dims outside `shape`, held) in front.
fn flat_regions(shape: &[u64], a: u64, b: u64, prefix: &mut Vec<u64>, out: &mut Vec<Region>) {
    if a >= b {
        return;
    }
    let held = |prefix: &[u64], rest: Vec<u64>, sizes: Vec<u64>| {
        let mut offsets = prefix.to_vec();
        offsets.extend(rest);
        let mut all = vec![1; prefix.len()];
        all.extend(sizes);
        Region::new(offsets, all)
    };
    let Some((&rows, inner_shape)) = shape.split_first() else {
        out.push(held(prefix, Vec::new(), Vec::new()));
        return;
    };
    let inner = shape::numel(inner_shape).unwrap_or(0);
    if inner == 0 || rows == 0 {
        return;
    }
    let (first, last) = (a / inner, (b - 1) / inner);
    let sub = |row: u64, lo: u64, hi: u64, prefix: &mut Vec<u64>, out: &mut Vec<Region>| {
        prefix.push(row);
        flat_regions(inner_shape, lo, hi, prefix, out);
        prefix.pop();
    };
    if first == last {
        sub(first, a - first * inner, b - first * inner, prefix, out);
        return;
    }
    let (a_aligned, b_aligned) = (a.is_multiple_of(inner), b.is_multiple_of(inner));
    let whole_from = if a_aligned { first } else { first + 1 };
    let whole_to = if b_aligned { last + 1 } else { last };
    if !a_aligned {
        sub(first, a % inner, inner, prefix, out);
    }
    if whole_from < whole_to {
        let mut rest = vec![whole_from];
        rest.extend(std::iter::repeat_n(0, inner_shape.len()));
        let mut sizes = vec![whole_to - whole_from];
        sizes.extend(inner_shape);
        out.push(held(prefix, rest, sizes));
    }
    if !b_aligned {
        sub(last, 0, b % inner, prefix, out);
    }
}

/// The part of piece `p` that source box `b` holds, as a box of the target: the same storage,
/// its view stepped as the piece steps the source. `None` when they share no element.
fn compose(p: &Piece, b: &TensorBox) -> Option<TensorBox> {
    if b.region.is_empty() {
        return None;
    }
    // The source index of the composed box's first element, per source dim.
    let mut first = p.from.clone();
    let mut walked = vec![false; first.len()];
    let (mut offsets, mut sizes, mut strides) = (Vec::new(), Vec::new(), Vec::new());
    for (k, axis) in p.axes.iter().enumerate() {
        let (at, n) = (*p.at.offsets.get(k)?, *p.at.sizes.get(k)?);
        match *axis {
            Axis::Source { dim, step } => {
                let (lo, size) = (*b.region.offsets.get(dim)?, *b.region.sizes.get(dim)?);
                let f = *p.from.get(dim)?;
                // Target steps i with lo <= f + i·step < lo + size, and i < n.
                let i_lo = if f >= lo { 0 } else { (lo - f).div_ceil(step) };
                let hi = lo.checked_add(size)?;
                if hi <= f {
                    return None;
                }
                let i_hi = n.min((hi - 1 - f) / step + 1);
                if i_lo >= i_hi {
                    return None;
                }
                offsets.push(at + i_lo);
                sizes.push(i_hi - i_lo);
                strides.push(step.saturating_mul(*b.strides.get(dim)?));
                first[dim] = f + i_lo * step;
                walked[dim] = true;
            }
            Axis::New => {
                offsets.push(at);
                sizes.push(n);
                // A size-1 axis is never stepped.
                strides.push(0);
            }
        }
    }
    let mut offset = b.offset;
    for (dim, &i) in first.iter().enumerate() {
        let (lo, size) = (*b.region.offsets.get(dim)?, *b.region.sizes.get(dim)?);
        // A held dim: the box must hold that index.
        if !walked[dim] && (i < lo || i - lo >= size) {
            return None;
        }
        offset = offset.saturating_add((i - lo).saturating_mul(*b.strides.get(dim)?));
    }
    Some(TensorBox { region: Region::new(offsets, sizes), file: b.file, base: b.base, len: b.len, offset, strides })
}

#[cfg(test)]
mod tests;
