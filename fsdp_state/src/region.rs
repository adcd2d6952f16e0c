//! N-D boxes of a tensor, and the check that a set of them tiles it.
//!
//! A [`Region`] is a box of a global tensor: an offset and a size per dimension, the way DCP's
//! `ChunkStorageMetadata` and a DTensor's local shard describe what a rank holds. A sharded
//! tensor is valid when its boxes *tile* it: every element lies in exactly one non-empty box,
//! and no box reaches past the tensor. Empty boxes (a size of 0 in some dimension, what a rank
//! with nothing to hold saves) must still lie in bounds but cover nothing.
//!
//! [`check_tiling`] is the one place that decides it, for every layout and format. It compresses
//! coordinates: the boxes' edges cut each dimension into intervals, the intervals form a grid of
//! cells, and each box covers a sub-grid. For the layouts frameworks write (products of
//! per-dimension splits) the grid has exactly one cell per box, so marking cells is linear. A
//! grid that would be much larger than the boxes (irregular boxes on many dims) falls back to a
//! volume count plus a pairwise overlap test.

/// A box of a tensor: elements `offsets[d] .. offsets[d] + sizes[d]` on every dimension `d`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Region {
    /// The box's first index on each dimension of the tensor.
    pub offsets: Vec<u64>,
    /// The box's extent on each dimension; a 0 anywhere makes it empty.
    pub sizes: Vec<u64>,
}

impl Region {
    /// The box starting at `offsets` with extents `sizes` (one entry per tensor dimension).
    pub fn new(offsets: impl Into<Vec<u64>>, sizes: impl Into<Vec<u64>>) -> Region {
        Region { offsets: offsets.into(), sizes: sizes.into() }
    }

    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &[u64]) -> Region {
        Region { offsets: vec![0; shape.len()], sizes: shape.to_vec() }
    }

    /// Elements in the box; `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        self.sizes.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }

    /// True when it holds no element.
    pub fn is_empty(&self) -> bool {
        self.sizes.contains(&0)
    }

    /// True when it is the whole of a tensor of `shape`.
    pub fn is_whole(&self, shape: &[u64]) -> bool {
        self.offsets.iter().all(|&o| o == 0) && self.sizes == shape
    }

    /// True when the two boxes share an element.
    pub fn overlaps(&self, other: &Region) -> bool {
        !self.is_empty()
            && !other.is_empty()
            && self
                .offsets
                .iter()
                .zip(&self.sizes)
                .zip(other.offsets.iter().zip(&other.sizes))
                .all(|((&a, &an), (&b, &bn))| a < b.saturating_add(bn) && b < a.saturating_add(an))
    }
}

/// Why a set of boxes does not tile a tensor. `index` is the position of the offending box in
/// the list given to [`check_tiling`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TilingError {
    /// A box has a different number of dimensions than the tensor.
    #[error("box at offsets {offsets:?} with sizes {sizes:?} has {found} dims, the tensor {shape:?} has {expected}")]
    Rank {
        /// Position of the box in the list.
        index: usize,
        /// The box's offsets.
        offsets: Vec<u64>,
        /// The box's sizes.
        sizes: Vec<u64>,
        /// The tensor's shape.
        shape: Vec<u64>,
        /// The tensor's number of dimensions.
        expected: usize,
        /// The box's number of dimensions (the longer of its offsets and sizes).
        found: usize,
    },
    /// A box reaches past the tensor's end on some dimension.
    #[error("box at offsets {offsets:?} with sizes {sizes:?} lies outside size {shape:?}")]
    OutOfBounds {
        /// Position of the box in the list.
        index: usize,
        /// The box's offsets.
        offsets: Vec<u64>,
        /// The box's sizes.
        sizes: Vec<u64>,
        /// The tensor's shape.
        shape: Vec<u64>,
    },
    /// Two non-empty boxes share an element.
    #[error("box at offsets {offsets:?} with sizes {sizes:?} overlaps the box at offsets {other_offsets:?} with sizes {other_sizes:?}")]
    Overlap {
        /// Position in the list of the box found overlapping.
        index: usize,
        /// That box's offsets.
        offsets: Vec<u64>,
        /// That box's sizes.
        sizes: Vec<u64>,
        /// Position in the list of the box it overlaps.
        other: usize,
        /// The other box's offsets.
        other_offsets: Vec<u64>,
        /// The other box's sizes.
        other_sizes: Vec<u64>,
    },
    /// Some element of the tensor lies in no box.
    #[error("the boxes leave elements of size {shape:?} uncovered, from offsets {at:?}")]
    Gap {
        /// The tensor's shape.
        shape: Vec<u64>,
        /// Index of an uncovered element, to locate the hole (best effort for irregular boxes).
        at: Vec<u64>,
    },
    /// The tensor's element count does not fit in a `u64`.
    #[error("size {shape:?} has more elements than fit in 64 bits")]
    Overflow {
        /// The tensor's shape.
        shape: Vec<u64>,
    },
    /// The boxes are so irregular that checking them would exceed the work bound; they are
    /// rejected rather than checked.
    #[error("{boxes} boxes of size {shape:?} are too irregular to check that they tile it")]
    TooIrregular {
        /// Number of non-empty boxes.
        boxes: usize,
        /// The tensor's shape.
        shape: Vec<u64>,
    },
}

