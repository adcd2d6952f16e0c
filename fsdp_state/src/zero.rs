//! DeepSpeed ZeRO layouts.
//!
//! **Stage 1/2.** Each parameter group is flattened into one vector in `param_shapes` order.
//! With `parameter_alignment`, every parameter but the last is followed by a few zeros
//! (recorded per parameter). The group is then padded to a multiple of `2 × world`
//! (DeepSpeed's NCCL start-alignment factor of 2 times the data-parallel size) and cut into
//! `world` equal partitions; rank `r` keeps partition `r` of every group, one slot per group.
//! When saving, DeepSpeed drops the trailing group padding from the last rank(s), so the saved
//! partitions concatenate to the unpadded group; pieces never cover padding, so the same
//! layout describes both.
//!
//! **Stage 3.** Every parameter is partitioned on its own: `part = ceil(numel / world)`
//! elements per rank, the last rank zero-padded. A rank's buffer is its part of each parameter
//! in order (one slot), so each rank holds `Σ part(p)` elements.

use crate::layout::{numel_of, Layout, LayoutError, Piece, TensorSpec};

/// ZeRO stage 1/2 flat groups.
#[derive(Clone, Debug)]
pub struct Zero12 {
    tensors: Vec<TensorSpec>,
    world: u64,
    /// Per group: (tensor index, flat offset in the group) for each parameter.
    groups: Vec<Vec<(usize, u64)>>,
    /// Per group: partition length (elements per rank, padding included).
    partition: Vec<u64>,
    /// Per group: the unpadded flat length, alignment paddings between parameters included.
    flat_len: Vec<u64>,
}

impl Zero12 {
    /// `groups` lists tensor indices per parameter group, in flattening order. `param_padding`,
    /// when given, holds for each group the zeros that follow each parameter
    /// (`param_alignment_paddings`).
    pub fn new(
        tensors: Vec<TensorSpec>,
        groups: Vec<Vec<usize>>,
        param_padding: Option<Vec<Vec<u64>>>,
        world: u64,
    ) -> Result<Zero12, LayoutError> {
        if world == 0 {
            return Err(LayoutError::EmptyWorld);
        }
        let alignment = 2 * world;
        let mut placed = Vec::with_capacity(groups.len());
        let mut partition = Vec::with_capacity(groups.len());
        let mut flat_len = Vec::with_capacity(groups.len());
        for (g, members) in groups.iter().enumerate() {
            let pads = match &param_padding {
                None => vec![0; members.len()],
                Some(all) => {
                    let p = all.get(g).cloned().unwrap_or_default();
                    if p.len() != members.len() {
                        return Err(LayoutError::BadPadding { group: g, expected: members.len(), found: p.len() });
                    }
                    p
                }
            };
            let mut offset = 0u64;
            let mut entries = Vec::with_capacity(members.len());
            for (&i, pad) in members.iter().zip(pads) {
                let t = tensors.get(i).ok_or(LayoutError::BadGroup { group: g, index: i, count: tensors.len() })?;
                let n = numel_of(t)?;
                entries.push((i, offset));
                offset = offset
                    .checked_add(n)
                    .and_then(|o| o.checked_add(pad))
                    .ok_or_else(|| LayoutError::Overflow { tensor: t.name.clone(), shape: t.shape.clone() })?;
            }
            let padded = offset.div_ceil(alignment) * alignment;
            placed.push(entries);
            partition.push(padded / world);
            flat_len.push(offset);
        }
        Ok(Zero12 { tensors, world, groups: placed, partition, flat_len })
    }

    /// Elements per rank in group `g`, padding included.
    pub fn partition_len(&self, g: usize) -> Option<u64> {
        self.partition.get(g).copied()
    }

    /// The elements of group `g` that `rank` saves: its partition without trailing padding.
    pub fn saved_len(&self, g: usize, rank: u64) -> Option<u64> {
        let p = *self.partition.get(g)?;
        let start = (p * rank).min(self.flat_len[g]);
        Some((p * (rank + 1)).min(self.flat_len[g]) - start)
    }
}

