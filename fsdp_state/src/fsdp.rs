//! FSDP layouts.
//!
//! FSDP2 shards every parameter on its own along dim 0 as `torch.chunk(world)` does: each rank
//! takes `ceil(rows / world)` rows, so the last ranks may get fewer rows or none at all (their
//! local tensor is empty).
//!
//! FSDP1 instead concatenates all parameters of a wrapped module into one flat parameter and
//! gives every rank an equal chunk of it; a parameter can straddle ranks. How the parameters are
//! laid out in it depends on `use_orig_params`, because only then does FSDP1 hand out views of
//! the flat parameter as the original parameters, and those views must be aligned as
//! TorchInductor expects (torch `torch/distributed/fsdp/_flat_param.py`,
//! `FlatParamHandle._init_flat_param_and_metadata` with `align_addresses = use_orig_params`):
//!
//! - `use_orig_params=False` ([`Fsdp1Flat::new`]): the parameters back to back, nothing in
//!   between. `_get_shard` cuts the flat parameter with `torch.chunk(world)` and pads each short
//!   shard with zeros to the first one's length (`_shard_numel_padded`), so the padding exists
//!   only in the shards of the last ranks.
//! - `use_orig_params=True`, the default of accelerate and the HF Trainer
//!   ([`Fsdp1Flat::with_alignment`]): every parameter starts at a multiple of
//!   `aligned_numel = 16 / itemsize` elements (`_get_aligned_numel`; 4 for float32, 8 for
//!   bfloat16), so before each parameter that would start misaligned (never the first) a
//!   padding tensor fills the gap; no alignment padding follows the last parameter. Then one
//!   more padding tensor brings the flat parameter to a multiple of the world size. These are
//!   entries of the flat parameter like the parameters (`_numels_with_padding`, marked in
//!   `_is_padding_mask`), filled with `_FLAT_PARAM_PADDING_VALUE` (42), counted in
//!   `_unpadded_unsharded_size`, and sit in the shards of whichever ranks their range falls on;
//!   the shards are then exact slices and `_shard_numel_padded` is 0 on every rank.
//!
//! Both share one model: a list of [`FlatEntry`]s, parameters and padding, cut into
//! `ceil(len / world)`-element shards. Padding holds no piece, so resharding between the two
//! layouts, or to any other, copies only parameter elements.

use crate::layout::{numel_of, Layout, LayoutError, Piece, TensorSpec};

/// The half-open row range `[start, end)` of dim 0 that `rank` holds when a dimension of
/// `len` rows is chunked over `world` ranks the way `torch.chunk` (and FSDP2's `Shard(0)`) does.
///
/// Returns `None` when `world` is 0 or `rank >= world`.
pub fn chunk_rows(len: u64, world: u64, rank: u64) -> Option<std::ops::Range<u64>> {
    if world == 0 || rank >= world {
        return None;
    }
    let chunk = len.div_ceil(world);
    let start = chunk.saturating_mul(rank).min(len);
    let end = start.saturating_add(chunk).min(len);
    Some(start..end)
}

/// FSDP2 per-parameter dim-0 sharding. Slot `i` of every rank is its local tensor of parameter `i`.
#[derive(Clone, Debug)]
pub struct Fsdp2 {
    tensors: Vec<TensorSpec>,
    world: u64,
    rows: Vec<(u64, u64)>, // (rows, row_len) per tensor
}

impl Fsdp2 {
    /// FSDP2 `Shard(0)` sharding of `tensors` over `world` ranks. Refuses 0 ranks, 0-d tensors
    /// (no dim 0 to shard) and tensors too large to count.
    pub fn new(tensors: Vec<TensorSpec>, world: u64) -> Result<Fsdp2, LayoutError> {
        if world == 0 {
            return Err(LayoutError::EmptyWorld);
        }
        let mut rows = Vec::with_capacity(tensors.len());
        for t in &tensors {
            numel_of(t)?;
            let Some(&n) = t.shape.first() else {
                return Err(LayoutError::ScalarShard { tensor: t.name.clone() });
            };
            let row_len =
                t.row_len().ok_or_else(|| LayoutError::Overflow { tensor: t.name.clone(), shape: t.shape.clone() })?;
            rows.push((n, row_len));
        }
        Ok(Fsdp2 { tensors, world, rows })
    }

    /// The local shape of parameter `tensor` on `rank`: its dim-0 chunk.
    pub fn local_shape(&self, tensor: usize, rank: u64) -> Option<Vec<u64>> {
        let t = self.tensors.get(tensor)?;
        let r = chunk_rows(self.rows[tensor].0, self.world, rank)?;
        let mut shape = t.shape.clone();
        shape[0] = r.end - r.start;
        Some(shape)
    }
}