impl TilingError {
    /// The box the problem is about, when it is about one.
    pub fn index(&self) -> Option<usize> {
        match self {
            TilingError::Rank { index, .. }
            | TilingError::OutOfBounds { index, .. }
            | TilingError::Overlap { index, .. } => Some(*index),
            TilingError::Gap { .. } | TilingError::Overflow { .. } | TilingError::TooIrregular { .. } => None,
        }
    }
}

/// How many grid cells per box the cell-marking check may use before it falls back to the
/// pairwise one.
const CELLS_PER_BOX: u64 = 64;
/// How many box pairs the pairwise check compares before it gives up: boxes that no framework
/// writes (irregular on several dims at once, hundreds of thousands of them) would otherwise
/// make a small metadata file cost hours.
const MAX_PAIR_CHECKS: u64 = 1 << 26;
/// The most cells the grid check marks beyond one per box (4 bytes each).
const MAX_CELLS: u64 = 1 << 24;

/// Checks that `boxes` tile a tensor of `shape` exactly (see the module docs). A 0-d tensor is
/// tiled by one box with no dims.
pub fn check_tiling(shape: &[u64], boxes: &[Region]) -> Result<(), TilingError> {
    let total =
        shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or(TilingError::Overflow { shape: shape.to_vec() })?;
    for (index, b) in boxes.iter().enumerate() {
        if b.offsets.len() != shape.len() || b.sizes.len() != shape.len() {
            return Err(TilingError::Rank {
                index,
                offsets: b.offsets.clone(),
                sizes: b.sizes.clone(),
                shape: shape.to_vec(),
                expected: shape.len(),
                found: b.offsets.len().max(b.sizes.len()),
            });
        }
        let inside =
            b.offsets.iter().zip(&b.sizes).zip(shape).all(|((&o, &n), &s)| o.checked_add(n).is_some_and(|e| e <= s));
        if !inside {
            return Err(TilingError::OutOfBounds {
                index,
                offsets: b.offsets.clone(),
                sizes: b.sizes.clone(),
                shape: shape.to_vec(),
            });
        }
    }
    let full: Vec<usize> = (0..boxes.len()).filter(|&i| !boxes[i].is_empty()).collect();
    if total == 0 {
        return Ok(());
    }
    // Cut points per dim: 0, the tensor's end, and every box edge.
    let cuts: Vec<Vec<u64>> = (0..shape.len())
        .map(|d| {
            let mut c: Vec<u64> = vec![0, shape[d]];
            for &i in &full {
                c.push(boxes[i].offsets[d]);
                c.push(boxes[i].offsets[d] + boxes[i].sizes[d]);
            }
            c.sort_unstable();
            c.dedup();
            c
        })
        .collect();
    let cells = cuts.iter().try_fold(1u64, |a, c| a.checked_mul(c.len() as u64 - 1));
    // Regular grids need one cell per box; the slack for irregular ones is capped so that the
    // marks stay within 64 MiB.
    let k = (full.len() as u64).max(1);
    let budget = k.saturating_mul(CELLS_PER_BOX).min(k.max(MAX_CELLS));
    match cells {
        Some(n) if n <= budget && boxes.len() < u32::MAX as usize => mark_cells(shape, boxes, &full, &cuts, n),
        _ => pairwise(shape, boxes, &full, total),
    }
}