impl Layout for Zero12 {
    fn world(&self) -> u64 {
        self.world
    }
    fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }
    fn pieces(&self, rank: u64) -> Vec<Piece> {
        let mut out = Vec::new();
        for (g, entries) in self.groups.iter().enumerate() {
            let lo = self.partition[g] * rank;
            let hi = lo + self.partition[g];
            for &(i, offset) in entries {
                let n = self.tensors[i].numel().unwrap_or(0);
                let s = offset.max(lo);
                let e = (offset + n).min(hi);
                if s < e {
                    out.push(Piece { tensor: i, elems: s - offset..e - offset, rank, slot: g, local: s - lo });
                }
            }
        }
        out
    }
    fn slot_lens(&self, _rank: u64) -> Vec<u64> {
        self.partition.clone()
    }
}

/// ZeRO stage 3 per-parameter partitions.
#[derive(Clone, Debug)]
pub struct Zero3 {
    tensors: Vec<TensorSpec>,
    world: u64,
    /// Per tensor: (numel, part, offset of its part in every rank's buffer).
    parts: Vec<(u64, u64, u64)>,
}

impl Zero3 {
    /// ZeRO-3 partitions of `tensors` over `world` ranks; [`LayoutError::EmptyWorld`] for 0
    /// ranks, [`LayoutError::Overflow`] for a tensor too large to count.
    pub fn new(tensors: Vec<TensorSpec>, world: u64) -> Result<Zero3, LayoutError> {
        if world == 0 {
            return Err(LayoutError::EmptyWorld);
        }
        let mut parts = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for t in &tensors {
            let n = numel_of(t)?;
            let part = n.div_ceil(world);
            parts.push((n, part, offset));
            offset += part;
        }
        Ok(Zero3 { tensors, world, parts })
    }

    /// Elements each rank holds, padding included.
    pub fn rank_len(&self) -> u64 {
        self.parts.iter().map(|p| p.1).sum()
    }
}

impl Layout for Zero3 {
    fn world(&self) -> u64 {
        self.world
    }
    fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }
    fn pieces(&self, rank: u64) -> Vec<Piece> {
        self.parts
            .iter()
            .enumerate()
            .filter_map(|(i, &(n, part, offset))| {
                let s = (part * rank).min(n);
                let e = (part * (rank + 1)).min(n);
                (s < e).then_some(Piece { tensor: i, elems: s..e, rank, slot: 0, local: offset })
            })
            .collect()
    }
    fn slot_lens(&self, _rank: u64) -> Vec<u64> {
        vec![self.rank_len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero12_pads_groups_to_twice_the_world() {
        // 7 + 3 = 10 elements on 4 ranks: padded to 16 (a multiple of 8), partitions of 4.
        let t = vec![TensorSpec::new("a", [7]), TensorSpec::new("b", [3])];
        let l = Zero12::new(t, vec![vec![0, 1]], None, 4).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l.partition_len(0), Some(4));
        let saved: Vec<u64> = (0..4).filter_map(|r| l.saved_len(0, r)).collect();
        assert_eq!(saved, vec![4, 4, 2, 0]);
        let p1 = l.pieces(1);
        assert_eq!(
            p1.iter().map(|p| (p.tensor, p.elems.clone(), p.local)).collect::<Vec<_>>(),
            vec![(0, 4..7, 0), (1, 0..1, 3)]
        );
    }

    #[test]
    fn zero12_alignment_padding_shifts_later_parameters() {
        let t = vec![TensorSpec::new("a", [3]), TensorSpec::new("b", [2])];
        let l = Zero12::new(t, vec![vec![0, 1]], Some(vec![vec![5, 0]]), 1).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l.pieces(0)[1].local, 8);
        let bad = Zero12::new(vec![TensorSpec::new("a", [3])], vec![vec![0]], Some(vec![vec![]]), 1);
        assert!(matches!(bad, Err(LayoutError::BadPadding { .. })));
    }

    #[test]
    fn zero3_parts_are_ceil_numel_over_world() {
        let t = vec![TensorSpec::new("a", [5]), TensorSpec::new("b", [1])];
        let l = Zero3::new(t, 2).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l.rank_len(), 3 + 1);
        assert_eq!(
            l.pieces(1).iter().map(|p| (p.tensor, p.elems.clone(), p.local)).collect::<Vec<_>>(),
            vec![(0, 3..5, 0)]
        );
    }
}