impl Layout for Fsdp2 {
    fn world(&self) -> u64 {
        self.world
    }
    fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }
    fn pieces(&self, rank: u64) -> Vec<Piece> {
        self.rows
            .iter()
            .enumerate()
            .filter_map(|(i, &(n, row_len))| {
                let r = chunk_rows(n, self.world, rank)?;
                (!r.is_empty()).then(|| Piece {
                    tensor: i,
                    elems: r.start * row_len..r.end * row_len,
                    rank,
                    slot: i,
                    local: 0,
                })
            })
            .collect()
    }
    fn slot_lens(&self, rank: u64) -> Vec<u64> {
        self.rows
            .iter()
            .map(|&(n, row_len)| chunk_rows(n, self.world, rank).map_or(0, |r| (r.end - r.start) * row_len))
            .collect()
    }
}

/// Where a parameter sits in an FSDP1 flat parameter (the metadata that maps flat ranges back
/// to the original parameters).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatParamInfo {
    /// The original parameter's name.
    pub name: String,
    /// The original parameter's shape, which its flat range is viewed back as.
    pub shape: Vec<u64>,
    /// Element offset in the unsharded flat parameter, the alignment padding before it included.
    pub offset: u64,
    /// Number of elements it occupies in the flat parameter (no padding).
    pub numel: u64,
}

/// One entry of an FSDP1 flat parameter, in flattening order: what torch lists in
/// `_numels_with_padding`, with `_is_padding_mask` telling the two kinds apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlatEntry {
    /// Parameter `tensor` (an index into the layout's tensors), `numel` elements.
    Param {
        /// Index of the parameter in the layout's tensors.
        tensor: usize,
        /// Its element count.
        numel: u64,
    },
    /// `numel` elements of padding that torch inserted as a tensor of its own (filled with
    /// `_FLAT_PARAM_PADDING_VALUE`): alignment before a parameter, or the padding up to a
    /// multiple of the world size at the end.
    Padding {
        /// Number of padding elements.
        numel: u64,
    },
}

impl FlatEntry {
    /// Elements the entry occupies in the flat parameter.
    pub fn numel(&self) -> u64 {
        match *self {
            FlatEntry::Param { numel, .. } | FlatEntry::Padding { numel } => numel,
        }
    }

    /// True for padding, false for a parameter (torch's `_is_padding_mask` entry).
    pub fn is_padding(&self) -> bool {
        matches!(self, FlatEntry::Padding { .. })
    }
}

/// FSDP1 flat parameter: one slot per rank. See the module docs for its two layouts.
#[derive(Clone, Debug)]
pub struct Fsdp1Flat {
    tensors: Vec<TensorSpec>,
    world: u64,
    aligned_numel: u64,
    params: Vec<FlatParamInfo>,
    entries: Vec<FlatEntry>,
    /// Sum of `entries`: torch's `_unpadded_unsharded_size`.
    unsharded: u64,
    chunk: u64,
}

/// The address alignment FSDP1 gives every parameter of a flat parameter when it aligns them
/// (torch's `_get_aligned_numel`: TorchInductor wants 16-byte aligned tensors).
const ALIGNMENT_BYTES: u64 = 16;

impl Fsdp1Flat {
    /// The flat parameter FSDP1 builds with `use_orig_params=False`: parameters back to back,
    /// no padding entries; the shards are padded to equal length instead.
    pub fn new(tensors: Vec<TensorSpec>, world: u64) -> Result<Fsdp1Flat, LayoutError> {
        Fsdp1Flat::with_alignment(tensors, world, 0)
    }

