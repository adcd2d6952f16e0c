//! FSDP layouts.
//!
//! FSDP2 shards every parameter on its own along dim 0 as `torch.chunk(world)` does: each rank
//! takes `ceil(rows / world)` rows, so the last ranks may get fewer rows or none at all (their
//! local tensor is empty). FSDP1 instead concatenates all parameters of a wrapped module into one
//! flat vector, pads it with zeros to a multiple of the world size, and gives every rank an equal
//! chunk; a parameter can straddle ranks.

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
    pub name: String,
    pub shape: Vec<u64>,
    /// Element offset in the unpadded flat vector.
    pub offset: u64,
    pub numel: u64,
}

/// FSDP1 flat parameter: one slot per rank.
#[derive(Clone, Debug)]
pub struct Fsdp1Flat {
    tensors: Vec<TensorSpec>,
    world: u64,
    params: Vec<FlatParamInfo>,
    chunk: u64,
}

impl Fsdp1Flat {
    pub fn new(tensors: Vec<TensorSpec>, world: u64) -> Result<Fsdp1Flat, LayoutError> {
        if world == 0 {
            return Err(LayoutError::EmptyWorld);
        }
        let mut params = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for t in &tensors {
            let numel = numel_of(t)?;
            params.push(FlatParamInfo { name: t.name.clone(), shape: t.shape.clone(), offset, numel });
            offset = offset
                .checked_add(numel)
                .ok_or_else(|| LayoutError::Overflow { tensor: t.name.clone(), shape: t.shape.clone() })?;
        }
        // Padded to a multiple of the world size, then equal chunks.
        let chunk = offset.div_ceil(world);
        Ok(Fsdp1Flat { tensors, world, params, chunk })
    }

    pub fn params(&self) -> &[FlatParamInfo] {
        &self.params
    }

    /// Elements per rank, padding included.
    pub fn chunk_len(&self) -> u64 {
        self.chunk
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
    fn fsdp2_local_shape_follows_torch_chunk() {
        let l = Fsdp2::new(vec![TensorSpec::new("w", [3, 5])], 4).unwrap_or_else(|e| panic!("{e}"));
        let shapes: Vec<Vec<u64>> = (0..4).filter_map(|r| l.local_shape(0, r)).collect();
        assert_eq!(shapes, vec![vec![1, 5], vec![1, 5], vec![1, 5], vec![0, 5]]);
        assert!(matches!(Fsdp2::new(vec![TensorSpec::new("s", [])], 2), Err(LayoutError::ScalarShard { .. })));
    }
}
