//! The common vocabulary of layouts.

use std::ops::Range;

/// A logical tensor: its name and shape. Layouts work on element counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<u64>>) -> TensorSpec {
        TensorSpec { name: name.into(), shape: shape.into() }
    }

    /// Element count; `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }

    /// Elements in one dim-0 row (the product of the other dims).
    pub fn row_len(&self) -> Option<u64> {
        self.shape.iter().skip(1).try_fold(1u64, |a, &d| a.checked_mul(d))
    }
}

/// Elements `elems` of tensor `tensor` (row-major flattening) live in slot `slot` of `rank`,
/// starting at element offset `local`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub tensor: usize,
    pub elems: Range<u64>,
    pub rank: u64,
    pub slot: usize,
    pub local: u64,
}

impl Piece {
    pub fn len(&self) -> u64 {
        self.elems.end - self.elems.start
    }

    pub fn is_empty(&self) -> bool {
        self.elems.is_empty()
    }
}

/// Why a layout cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    #[error("world size must be at least 1")]
    EmptyWorld,
    #[error("tensor `{tensor}` with shape {shape:?} has more elements than fit in 64 bits")]
    Overflow { tensor: String, shape: Vec<u64> },
    #[error("tensor `{tensor}` is 0-dimensional and cannot be sharded along dim 0")]
    ScalarShard { tensor: String },
    #[error("parameter group {group} lists tensor index {index}, but there are only {count} tensors")]
    BadGroup { group: usize, index: usize, count: usize },
    #[error("{found} alignment paddings given for group {group} of {expected} parameters")]
    BadPadding { group: usize, expected: usize, found: usize },
    #[error("layouts describe different tensors: `{left}` vs `{right}`")]
    TensorMismatch { left: String, right: String },
    #[error("a device mesh of shape {mesh:?} needs {} placements, got {placements}", mesh.len())]
    PlacementCount { mesh: Vec<u64>, placements: usize },
    #[error("device mesh {mesh:?} has no ranks along mesh dim {mesh_dim}")]
    EmptyMeshDim { mesh: Vec<u64>, mesh_dim: usize },
    #[error("device mesh {mesh:?} has more ranks than fit in 64 bits")]
    MeshOverflow { mesh: Vec<u64> },
    #[error("shape {shape:?} has more elements than fit in 64 bits")]
    ShapeOverflow { shape: Vec<u64> },
    #[error("the placement on mesh dim {mesh_dim} shards dim {dim} of a {ndim}-dimensional tensor")]
    ShardDim { mesh_dim: usize, dim: usize, ndim: usize },
    #[error("the _StridedShard on mesh dim {mesh_dim} has a split factor of 0")]
    ZeroSplitFactor { mesh_dim: usize },
    #[error("the split factors could cut a rank's share of shape {shape:?} into {bound} boxes, more than {limit}")]
    TooFragmented { shape: Vec<u64>, bound: u64, limit: u64 },
    #[error("{coordinate:?} is not a coordinate of device mesh {mesh:?}")]
    BadCoordinate { coordinate: Vec<u64>, mesh: Vec<u64> },
    #[error("rank {rank} is not in a mesh of {world} ranks")]
    BadRank { rank: u64, world: u64 },
    #[error("the rank at mesh coordinate {coordinate:?} holds {runs} separate runs of dim {dim}, not one box")]
    NotABox { coordinate: Vec<u64>, dim: usize, runs: usize },
    #[error("`{text}` is not a DTensor placement (torch writes `Shard(dim=0)`, `Replicate()`, `_StridedShard(dim=0, sf=2)`, `Partial(sum)`)")]
    BadPlacement { text: String },
}

/// How a list of tensors is spread over ranks.
pub trait Layout {
    /// Number of ranks.
    fn world(&self) -> u64;
    /// The tensors, in the layout's order.
    fn tensors(&self) -> &[TensorSpec];
    /// Every piece `rank` holds, in local order.
    fn pieces(&self, rank: u64) -> Vec<Piece>;
    /// Element length of each slot of `rank`, padding included.
    fn slot_lens(&self, rank: u64) -> Vec<u64>;
}

pub(crate) fn numel_of(t: &TensorSpec) -> Result<u64, LayoutError> {
    t.numel().ok_or_else(|| LayoutError::Overflow { tensor: t.name.clone(), shape: t.shape.clone() })
}
