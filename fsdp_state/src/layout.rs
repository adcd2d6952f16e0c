//! The common vocabulary of layouts.

use std::ops::Range;

/// A logical tensor: its name and shape. Layouts work on element counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// The tensor's name; layouts resharded into each other must agree on it.
    pub name: String,
    /// Size of each dimension; empty for a 0-d (scalar) tensor.
    pub shape: Vec<u64>,
}

impl TensorSpec {
    /// A tensor called `name` with dimensions `shape`.
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
    /// Index of the tensor in the layout's [`Layout::tensors`].
    pub tensor: usize,
    /// Half-open range of the tensor's row-major element indices that the piece holds.
    pub elems: Range<u64>,
    /// The rank holding the piece.
    pub rank: u64,
    /// Which of the rank's local buffers holds it (see [`Layout::slot_lens`]).
    pub slot: usize,
    /// Element offset in that buffer where `elems.start` sits; the rest follow contiguously.
    pub local: u64,
}

impl Piece {
    /// Number of elements the piece holds.
    pub fn len(&self) -> u64 {
        self.elems.end - self.elems.start
    }

    /// True when the piece holds no element.
    pub fn is_empty(&self) -> bool {
        self.elems.is_empty()
    }
}

/// Why a layout cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A layout over 0 ranks was asked for.
    #[error("world size must be at least 1")]
    EmptyWorld,
    /// A tensor's element count does not fit in a `u64`.
    #[error("tensor `{tensor}` with shape {shape:?} has more elements than fit in 64 bits")]
    Overflow {
        /// Name of the tensor.
        tensor: String,
        /// Its shape.
        shape: Vec<u64>,
    },
    /// A dim-0 sharding (FSDP2) was given a 0-dimensional tensor, which has no dim 0.
    #[error("tensor `{tensor}` is 0-dimensional and cannot be sharded along dim 0")]
    ScalarShard {
        /// Name of the scalar tensor.
        tensor: String,
    },
    /// A ZeRO parameter group names a tensor index past the end of the tensor list.
    #[error("parameter group {group} lists tensor index {index}, but there are only {count} tensors")]
    BadGroup {
        /// Index of the parameter group.
        group: usize,
        /// The out-of-range tensor index it lists.
        index: usize,
        /// Number of tensors the layout was given.
        count: usize,
    },
    /// The ZeRO per-parameter alignment paddings of a group do not match its parameter count.
    #[error("{found} alignment paddings given for group {group} of {expected} parameters")]
    BadPadding {
        /// Index of the parameter group.
        group: usize,
        /// Number of parameters in the group, one padding each.
        expected: usize,
        /// Number of paddings given for it.
        found: usize,
    },
    /// Two layouts to reshard between do not describe the same tensors.
    #[error("layouts describe different tensors: `{left}` vs `{right}`")]
    TensorMismatch {
        /// The source layout's side of the difference (tensor count, or name and shape).
        left: String,
        /// The target layout's side of the difference.
        right: String,
    },
    /// A DTensor needs exactly one placement per device-mesh dimension.
    #[error("a device mesh of shape {mesh:?} needs {} placements, got {placements}", mesh.len())]
    PlacementCount {
        /// Shape of the device mesh.
        mesh: Vec<u64>,
        /// Number of placements given.
        placements: usize,
    },
    /// A device-mesh dimension has size 0.
    #[error("device mesh {mesh:?} has no ranks along mesh dim {mesh_dim}")]
    EmptyMeshDim {
        /// Shape of the device mesh.
        mesh: Vec<u64>,
        /// The mesh dimension of size 0.
        mesh_dim: usize,
    },
    /// The device mesh's rank count (product of its dims) does not fit in a `u64`.
    #[error("device mesh {mesh:?} has more ranks than fit in 64 bits")]
    MeshOverflow {
        /// Shape of the device mesh.
        mesh: Vec<u64>,
    },
    /// A DTensor's global element count does not fit in a `u64`.
    #[error("shape {shape:?} has more elements than fit in 64 bits")]
    ShapeOverflow {
        /// The global shape.
        shape: Vec<u64>,
    },
    /// A `Shard` / `_StridedShard` placement names a tensor dim the tensor does not have.
    #[error("the placement on mesh dim {mesh_dim} shards dim {dim} of a {ndim}-dimensional tensor")]
    ShardDim {
        /// The mesh dimension carrying the placement.
        mesh_dim: usize,
        /// The tensor dim it asks to shard.
        dim: usize,
        /// Number of dimensions the tensor has.
        ndim: usize,
    },
    /// A `_StridedShard` placement with a split factor of 0.
    #[error("the _StridedShard on mesh dim {mesh_dim} has a split factor of 0")]
    ZeroSplitFactor {
        /// The mesh dimension carrying the placement.
        mesh_dim: usize,
    },
    /// `_StridedShard` split factors could cut one rank's share into more than
    /// [`crate::MAX_BLOCKS`] boxes.
    #[error("the split factors could cut a rank's share of shape {shape:?} into {bound} boxes, more than {limit}")]
    TooFragmented {
        /// The global shape.
        shape: Vec<u64>,
        /// Upper bound on the boxes per rank that the placements allow.
        bound: u64,
        /// The largest bound accepted ([`crate::MAX_BLOCKS`]).
        limit: u64,
    },
    /// A mesh coordinate of the wrong length, or out of range on some mesh dim.
    #[error("{coordinate:?} is not a coordinate of device mesh {mesh:?}")]
    BadCoordinate {
        /// The coordinate given.
        coordinate: Vec<u64>,
        /// Shape of the device mesh.
        mesh: Vec<u64>,
    },
    /// A rank at or past the mesh's rank count.
    #[error("rank {rank} is not in a mesh of {world} ranks")]
    BadRank {
        /// The rank given.
        rank: u64,
        /// Number of ranks in the mesh.
        world: u64,
    },
    /// `_StridedShard` left a rank with several disjoint runs of indices on a tensor dim, so
    /// its share is not a single box (see [`crate::DTensorLayout::blocks_of`]).
    #[error("the rank at mesh coordinate {coordinate:?} holds {runs} separate runs of dim {dim}, not one box")]
    NotABox {
        /// Mesh coordinate of the rank.
        coordinate: Vec<u64>,
        /// The first tensor dim on which its share is split.
        dim: usize,
        /// Number of separate index runs it holds on that dim.
        runs: usize,
    },
    /// Text that is not a DTensor placement in any spelling [`crate::Placement::parse`] accepts.
    #[error("`{text}` is not a DTensor placement (torch writes `Shard(dim=0)`, `Replicate()`, `_StridedShard(dim=0, sf=2)`, `Partial(sum)`)")]
    BadPlacement {
        /// The text that failed to parse.
        text: String,
    },
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