fn overlap_error(boxes: &[Region], index: usize, other: usize) -> TilingError {
    TilingError::Overlap {
        index,
        offsets: boxes[index].offsets.clone(),
        sizes: boxes[index].sizes.clone(),
        other,
        other_offsets: boxes[other].offsets.clone(),
        other_sizes: boxes[other].sizes.clone(),
    }
}

fn mark_cells(
    shape: &[u64],
    boxes: &[Region],
    full: &[usize],
    cuts: &[Vec<u64>],
    cells: u64,
) -> Result<(), TilingError> {
    let dims = shape.len();
    // Row-major strides of the cell grid.
    let mut strides = vec![1usize; dims];
    for d in (0..dims.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * (cuts[d + 1].len() - 1);
    }
    // The box owning each cell, `u32::MAX` for none (boxes beyond that count use the pairwise
    // check, see `check_tiling`).
    let mut owner: Vec<u32> = vec![u32::MAX; cells as usize];
    for &i in full {
        let b = &boxes[i];
        // The cell intervals the box spans on each dim (its edges are cut points).
        let span: Vec<(usize, usize)> = (0..dims)
            .map(|d| {
                let lo = cuts[d].partition_point(|&c| c < b.offsets[d]);
                let hi = cuts[d].partition_point(|&c| c < b.offsets[d] + b.sizes[d]);
                (lo, hi)
            })
            .collect();
        let mut idx: Vec<usize> = span.iter().map(|&(lo, _)| lo).collect();
        'cells: loop {
            let cell: usize = idx.iter().zip(&strides).map(|(&x, &s)| x * s).sum();
            if owner[cell] != u32::MAX {
                return Err(overlap_error(boxes, i, owner[cell] as usize));
            }
            owner[cell] = i as u32;
            // Odometer over the box's sub-grid.
            let mut d = dims;
            loop {
                if d == 0 {
                    break 'cells;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < span[d].1 {
                    break;
                }
                idx[d] = span[d].0;
            }
        }
    }
    if let Some(cell) = owner.iter().position(|&o| o == u32::MAX) {
        let mut rest = cell;
        let at = (0..dims)
            .map(|d| {
                let x = rest / strides[d];
                rest %= strides[d];
                cuts[d][x]
            })
            .collect();
        return Err(TilingError::Gap { shape: shape.to_vec(), at });
    }
    Ok(())
}

fn pairwise(shape: &[u64], boxes: &[Region], full: &[usize], total: u64) -> Result<(), TilingError> {
    // Sweep along the dim where the boxes start at the most places: sorted on it, a box can only
    // overlap the boxes that start before it ends there.
    let d = (0..shape.len())
        .max_by_key(|&d| {
            let mut starts: Vec<u64> = full.iter().map(|&i| boxes[i].offsets[d]).collect();
            starts.sort_unstable();
            starts.dedup();
            starts.len()
        })
        .unwrap_or(0);
    let start = |i: usize| boxes[i].offsets.get(d).copied().unwrap_or(0);
    let mut order: Vec<usize> = full.to_vec();
    order.sort_by_key(|&i| (start(i), i));
    let mut checks = 0u64;
    for (k, &i) in order.iter().enumerate() {
        let end = start(i) + boxes[i].sizes.get(d).copied().unwrap_or(1);
        for &j in &order[k + 1..] {
            if start(j) >= end {
                break;
            }
            checks += 1;
            if checks > MAX_PAIR_CHECKS {
                return Err(TilingError::TooIrregular { boxes: full.len(), shape: shape.to_vec() });
            }
            if boxes[i].overlaps(&boxes[j]) {
                return Err(overlap_error(boxes, j, i));
            }
        }
    }
    // Disjoint boxes inside the tensor cover it exactly when their volumes add up to it.
    let covered = full.iter().map(|&i| boxes[i].numel().unwrap_or(u64::MAX)).fold(0u64, u64::saturating_add);
    if covered != total {
        return Err(TilingError::Gap { shape: shape.to_vec(), at: first_gap(shape, boxes, full) });
    }
    Ok(())
}

