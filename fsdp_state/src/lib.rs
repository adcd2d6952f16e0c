//! Shard-layout math with no I/O: which rank owns which slice of which tensor.
//!
//! A [`Layout`] describes how a list of logical tensors is spread over `world` ranks. Each rank
//! holds one or more local buffers (*slots*); a [`Piece`] says that elements `[start, end)` of a
//! tensor's row-major flattening sit in slot `slot` of rank `rank` at element offset `local`.
//! Padding is simply what no piece covers.
//!
//! Four layouts are modelled, each reproducing the rules of the framework that writes it:
//!
//! - [`Fsdp2`]: FSDP2 / DTensor `Shard(0)`, one local tensor per parameter, `torch.chunk` rules
//!   (`ceil(n / world)` rows per rank, trailing ranks may hold less or nothing);
//! - [`Fsdp1Flat`]: FSDP1 flat parameters, flattened in registration order, padded to a multiple
//!   of the world size and cut into equal chunks; with `use_orig_params=True` every parameter is
//!   also aligned to 16 bytes by padding entries before it ([`Fsdp1Flat::with_alignment`]);
//! - [`Zero12`]: DeepSpeed ZeRO stage 1/2 flat groups, optional per-parameter alignment padding,
//!   each group padded to a multiple of `2 × world` and cut into equal partitions;
//! - [`Zero3`]: DeepSpeed ZeRO stage 3, each parameter cut into `ceil(numel / world)` pieces,
//!   concatenated per rank in parameter order.
//!
//! A [`DTensorLayout`] is a DTensor's layout over an N-D device mesh (`Shard`, `Replicate`,
//! `Partial` and FSDP2 + TP's `_StridedShard` [`Placement`]s, with torch's uneven and nested
//! splitting): the box of the global tensor each rank holds, or, for the few `_StridedShard`
//! orders that scatter a rank's share, the boxes.
//!
//! A tensor sharded as N-D boxes (DCP chunks, DTensor local shards on any dims) is a list of
//! [`Region`]s; [`check_tiling`] decides, for every format, whether they cover it exactly.
//!
//! Two layouts over the same tensors give a resharding plan ([`reshard`]): the range copies that
//! turn buffers of one layout into buffers of the other, N ranks to M.
//!
//! A data stream's position is sharded over ranks too: [`stream`] counts it in global batches
//! and moves a count of steps to another world size, for `dataload`'s cursor and `ckpt`'s
//! accelerate dataloader states alike.

#![warn(missing_docs, unreachable_pub)]

mod dtensor;
mod fsdp;
mod layout;
mod region;
mod reshard;
pub mod stream;
mod zero;

pub use dtensor::{Block, DTensorLayout, Placement, ReduceOp, MAX_BLOCKS};
pub use fsdp::{chunk_rows, FlatEntry, FlatParamInfo, Fsdp1Flat, Fsdp2};
pub use layout::{Layout, LayoutError, Piece, TensorSpec};
pub use region::{check_tiling, Region, TilingError};
pub use reshard::{reshard, RangeCopy};
pub use zero::{Zero12, Zero3};