    /// The flat parameter FSDP1 builds for a given `aligned_numel`, the argument of torch's
    /// `FlatParamHandle._init_flat_param_and_metadata`. With `use_orig_params=True` torch passes
    /// [`Fsdp1Flat::aligned_numel_for`] the itemsize of the dtype FSDP computes in (the
    /// parameter dtype, or mixed precision's `param_dtype`); otherwise 0, which gives
    /// [`Fsdp1Flat::new`].
    ///
    /// With `aligned_numel > 0`, a parameter that would start at an offset that is not a
    /// multiple of `aligned_numel` gets a padding entry before it, and a padding entry at the
    /// end brings the flat parameter to a multiple of the world size, so every shard is an
    /// exact slice of it.
    pub fn with_alignment(tensors: Vec<TensorSpec>, world: u64, aligned_numel: u64) -> Result<Fsdp1Flat, LayoutError> {
        if world == 0 {
            return Err(LayoutError::EmptyWorld);
        }
        let overflow = |t: &TensorSpec| LayoutError::Overflow { tensor: t.name.clone(), shape: t.shape.clone() };
        let mut params = Vec::with_capacity(tensors.len());
        let mut entries = Vec::with_capacity(2 * tensors.len() + 1);
        let mut offset = 0u64;
        for (i, t) in tensors.iter().enumerate() {
            let numel = numel_of(t)?;
            if aligned_numel > 0 && !offset.is_multiple_of(aligned_numel) {
                let pad = aligned_numel - offset % aligned_numel;
                entries.push(FlatEntry::Padding { numel: pad });
                offset = offset.checked_add(pad).ok_or_else(|| overflow(t))?;
            }
            params.push(FlatParamInfo { name: t.name.clone(), shape: t.shape.clone(), offset, numel });
            entries.push(FlatEntry::Param { tensor: i, numel });
            offset = offset.checked_add(numel).ok_or_else(|| overflow(t))?;
        }
        // Only the aligned flat parameter is padded to a multiple of the world size as a tensor
        // of its own (torch does it "to avoid a copy for the post-backward reduce-scatter");
        // without alignment `_get_shard` pads each short shard instead (`_shard_numel_padded`).
        // With no tensors the offset is 0, already a multiple.
        if let Some(last) = tensors.last() {
            if aligned_numel > 0 && !offset.is_multiple_of(world) {
                let pad = world - offset % world;
                entries.push(FlatEntry::Padding { numel: pad });
                offset = offset.checked_add(pad).ok_or_else(|| overflow(last))?;
            }
        }
        // Shards as `torch.chunk(world)` cuts the flat parameter, each padded to the first one's
        // length: exact when the flat parameter is already a multiple of the world size.
        let chunk = offset.div_ceil(world);
        Ok(Fsdp1Flat { tensors, world, aligned_numel, params, entries, unsharded: offset, chunk })
    }

    /// The `aligned_numel` FSDP1 uses for a dtype of `itemsize` bytes when it aligns
    /// parameters: `16 / itemsize` elements, rounded down as torch's `_get_aligned_numel` does.
    /// `None` for an itemsize of 0.
    pub fn aligned_numel_for(itemsize: u64) -> Option<u64> {
        ALIGNMENT_BYTES.checked_div(itemsize)
    }

    /// The alignment this layout was built with, in elements (0: none).
    pub fn aligned_numel(&self) -> u64 {
        self.aligned_numel
    }

    /// Where each parameter sits in the flat parameter, in layout (registration) order.
    pub fn params(&self) -> &[FlatParamInfo] {
        &self.params
    }

    /// Parameters and padding entries in flattening order (`_numels_with_padding`).
    pub fn entries(&self) -> &[FlatEntry] {
        &self.entries
    }

    /// Elements of the unsharded flat parameter, padding entries included but not the padding
    /// `_get_shard` adds to short shards (torch's `_unpadded_unsharded_size`).
    pub fn unsharded_len(&self) -> u64 {
        self.unsharded
    }

    /// Elements per rank, padding included.
    pub fn chunk_len(&self) -> u64 {
        self.chunk
    }

    /// How many elements at the end of `rank`'s shard lie past the unsharded flat parameter
    /// (torch's `_shard_numel_padded`); `None` when `rank >= world`.
    pub fn shard_numel_padded(&self, rank: u64) -> Option<u64> {
        if rank >= self.world {
            return None;
        }
        let lo = rank.saturating_mul(self.chunk).min(self.unsharded);
        let hi = lo.saturating_add(self.chunk).min(self.unsharded);
        Some(self.chunk - (hi - lo))
    }

    /// The local ranges of `rank`'s shard that hold padding rather than a parameter: the parts
    /// of padding entries that fall in the shard, then the tail past the flat parameter. With
    /// [`Layout::pieces`] they tile the shard. Empty when `rank >= world`.
    pub fn padding(&self, rank: u64) -> Vec<std::ops::Range<u64>> {
        if rank >= self.world {
            return Vec::new();
        }
        let lo = rank.saturating_mul(self.chunk);
        let hi = lo.saturating_add(self.chunk);
        let mut ranges = Vec::new();
        let mut offset = 0u64;
        for e in &self.entries {
            let (s, t) = (offset.max(lo), (offset + e.numel()).min(hi));
            if e.is_padding() && s < t {
                ranges.push(s - lo..t - lo);
            }
            offset += e.numel();
        }
        let tail = self.unsharded.max(lo);
        if tail < hi {
            ranges.push(tail - lo..hi - lo);
        }
        ranges
    }
}

