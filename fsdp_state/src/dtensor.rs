//! DTensor layouts: which box of a global tensor every coordinate of an N-D device mesh holds.
//!
//! A DTensor is a global shape, a device mesh shape (ranks numbered row-major over it: the last
//! mesh dim varies fastest, as `init_device_mesh` numbers them) and one [`Placement`] per mesh
//! dim. The rules here are torch 2.13's (`compute_local_shape_and_global_offset` in
//! `torch/distributed/tensor/_utils.py`, and `Shard` / `_StridedShard` in `placement_types.py`),
//! restated:
//!
//! - On every tensor dim a rank holds a list of global indices, in increasing order; at first,
//!   all of them. The placements are applied in mesh-dim order, each to what the earlier ones
//!   left, so several shards of one tensor dim nest: the first mesh dim's split is the outer one.
//! - `Replicate` and `Partial` leave the list as it is. A `Partial` rank holds the whole shape,
//!   but its values are partial results (for example partial sums) that must be reduced over the
//!   mesh dim to give the tensor, so a box of it is not a piece of the tensor's values.
//! - `Shard(d)` on a mesh dim of size `n`, at coordinate `c`, keeps piece `c` of the `n` pieces
//!   `torch.chunk` cuts the current list into: `ceil(len / n)` indices each, the trailing pieces
//!   shorter or empty (the same rule as [`crate::chunk_rows`]).
//! - `_StridedShard(d, split_factor = k)` first cuts the current list into `k` `torch.chunk`
//!   pieces, cuts each of those into `n` pieces the same way, and keeps piece `c` of each,
//!   concatenated. It writes a right-to-left sharding in left-to-right order: with `k` equal to
//!   the number of shards the later mesh dims make of dim `d`, `(_StridedShard(d, k), Shard(d))`
//!   puts on each rank what sharding over the later mesh dim first and the earlier one second
//!   would. That is what FSDP2 records for a parameter that tensor parallelism already sharded
//!   on the dim FSDP shards: `fully_shard` on the dp dim of a (dp, tp) mesh after
//!   `ColwiseParallel` gives `(_StridedShard(0, sf=tp), Shard(0))`; it uses plain `Shard(0)` when
//!   the later dims do not shard dim 0 (`RowwiseParallel`: `(Shard(0), Shard(1))`).
//!
//! A rank's local shape is the length of each list, its global offset the first index of each.
//! A list that ends up empty gets, as torch gives it, the tensor's size on that dim as offset
//! (an empty box just past the end, still in bounds).
//!
//! `Shard` keeps a list contiguous, so without `_StridedShard` every rank holds one box.
//! `_StridedShard` can leave a rank with several runs on a dim: on its own (`k > 1` on a 1-D
//! mesh), after a `Shard` of the same dim, or with a `k` that does not match the later mesh dims.
//! torch does not notice: its local shape and offset are then the run lengths' sum and the first
//! index, a box that names elements the rank does not hold. [`DTensorLayout::box_of`] refuses
//! such a rank ([`LayoutError::NotABox`]); [`DTensorLayout::blocks_of`] lists the boxes it
//! really holds and where each sits in its local tensor, and
//! [`DTensorLayout::local_shape_and_global_offset`] gives torch's answer whatever the layout.
//!
//! These are the placements' meaning, which is what checkpoints record (DCP builds its chunk
//! metadata from `compute_local_shape_and_global_offset`). torch 2.13's FSDP2 + TP does not
//! always lay its data out that way: on a (3, 2) mesh a 7-row `ColwiseParallel` weight is
//! recorded as `(_StridedShard(0, sf=2), Shard(0))`, which puts row 6 on coordinate (2, 0),
//! while the local tensors hold it on (2, 1) (see `fixtures/fsdp_state/dtensor_layouts.json`).

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use crate::fsdp::chunk_rows;
use crate::layout::LayoutError;
use crate::region::Region;

