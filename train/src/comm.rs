//! Ranks from MPI: the byte `Collective` that `ckpt` and `dataload` talk through is
//! `collective`'s (its `mpi` feature); the tensor collectives of the training loop are here, over
//! the same communicator.
//!
//! An asynchronous checkpoint runs its commit protocol from a background thread on its own
//! duplicate of the world communicator (`Comm::world_duplicate`) while the loop keeps using the
//! original. A process started without `mpirun` is a world of one (MPI's singleton start).

use mpi::collective::SystemOperation;
use mpi::topology::Communicator;
use mpi::traits::CommunicatorCollectives;

/// The MPI environment and the world communicator: `collective`'s, shared with the `ckpt` binary.
pub(crate) use collective::mpi::{Mpi, MpiComm as Comm};

/// The tensor collectives of the training loop, over flat host buffers the caller keeps
/// (sends and receives are separate buffers, so no call allocates one). Reductions are sums in
/// `f32` (the master parameters and gradients are `f32` also in `--bf16` runs).
pub(crate) trait TensorComm {
    /// This rank.
    fn rank(&self) -> u64;
    /// Number of ranks.
    fn size(&self) -> u64;
    /// `out` ← the element-wise sum of every rank's `send` (the same lengths).
    fn all_reduce_sum_into(&self, send: &[f32], out: &mut [f32]);
    /// `buf` ← the element-wise sum of every rank's `buf`, in `f64`.
    fn all_reduce_sum_f64(&self, buf: &mut [f64]);
    /// `out` ← the sum over ranks of block `rank` of `send` (`send` is `size` blocks of
    /// `out.len()` elements).
    fn reduce_scatter_sum(&self, send: &[f32], out: &mut [f32]);
    /// `out` ← every rank's `send`, concatenated in rank order (equal lengths).
    fn all_gather_f32(&self, send: &[f32], out: &mut [f32]);
    /// Returns once every rank has called it.
    fn barrier(&self);
}

impl TensorComm for Comm {
    fn rank(&self) -> u64 {
        self.communicator().rank() as u64
    }
    fn size(&self) -> u64 {
        self.communicator().size() as u64
    }
    fn all_reduce_sum_into(&self, send: &[f32], out: &mut [f32]) {
        self.communicator().all_reduce_into(send, out, SystemOperation::sum());
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) {
        let send = buf.to_vec();
        self.communicator().all_reduce_into(&send[..], buf, SystemOperation::sum());
    }
    fn reduce_scatter_sum(&self, send: &[f32], out: &mut [f32]) {
        self.communicator().reduce_scatter_block_into(send, out, SystemOperation::sum());
    }
    fn all_gather_f32(&self, send: &[f32], out: &mut [f32]) {
        self.communicator().all_gather_into(send, out);
    }
    fn barrier(&self) {
        self.communicator().barrier();
    }
}