impl Layout for Fsdp1Flat {
    fn world(&self) -> u64 {
        self.world
    }
    fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }
    fn pieces(&self, rank: u64) -> Vec<Piece> {
        let lo = rank * self.chunk;
        let hi = lo + self.chunk;
        self.params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let s = p.offset.max(lo);
                let e = (p.offset + p.numel).min(hi);
                (s < e).then(|| Piece { tensor: i, elems: s - p.offset..e - p.offset, rank, slot: 0, local: s - lo })
            })
            .collect()
    }
    fn slot_lens(&self, _rank: u64) -> Vec<u64> {
        vec![self.chunk]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_ranks_may_hold_nothing() {
        // torch.chunk(torch.arange(5), 4) gives sizes [2, 2, 1] and a fourth, empty, rank.
        let sizes: Vec<u64> = (0..4).map(|r| chunk_rows(5, 4, r).map_or(99, |x| x.end - x.start)).collect();
        assert_eq!(sizes, vec![2, 2, 1, 0]);
    }

    #[test]
    fn out_of_range_rank_is_none() {
        assert_eq!(chunk_rows(10, 2, 2), None);
        assert_eq!(chunk_rows(10, 0, 0), None);
    }

    #[test]
    fn fsdp1_pads_to_a_multiple_of_the_world() {
        let l = Fsdp1Flat::new(vec![TensorSpec::new("a", [3, 3]), TensorSpec::new("b", [2])], 4)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l.chunk_len(), 3); // 11 elements padded to 12
        assert_eq!(l.params()[1].offset, 9);
        let p3 = l.pieces(3);
        assert_eq!(p3.len(), 1);
        assert_eq!((p3[0].tensor, p3[0].elems.clone(), p3[0].local), (1, 0..2, 0));
    }

    #[test]
    fn fsdp1_without_alignment_pads_the_last_shard() {
        let l = Fsdp1Flat::new(vec![TensorSpec::new("a", [1]), TensorSpec::new("b", [2])], 2)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l.entries(), [FlatEntry::Param { tensor: 0, numel: 1 }, FlatEntry::Param { tensor: 1, numel: 2 }]);
        assert_eq!((l.unsharded_len(), l.chunk_len()), (3, 2));
        assert_eq!(
            (l.shard_numel_padded(0), l.shard_numel_padded(1), l.shard_numel_padded(2)),
            (Some(0), Some(1), None)
        );
        assert_eq!(l.padding(1), vec![1..2]);
    }

    #[test]
    fn fsdp1_alignment_pads_before_parameters_and_to_the_world() {
        // torch 2.13, use_orig_params=True, float32, 4 ranks (fixture `fsdp1_orig_tiny_w4`):
        // `_numels_with_padding` [1, 3, 2, 2], `_is_padding_mask` [F, T, F, T].
        let l = Fsdp1Flat::with_alignment(vec![TensorSpec::new("a", [1]), TensorSpec::new("b", [2])], 4, 4)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            l.entries(),
            [
                FlatEntry::Param { tensor: 0, numel: 1 },
                FlatEntry::Padding { numel: 3 },
                FlatEntry::Param { tensor: 1, numel: 2 },
                FlatEntry::Padding { numel: 2 },
            ]
        );
        assert_eq!(l.params()[1].offset, 4);
        assert_eq!((l.unsharded_len(), l.chunk_len()), (8, 2));
        assert!((0..4).all(|r| l.shard_numel_padded(r) == Some(0)));
        let padding: Vec<_> = (0..4).map(|r| l.padding(r)).collect();
        assert_eq!(padding, vec![vec![1..2], vec![0..2], vec![], vec![0..2]]);
        assert_eq!(l.pieces(2).len(), 1);
        assert_eq!((l.pieces(2)[0].elems.clone(), l.pieces(2)[0].local), (0..2, 0));
    }

    #[test]
    fn fsdp1_alignment_is_sixteen_bytes() {
        let by_itemsize: Vec<_> = [1, 2, 4, 8, 0].into_iter().map(Fsdp1Flat::aligned_numel_for).collect();
        assert_eq!(by_itemsize, vec![Some(16), Some(8), Some(4), Some(2), None]);
    }

    #[test]
    fn fsdp2_local_shape_follows_torch_chunk() {
        let l = Fsdp2::new(vec![TensorSpec::new("w", [3, 5])], 4).unwrap_or_else(|e| panic!("{e}"));
        let shapes: Vec<Vec<u64>> = (0..4).filter_map(|r| l.local_shape(0, r)).collect();
        assert_eq!(shapes, vec![vec![1, 5], vec![1, 5], vec![1, 5], vec![0, 5]]);
        assert!(matches!(Fsdp2::new(vec![TensorSpec::new("s", [])], 2), Err(LayoutError::ScalarShard { .. })));
    }
}
