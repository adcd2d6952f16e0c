//! Resharding: the range copies that turn one layout's buffers into another's.

use crate::layout::{Layout, LayoutError, Piece};

/// Copy `len` elements from (`src_rank`, `src_slot`, `src_local`) of the source layout to
/// (`dst_rank`, `dst_slot`, `dst_local`) of the target layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeCopy {
    /// Index of the tensor the elements belong to (the same in both layouts).
    pub tensor: usize,
    /// Rank of the source layout that holds the elements.
    pub src_rank: u64,
    /// Local buffer of that rank to read from.
    pub src_slot: usize,
    /// Element offset in that buffer where the run starts.
    pub src_local: u64,
    /// Rank of the target layout that receives the elements.
    pub dst_rank: u64,
    /// Local buffer of that rank to write to.
    pub dst_slot: usize,
    /// Element offset in that buffer where the run goes.
    pub dst_local: u64,
    /// Number of contiguous elements to copy.
    pub len: u64,
}

/// The plan that reshards `from` (N ranks) into `to` (M ranks). Both must describe the same
/// tensors (names and shapes, in the same order). Padding is not copied: a target buffer's
/// padding is left for the writer to zero.
pub fn reshard(from: &dyn Layout, to: &dyn Layout) -> Result<Vec<RangeCopy>, LayoutError> {
    let (a, b) = (from.tensors(), to.tensors());
    if a.len() != b.len() {
        return Err(LayoutError::TensorMismatch {
            left: format!("{} tensors", a.len()),
            right: format!("{} tensors", b.len()),
        });
    }
    for (x, y) in a.iter().zip(b) {
        if x != y {
            return Err(LayoutError::TensorMismatch {
                left: format!("{} {:?}", x.name, x.shape),
                right: format!("{} {:?}", y.name, y.shape),
            });
        }
    }
    // Source pieces grouped by tensor, sorted by element start, for interval intersection.
    let mut by_tensor: Vec<Vec<Piece>> = vec![Vec::new(); a.len()];
    for r in 0..from.world() {
        for p in from.pieces(r) {
            by_tensor[p.tensor].push(p);
        }
    }
    for v in &mut by_tensor {
        v.sort_by_key(|p| p.elems.start);
    }
    let mut plan = Vec::new();
    for r in 0..to.world() {
        for dst in to.pieces(r) {
            let srcs = &by_tensor[dst.tensor];
            // First source piece that ends after dst starts.
            let first = srcs.partition_point(|p| p.elems.end <= dst.elems.start);
            for src in &srcs[first..] {
                if src.elems.start >= dst.elems.end {
                    break;
                }
                let s = src.elems.start.max(dst.elems.start);
                let e = src.elems.end.min(dst.elems.end);
                plan.push(RangeCopy {
                    tensor: dst.tensor,
                    src_rank: src.rank,
                    src_slot: src.slot,
                    src_local: src.local + (s - src.elems.start),
                    dst_rank: dst.rank,
                    dst_slot: dst.slot,
                    dst_local: dst.local + (s - dst.elems.start),
                    len: e - s,
                });
            }
        }
    }
    Ok(plan)
}