/// The reduction a `Partial` placement is pending (torch's `Partial(reduce_op)` strings).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Elementwise sum over the mesh dim (`"sum"`, torch's default).
    Sum,
    /// Elementwise mean over the mesh dim (`"avg"`).
    Avg,
    /// Elementwise minimum over the mesh dim (`"min"`).
    Min,
    /// Elementwise maximum over the mesh dim (`"max"`).
    Max,
    /// Elementwise product over the mesh dim (`"product"`).
    Product,
    /// Bitwise AND over the mesh dim (`"band"`).
    Band,
    /// Bitwise OR over the mesh dim (`"bor"`).
    Bor,
    /// Bitwise XOR over the mesh dim (`"bxor"`).
    Bxor,
}

impl ReduceOp {
    const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
        ReduceOp::Band,
        ReduceOp::Bor,
        ReduceOp::Bxor,
    ];

    /// The name torch uses (`"sum"`, `"avg"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Product => "product",
            ReduceOp::Band => "band",
            ReduceOp::Bor => "bor",
            ReduceOp::Bxor => "bxor",
        }
    }

    /// The op torch calls `name` (the inverse of [`ReduceOp::name`]); `None` for any other
    /// string.
    pub fn from_name(name: &str) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|op| op.name() == name)
    }
}

/// How a DTensor is laid out over one mesh dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Every rank of the mesh dim holds the same thing.
    Replicate,
    /// Every rank holds the whole shape, but partial values pending this reduction over the
    /// mesh dim: for box purposes like [`Placement::Replicate`], for values not the tensor's.
    Partial(ReduceOp),
    /// Tensor dim `d` chunked over the mesh dim, `torch.chunk` style.
    Shard(usize),
    /// torch's `_StridedShard`: tensor dim `dim` cut into `split_factor` chunks, each chunked
    /// over the mesh dim, a rank keeping its piece of every one (see the module docs).
    StridedShard {
        /// The tensor dim it shards.
        dim: usize,
        /// How many `torch.chunk` pieces the dim is cut into before each is chunked over the
        /// mesh dim; FSDP2 + TP sets it to the number of shards the later mesh dims make.
        split_factor: u64,
    },
}

impl Placement {
    /// Parses torch's `repr` of a placement (`Replicate()`, `Partial(sum)`, `Shard(dim=1)`,
    /// `_StridedShard(dim=0, sf=2)`) or its `str` (`R`, `P(sum)`, `S(1)`, `_S(0, 2)`). Also
    /// takes the constructor spellings `Shard(1)`, `Partial()` (a sum) and
    /// `_StridedShard(0, split_factor=2)`. Negative dims are refused: torch normalizes them
    /// against the tensor's rank before a DTensor keeps them.
    pub fn parse(text: &str) -> Result<Placement, LayoutError> {
        let bad = || LayoutError::BadPlacement { text: text.to_string() };
        let t = text.trim();
        if t == "R" {
            return Ok(Placement::Replicate);
        }
        let (name, rest) = t.split_once('(').ok_or_else(bad)?;
        let inner = rest.strip_suffix(')').ok_or_else(bad)?;
        // `key=value` or bare values, in order.
        let args: Vec<(Option<&str>, &str)> = if inner.trim().is_empty() {
            Vec::new()
        } else {
            inner
                .split(',')
                .map(|a| match a.split_once('=') {
                    Some((k, v)) => (Some(k.trim()), v.trim()),
                    None => (None, a.trim()),
                })
                .collect()
        };
        let number = |arg: (Option<&str>, &str), keys: &[&str]| -> Option<u64> {
            let (key, value) = arg;
            if key.is_some_and(|k| !keys.contains(&k)) {
                return None;
            }
            // Digits only: `u64::from_str` would take a leading `+`.
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            value.parse().ok()
        };
        let dim = |arg| number(arg, &["dim"]).and_then(|d| usize::try_from(d).ok());
        match (name.trim(), args.as_slice()) {
            ("Replicate", []) => Ok(Placement::Replicate),
            ("Partial", []) => Ok(Placement::Partial(ReduceOp::Sum)),
            ("Partial" | "P", [(key, op)]) if key.is_none_or(|k| k == "reduce_op") => {
                ReduceOp::from_name(op).map(Placement::Partial).ok_or_else(bad)
            }
            ("Shard" | "S", [arg]) => dim(*arg).map(Placement::Shard).ok_or_else(bad),
            ("_StridedShard" | "_S", [d, sf]) => {
                let dim = dim(*d).ok_or_else(bad)?;
                let split_factor = number(*sf, &["sf", "split_factor"]).ok_or_else(bad)?;
                Ok(Placement::StridedShard { dim, split_factor })
            }
            _ => Err(bad()),
        }
    }