/// Some uncovered element (for the message), found by walking dim-0 starts: the smallest
/// corner not inside any box, tried along the boxes' edges.
fn first_gap(shape: &[u64], boxes: &[Region], full: &[usize]) -> Vec<u64> {
    let mut candidates: Vec<Vec<u64>> = vec![vec![0; shape.len()]];
    for &i in full {
        for d in 0..shape.len() {
            let mut c = boxes[i].offsets.clone();
            c[d] += boxes[i].sizes[d];
            if c[d] < shape[d] {
                candidates.push(c);
            }
        }
    }
    candidates.sort();
    // Found in the first few candidates in practice; the bound keeps a hostile set cheap.
    candidates.truncate(4096);
    let inside =
        |p: &[u64], b: &Region| p.iter().zip(&b.offsets).zip(&b.sizes).all(|((&x, &o), &n)| x >= o && x < o + n);
    candidates.into_iter().find(|p| !full.iter().any(|&i| inside(p, &boxes[i]))).unwrap_or_else(|| vec![0; shape.len()])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(o: &[u64], s: &[u64]) -> Region {
        Region::new(o, s)
    }

    #[test]
    fn a_2x2_grid_tiles() {
        let b = [r(&[0, 0], &[2, 3]), r(&[0, 3], &[2, 3]), r(&[2, 0], &[2, 3]), r(&[2, 3], &[2, 3])];
        assert_eq!(check_tiling(&[4, 6], &b), Ok(()));
    }

    #[test]
    fn empty_boxes_cover_nothing_but_stay_in_bounds() {
        let b = [r(&[0, 0], &[3, 5]), r(&[3, 0], &[0, 5]), r(&[3, 0], &[0, 5])];
        assert_eq!(check_tiling(&[3, 5], &b), Ok(()));
        let out = [r(&[0, 0], &[3, 5]), r(&[4, 0], &[0, 5])];
        assert!(matches!(check_tiling(&[3, 5], &out), Err(TilingError::OutOfBounds { index: 1, .. })));
    }

    #[test]
    fn overlap_and_gap_are_named() {
        let b = [r(&[0, 0], &[2, 4]), r(&[1, 0], &[3, 4])];
        assert!(matches!(check_tiling(&[4, 4], &b), Err(TilingError::Overlap { .. })));
        let b = [r(&[0, 0], &[4, 2])];
        assert_eq!(check_tiling(&[4, 4], &b), Err(TilingError::Gap { shape: vec![4, 4], at: vec![0, 2] }));
    }

    #[test]
    fn scalars_and_empty_tensors() {
        assert_eq!(check_tiling(&[], &[r(&[], &[])]), Ok(()));
        assert!(check_tiling(&[], &[]).is_err());
        assert_eq!(check_tiling(&[0, 4], &[r(&[0, 0], &[0, 4])]), Ok(()));
        assert_eq!(check_tiling(&[0, 4], &[]), Ok(()));
    }

    #[test]
    fn a_hostile_staircase_is_bounded() {
        // Boxes all spanning dim 0, in a staircase on dims 1 and 2: too many cells for the grid,
        // and every pair overlaps on the sweep dim.
        let k = 20_000u64;
        let b: Vec<Region> = (0..k).map(|i| r(&[0, i, 0], &[1, 1, k - i])).collect();
        let err = check_tiling(&[1, k, k], &b);
        assert!(matches!(err, Err(TilingError::Gap { .. }) | Err(TilingError::TooIrregular { .. })), "{err:?}");
    }

    #[test]
    fn irregular_boxes_use_the_pairwise_check() {
        // An L-shaped tiling of 4x4: more cells than 64 per box is not reached here, so force
        // the fallback directly.
        let b = [r(&[0, 0], &[1, 4]), r(&[1, 0], &[3, 1]), r(&[1, 1], &[3, 3])];
        let full = [0, 1, 2];
        assert_eq!(pairwise(&[4, 4], &b, &full, 16), Ok(()));
        let gap = [r(&[0, 0], &[1, 4]), r(&[1, 1], &[3, 3])];
        assert!(matches!(pairwise(&[4, 4], &gap, &[0, 1], 16), Err(TilingError::Gap { .. })));
        assert_eq!(check_tiling(&[4, 4], &b), Ok(()));
    }
}