    /// The tensor dim it shards, if it shards one.
    pub fn shard_dim(&self) -> Option<usize> {
        match *self {
            Placement::Shard(d) | Placement::StridedShard { dim: d, .. } => Some(d),
            Placement::Replicate | Placement::Partial(_) => None,
        }
    }
}

/// torch's `repr`, which [`Placement::parse`] reads back.
impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Placement::Replicate => write!(f, "Replicate()"),
            Placement::Partial(op) => write!(f, "Partial({})", op.name()),
            Placement::Shard(d) => write!(f, "Shard(dim={d})"),
            Placement::StridedShard { dim, split_factor } => write!(f, "_StridedShard(dim={dim}, sf={split_factor})"),
        }
    }
}

impl FromStr for Placement {
    type Err = LayoutError;

    fn from_str(s: &str) -> Result<Placement, LayoutError> {
        Placement::parse(s)
    }
}

/// One box a rank holds: `global` in the global tensor, starting at `local` in the rank's local
/// tensor (the sizes are the same in both).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Where the box lies in the global tensor.
    pub global: Region,
    /// The box's offsets in the rank's local tensor, one per dim.
    pub local: Vec<u64>,
}

/// The most boxes a layout may cut one rank's share into: `_StridedShard` with a large split
/// factor on a large dim could otherwise make one rank's share a list of millions of runs,
/// which metadata read from a file must not be able to ask for.
pub const MAX_BLOCKS: u64 = 1 << 16;

/// A global tensor laid out over a device mesh by one placement per mesh dim (see the module
/// docs for the rules).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DTensorLayout {
    shape: Vec<u64>,
    mesh: Vec<u64>,
    placements: Vec<Placement>,
    world: u64,
}

/// Runs `(start, len)` of global indices on one tensor dim, in local order (which is global
/// order). Never empty: an empty share is the single run `(size of the dim, 0)`.
type Runs = Vec<(u64, u64)>;

impl DTensorLayout {
    /// A tensor of `shape` over a mesh of `mesh` with `placements[i]` on mesh dim `i`.
    ///
    /// Refuses what torch refuses (a placement count that is not the mesh's rank, a mesh dim of
    /// size 0, a shard of a dim the tensor does not have, a split factor of 0), sizes past 64
    /// bits, and split factors that could cut a rank's share into more than [`MAX_BLOCKS`]
    /// boxes. A mesh of rank 0 is one rank holding the whole tensor.
    pub fn new(
        shape: impl Into<Vec<u64>>,
        mesh: impl Into<Vec<u64>>,
        placements: impl Into<Vec<Placement>>,
    ) -> Result<DTensorLayout, LayoutError> {
        let (shape, mesh, placements) = (shape.into(), mesh.into(), placements.into());
        if placements.len() != mesh.len() {
            return Err(LayoutError::PlacementCount { mesh, placements: placements.len() });
        }
        if let Some(mesh_dim) = mesh.iter().position(|&n| n == 0) {
            return Err(LayoutError::EmptyMeshDim { mesh, mesh_dim });
        }
        let Some(world) = mesh.iter().try_fold(1u64, |a, &n| a.checked_mul(n)) else {
            return Err(LayoutError::MeshOverflow { mesh });
        };
        if shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).is_none() {
            return Err(LayoutError::ShapeOverflow { shape });
        }
        // Bound on the runs per tensor dim: a `Shard` keeps the count, a `_StridedShard` of
        // factor k adds at most k - 1, and no run is empty, so there are never more than the
        // dim's size. The blocks are their product over dims.
        let mut runs: Vec<u64> = vec![1; shape.len()];
        for (mesh_dim, p) in placements.iter().enumerate() {
            let Some(dim) = p.shard_dim() else { continue };
            if dim >= shape.len() {
                return Err(LayoutError::ShardDim { mesh_dim, dim, ndim: shape.len() });
            }
            if let Placement::StridedShard { split_factor, .. } = *p {
                if split_factor == 0 {
                    return Err(LayoutError::ZeroSplitFactor { mesh_dim });
                }
                runs[dim] = runs[dim].saturating_add(split_factor - 1);
            }
        }
        let bound = runs.iter().zip(&shape).map(|(&r, &s)| r.min(s.max(1))).fold(1u64, |a, r| a.saturating_mul(r));
        if bound > MAX_BLOCKS {
            return Err(LayoutError::TooFragmented { shape, bound, limit: MAX_BLOCKS });
        }
        Ok(DTensorLayout { shape, mesh, placements, world })
    }

    /// The global shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The device mesh's shape.
    pub fn mesh(&self) -> &[u64] {
        &self.mesh
    }

    /// The placement on each mesh dim, in mesh-dim order.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// Ranks in the mesh: the product of its dims.
    pub fn world(&self) -> u64 {
        self.world
    }

    /// The mesh coordinate of `rank` (row-major); `None` when `rank >= world`.
    pub fn coordinate(&self, rank: u64) -> Option<Vec<u64>> {
        if rank >= self.world {
            return None;
        }
        let mut rest = rank;
        let mut coord = vec![0; self.mesh.len()];
        for (c, &n) in coord.iter_mut().zip(&self.mesh).rev() {
            *c = rest % n;
            rest /= n;
        }
        Some(coord)
    }

    /// The rank at `coord`; `None` when it is not a coordinate of the mesh.
    pub fn rank_of(&self, coord: &[u64]) -> Option<u64> {
        if coord.len() != self.mesh.len() {
            return None;
        }
        // The rank is below `world`, so no step overflows.
        coord.iter().zip(&self.mesh).try_fold(0u64, |r, (&c, &n)| (c < n).then(|| r * n + c))
    }

    /// torch's `compute_local_shape_and_global_offset` at `coord`: the length of the rank's
    /// index list on every dim and its first index (the dim's size when the list is empty).
    /// Not a box of what the rank holds when [`DTensorLayout::box_of`] says [`LayoutError::NotABox`].
    pub fn local_shape_and_global_offset(&self, coord: &[u64]) -> Result<(Vec<u64>, Vec<u64>), LayoutError> {
        let runs = self.runs(coord)?;
        Ok((runs.iter().map(|r| total(r)).collect(), runs.iter().map(|r| r[0].0).collect()))
    }

    /// The box the rank at `coord` holds. An empty share is an empty box at torch's offsets.
    pub fn box_of(&self, coord: &[u64]) -> Result<Region, LayoutError> {
        let runs = self.runs(coord)?;
        let sizes: Vec<u64> = runs.iter().map(|r| total(r)).collect();
        if !sizes.contains(&0) {
            if let Some(dim) = runs.iter().position(|r| r.len() > 1) {
                return Err(LayoutError::NotABox { coordinate: coord.to_vec(), dim, runs: runs[dim].len() });
            }
        }
        Ok(Region::new(runs.iter().map(|r| r[0].0).collect::<Vec<_>>(), sizes))
    }

    /// [`DTensorLayout::box_of`] for the coordinate of `rank`.
    pub fn box_of_rank(&self, rank: u64) -> Result<Region, LayoutError> {
        let coord = self.coordinate(rank).ok_or(LayoutError::BadRank { rank, world: self.world })?;
        self.box_of(&coord)
    }

    /// Every box the rank at `coord` holds, in the row-major order of its local tensor, with
    /// where each starts in it: the product of its runs on every dim. One block when it holds
    /// a box ([`DTensorLayout::box_of`]'s, empty or not).
    pub fn blocks_of(&self, coord: &[u64]) -> Result<Vec<Block>, LayoutError> {
        let runs = self.runs(coord)?;
        if runs.iter().any(|r| total(r) == 0) {
            let offsets: Vec<u64> = runs.iter().map(|r| r[0].0).collect();
            let sizes: Vec<u64> = runs.iter().map(|r| total(r)).collect();
            return Ok(vec![Block { global: Region::new(offsets, sizes), local: vec![0; runs.len()] }]);
        }
        let mut blocks = vec![Block { global: Region::new(vec![], vec![]), local: vec![] }];
        for r in &runs {
            let mut next = Vec::with_capacity(blocks.len() * r.len());
            for b in &blocks {
                let mut at = 0;
                for &(start, len) in r {
                    let mut c = b.clone();
                    c.global.offsets.push(start);
                    c.global.sizes.push(len);
                    c.local.push(at);
                    next.push(c);
                    at += len;
                }
            }
            blocks = next;
        }
        Ok(blocks)
    }

    /// Every rank with its box, in rank order; [`LayoutError::NotABox`] for the first rank
    /// that holds more than one.
    pub fn boxes(&self) -> Result<Vec<(u64, Region)>, LayoutError> {
        (0..self.world).map(|rank| Ok((rank, self.box_of_rank(rank)?))).collect()
    }

    /// The distinct boxes, each once, in the order of the first rank holding it: what a DCP
    /// save keeps after deduplication, which drops every write item but one with the same
    /// offsets (and two ranks of a DTensor with the same offsets hold the same box). Ranks that
    /// differ only along `Replicate` / `Partial` mesh dims hold the same box. Empty boxes are
    /// kept, as DCP writes them too.
    pub fn distinct_boxes(&self) -> Result<Vec<Region>, LayoutError> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for (_, b) in self.boxes()? {
            if seen.insert(b.clone()) {
                out.push(b);
            }
        }
        Ok(out)
    }

    /// The rank's runs of global indices on every tensor dim.
    fn runs(&self, coord: &[u64]) -> Result<Vec<Runs>, LayoutError> {
        if self.rank_of(coord).is_none() {
            return Err(LayoutError::BadCoordinate { coordinate: coord.to_vec(), mesh: self.mesh.clone() });
        }
        let mut runs: Vec<Runs> = self.shape.iter().map(|&s| vec![(0, s)]).collect();
        for ((p, &n), &c) in self.placements.iter().zip(&self.mesh).zip(coord) {
            let (dim, split_factor) = match *p {
                Placement::Shard(dim) => (dim, 1),
                Placement::StridedShard { dim, split_factor } => (dim, split_factor),
                Placement::Replicate | Placement::Partial(_) => continue,
            };
            let len = total(&runs[dim]);
            // Local positions kept: piece `c` of each of the `split_factor` chunks (one chunk,
            // the whole list, for `Shard`).
            let mut keep: Vec<(u64, u64)> = Vec::new();
            let piece = len.div_ceil(split_factor);
            let mut start = 0;
            while start < len {
                let piece_len = piece.min(len - start);
                let r = chunk_rows(piece_len, n, c).unwrap_or(piece_len..piece_len);
                if !r.is_empty() {
                    keep.push((start + r.start, r.end - r.start));
                }
                start += piece_len;
            }
            let picked = pick(&runs[dim], &keep);
            runs[dim] = if picked.is_empty() { vec![(self.shape[dim], 0)] } else { picked };
        }
        Ok(runs)
    }
}

fn total(runs: &[(u64, u64)]) -> u64 {
    runs.iter().map(|&(_, n)| n).sum()
}

/// The global runs at local positions `keep` (ascending, disjoint, within the list) of a list
/// whose global runs are `runs`, adjacent runs merged.
fn pick(runs: &[(u64, u64)], keep: &[(u64, u64)]) -> Runs {
    let mut out: Runs = Vec::new();
    let mut i = 0;
    let mut base = 0; // local position of runs[i]'s first index
    for &(from, len) in keep {
        let (mut at, end) = (from, from + len);
        while at < end {
            while base + runs[i].1 <= at {
                base += runs[i].1;
                i += 1;
            }
            let upto = end.min(base + runs[i].1);
            let (global, n) = (runs[i].0 + (at - base), upto - at);
            match out.last_mut() {
                Some(last) if last.0 + last.1 == global => last.1 += n,
                _ => out.push((global, n)),
            }
            at = upto;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(shape: &[u64], mesh: &[u64], placements: &[Placement]) -> DTensorLayout {
        DTensorLayout::new(shape, mesh, placements).unwrap_or_else(|e| panic!("{e}"))
    }

    fn ss(dim: usize, split_factor: u64) -> Placement {
        Placement::StridedShard { dim, split_factor }
    }

    /// `(offsets, sizes)` of every rank's box, in rank order.
    fn boxes(l: &DTensorLayout) -> Vec<(Vec<u64>, Vec<u64>)> {
        l.boxes().unwrap_or_else(|e| panic!("{e}")).into_iter().map(|(_, b)| (b.offsets, b.sizes)).collect()
    }

    #[test]
    fn shard_follows_torch_chunk_and_empty_shards_sit_at_the_end() {
        // 5 rows over 4 ranks: chunks of 2, 2, 1 and nothing (at offset 5, as torch reports it).
        let l = layout(&[5, 3], &[4], &[Placement::Shard(0)]);
        assert_eq!(
            boxes(&l),
            vec![
                (vec![0, 0], vec![2, 3]),
                (vec![2, 0], vec![2, 3]),
                (vec![4, 0], vec![1, 3]),
                (vec![5, 0], vec![0, 3])
            ]
        );
        // 6 rows over 4 ranks: torch.chunk makes three chunks of 2, the fourth rank has none.
        let l = layout(&[6], &[4], &[Placement::Shard(0)]);
        assert_eq!(boxes(&l), vec![(vec![0], vec![2]), (vec![2], vec![2]), (vec![4], vec![2]), (vec![6], vec![0])]);
    }

    #[test]
    fn nested_shards_split_the_outer_piece() {
        // torch's own docstring example: [2, 5] over a (2, 2) mesh as (Shard(1), Shard(1)).
        let l = layout(&[2, 5], &[2, 2], &[Placement::Shard(1), Placement::Shard(1)]);
        assert_eq!(
            boxes(&l),
            vec![
                (vec![0, 0], vec![2, 2]),
                (vec![0, 2], vec![2, 1]),
                (vec![0, 3], vec![2, 1]),
                (vec![0, 4], vec![2, 1])
            ]
        );
        // 5 rows: the outer split gives 3 and 2 rows; 3 rows over 4 leave the last inner rank
        // empty at offset 5, the tensor's end, not 3, the end of its outer piece.
        let l = layout(&[5, 3], &[2, 4], &[Placement::Shard(0), Placement::Shard(0)]);
        let starts: Vec<(u64, u64)> = boxes(&l).into_iter().map(|(o, s)| (o[0], s[0])).collect();
        assert_eq!(starts, vec![(0, 1), (1, 1), (2, 1), (5, 0), (3, 1), (4, 1), (5, 0), (5, 0)]);
    }

    #[test]
    fn strided_shard_is_fsdp2_over_tp() {
        // torch's `_StridedShard` docstring: 8 rows, (dp, tp) = (2, 2): row blocks 0, 2, 1, 3.
        let l = layout(&[8, 8], &[2, 2], &[ss(0, 2), Placement::Shard(0)]);
        let rows: Vec<u64> = boxes(&l).into_iter().map(|(o, _)| o[0]).collect();
        assert_eq!(rows, vec![0, 4, 2, 6]);
        // 9 rows (fixture `fsdp_tp_2x2`, `up.weight`): tp splits 5 + 4, FSDP each 3 + 2 / 2 + 2.
        let l = layout(&[9, 6], &[2, 2], &[ss(0, 2), Placement::Shard(0)]);
        let rows: Vec<(u64, u64)> = boxes(&l).into_iter().map(|(o, s)| (o[0], s[0])).collect();
        assert_eq!(rows, vec![(0, 3), (5, 2), (3, 2), (7, 2)]);
    }

    #[test]
    fn strided_shard_alone_is_not_a_box() {
        // 7 rows, split factor 2, 2 ranks: chunks [0, 4) and [4, 7), each halved: rank 0 holds
        // rows 0-1 and 4-5, rank 1 rows 2-3 and 6. torch says (4 rows at 0) and (3 rows at 2).
        let l = layout(&[7], &[2], &[ss(0, 2)]);
        assert_eq!(l.local_shape_and_global_offset(&[0]), Ok((vec![4], vec![0])));
        assert_eq!(l.local_shape_and_global_offset(&[1]), Ok((vec![3], vec![2])));
        assert_eq!(l.box_of(&[1]), Err(LayoutError::NotABox { coordinate: vec![1], dim: 0, runs: 2 }));
        let blocks = l.blocks_of(&[1]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            blocks,
            vec![
                Block { global: Region::new([2], [2]), local: vec![0] },
                Block { global: Region::new([6], [1]), local: vec![2] },
            ]
        );
        assert!(l.boxes().is_err());
    }

    #[test]
    fn shard_then_strided_shard_interleaves() {
        // torch's comment in `_compute_local_shape_and_global_offset`: 8 rows, (S(0), SS(0, 2))
        // leaves rows {0, 2}, {1, 3}, {4, 6}, {5, 7}.
        let l = layout(&[8], &[2, 2], &[Placement::Shard(0), ss(0, 2)]);
        let runs: Vec<Vec<(u64, u64)>> = (0..4)
            .map(|r| {
                let coord = l.coordinate(r).unwrap_or_default();
                let blocks = l.blocks_of(&coord).unwrap_or_else(|e| panic!("{e}"));
                blocks.into_iter().map(|b| (b.global.offsets[0], b.global.sizes[0])).collect()
            })
            .collect();
        assert_eq!(runs, vec![vec![(0, 1), (2, 1)], vec![(1, 1), (3, 1)], vec![(4, 1), (6, 1)], vec![(5, 1), (7, 1)]]);
    }

    #[test]
    fn a_large_split_factor_on_a_short_dim_is_still_one_box() {
        // 5 rows in 8 chunks: five chunks of 1 row, each halved into 1 row and nothing.
        let l = layout(&[5, 3], &[2], &[ss(0, 8)]);
        assert_eq!(boxes(&l), vec![(vec![0, 0], vec![5, 3]), (vec![5, 0], vec![0, 3])]);
    }

    #[test]
    fn replicated_and_partial_dims_repeat_boxes() {
        let l = layout(&[4, 5], &[2, 2], &[Placement::Replicate, Placement::Shard(1)]);
        let b = boxes(&l);
        assert_eq!((&b[0], &b[1]), (&b[2], &b[3]));
        assert_eq!(l.distinct_boxes(), Ok(vec![Region::new([0, 0], [4, 3]), Region::new([0, 3], [4, 2])]));
        let l = layout(&[3], &[2], &[Placement::Partial(ReduceOp::Sum)]);
        assert_eq!(l.distinct_boxes(), Ok(vec![Region::whole(&[3])]));
    }

    #[test]
    fn three_d_mesh_and_scalars() {
        let l = layout(&[5, 6, 7], &[2, 3, 2], &[Placement::Shard(0), Placement::Shard(1), Placement::Shard(2)]);
        assert_eq!(l.world(), 12);
        assert_eq!(l.coordinate(7), Some(vec![1, 0, 1]));
        assert_eq!(l.rank_of(&[1, 0, 1]), Some(7));
        assert_eq!(l.box_of_rank(7), Ok(Region::new([3, 0, 4], [2, 2, 3])));
        let scalar = layout(&[], &[2], &[Placement::Replicate]);
        assert_eq!(scalar.box_of_rank(1), Ok(Region::new(vec![], vec![])));
        let unmeshed = layout(&[3, 2], &[], &[]);
        assert_eq!(unmeshed.boxes(), Ok(vec![(0, Region::whole(&[3, 2]))]));
    }

    #[test]
    fn the_constructor_refuses_what_torch_refuses() {
        let err = |shape: &[u64], mesh: &[u64], p: &[Placement]| DTensorLayout::new(shape, mesh, p).err();
        assert_eq!(
            err(&[4], &[2, 2], &[Placement::Shard(0)]),
            Some(LayoutError::PlacementCount { mesh: vec![2, 2], placements: 1 })
        );
        assert_eq!(
            err(&[4], &[2, 0], &[Placement::Shard(0), Placement::Replicate]),
            Some(LayoutError::EmptyMeshDim { mesh: vec![2, 0], mesh_dim: 1 })
        );
        assert_eq!(
            err(&[4, 4], &[2, 2], &[Placement::Replicate, Placement::Shard(2)]),
            Some(LayoutError::ShardDim { mesh_dim: 1, dim: 2, ndim: 2 })
        );
        assert_eq!(err(&[4], &[2], &[ss(0, 0)]), Some(LayoutError::ZeroSplitFactor { mesh_dim: 0 }));
        assert_eq!(
            err(&[4], &[1 << 32, 1 << 32], &[Placement::Replicate, Placement::Replicate]),
            Some(LayoutError::MeshOverflow { mesh: vec![1 << 32, 1 << 32] })
        );
        assert_eq!(
            err(&[1 << 32, 1 << 32], &[1], &[Placement::Replicate]),
            Some(LayoutError::ShapeOverflow { shape: vec![1 << 32, 1 << 32] })
        );
        assert!(matches!(err(&[1 << 40], &[2], &[ss(0, 1 << 40)]), Some(LayoutError::TooFragmented { .. })));
        // A huge split factor on a short dim cannot fragment it, so it is fine.
        assert!(err(&[7], &[2], &[ss(0, u64::MAX)]).is_none());
        let l = layout(&[4], &[2], &[Placement::Shard(0)]);
        assert_eq!(l.box_of(&[2]), Err(LayoutError::BadCoordinate { coordinate: vec![2], mesh: vec![2] }));
        assert_eq!(l.box_of(&[0, 0]), Err(LayoutError::BadCoordinate { coordinate: vec![0, 0], mesh: vec![2] }));
        assert_eq!(l.box_of_rank(2), Err(LayoutError::BadRank { rank: 2, world: 2 }));
    }

    #[test]
    fn placements_parse_torch_reprs_and_strs() {
        let cases = [
            ("Replicate()", Placement::Replicate),
            ("R", Placement::Replicate),
            ("Partial(sum)", Placement::Partial(ReduceOp::Sum)),
            ("P(avg)", Placement::Partial(ReduceOp::Avg)),
            ("Partial()", Placement::Partial(ReduceOp::Sum)),
            ("Shard(dim=1)", Placement::Shard(1)),
            ("Shard(3)", Placement::Shard(3)),
            ("S(0)", Placement::Shard(0)),
            ("_StridedShard(dim=0, sf=2)", ss(0, 2)),
            ("_StridedShard(dim=1, split_factor=4)", ss(1, 4)),
            ("_S(0, 2)", ss(0, 2)),
            (" Shard( dim = 2 ) ", Placement::Shard(2)),
        ];
        for (text, want) in cases {
            assert_eq!(Placement::parse(text), Ok(want), "{text}");
        }
        for p in [Placement::Replicate, Placement::Partial(ReduceOp::Bxor), Placement::Shard(2), ss(1, 3)] {
            assert_eq!(p.to_string().parse::<Placement>(), Ok(p));
        }
        assert_eq!(ss(0, 2).to_string(), "_StridedShard(dim=0, sf=2)");
        for bad in ["Shard(dim=-1)", "Shard()", "Shard(+1)", "Shard(sf=1)", "Partial(mean)", "Replicate", "S(0, 1)", ""]
        {
            assert_eq!(Placement::parse(bad), Err(LayoutError::BadPlacement { text: bad.to_string() }), "{bad}");
        }
    }
}
