//! The communication seam of statekit: what ranks say to each other, and nothing more.
//!
//! Three things in statekit need the other ranks of a run, and all three go through the one
//! [`Collective`] trait of this crate:
//!
//! * **dispatching batches** (accelerate's `dispatch_batches`): rank 0 reads each global batch
//!   and [broadcasts](Collective::broadcast) it;
//! * **gathering** (accelerate's `gather_for_metrics`): every rank's rows to every rank,
//!   through [`Collective::all_gather`];
//! * **a checkpoint's commit**: each rank writes its own files, all ranks meet at a
//!   [`Collective::barrier`], then one rank writes the metadata that commits the checkpoint.
//!
//! Payloads are bytes, so an implementation carries them without knowing what they mean. The
//! trait is small on purpose: MPI (the `mpi` module, behind the feature of that name; the
//! training core and the `ckpt` binary share it), torch.distributed (through the Python
//! bindings) and the in-process [`InProcessGroup`] of this crate (threads as ranks, for
//! tests) all implement it. Tensor collectives (all-reduce, reduce-scatter of gradients) are
//! not here: they belong to the training core.
//!
//! [`launched_ranks`] tells, without MPI, whether a launcher started this process as one rank of
//! several: a program built without the `mpi` feature refuses to run then, rather than run the
//! whole job once per rank.
//!
//! Ranks and world sizes are `u64`, as they are in every on-disk state of statekit.

#![warn(missing_docs, unreachable_pub)]

mod error;
mod in_process;
mod launcher;
#[cfg(feature = "mpi")]
pub mod mpi;

pub use error::{CollectiveError, Result};
pub use in_process::{InProcessCollective, InProcessGroup};
pub use launcher::{launched_ranks, Launched};

/// Collective operations over a fixed group of ranks.
///
/// Every rank of the group must call the same operations in the same order, as with MPI. An
/// operation that cannot complete (a rank left, the transport failed) returns an error on the
/// ranks that see it; the group is then unusable.
///
/// The trait asks for neither `Send` nor `Sync`, so that a handle bound to the thread that
/// created it (an MPI communicator, a Python object) can implement it; the in-process handles
/// are both.
pub trait Collective {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> u64;
    /// Number of ranks.
    fn world_size(&self) -> u64;
    /// `root`'s `data` on every rank. Only `root`'s argument is read; other ranks pass `None`.
    fn broadcast(&self, root: u64, data: Option<Vec<u8>>) -> Result<Vec<u8>>;
    /// Every rank's `data`, indexed by rank, on every rank.
    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
}

// A reference or a box of a collective is one, so generic code can take `&dyn Collective`
// or `Box<dyn Collective + Send>` as well as a concrete handle.
impl<C: Collective + ?Sized> Collective for &C {
    fn rank(&self) -> u64 {
        (**self).rank()
    }
    fn world_size(&self) -> u64 {
        (**self).world_size()
    }
    fn broadcast(&self, root: u64, data: Option<Vec<u8>>) -> Result<Vec<u8>> {
        (**self).broadcast(root, data)
    }
    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        (**self).all_gather(data)
    }
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
}

impl<C: Collective + ?Sized> Collective for Box<C> {
    fn rank(&self) -> u64 {
        (**self).rank()
    }
    fn world_size(&self) -> u64 {
        (**self).world_size()
    }
    fn broadcast(&self, root: u64, data: Option<Vec<u8>>) -> Result<Vec<u8>> {
        (**self).broadcast(root, data)
    }
    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        (**self).all_gather(data)
    }
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
}

/// A world of one: every operation returns at once with this rank's own data. What a tool runs
/// on when it was not started as one rank of many.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> u64 {
        0
    }
    fn world_size(&self) -> u64 {
        1
    }
    fn broadcast(&self, root: u64, data: Option<Vec<u8>>) -> Result<Vec<u8>> {
        if root != 0 {
            return Err(CollectiveError::NoSuchRoot { op: "broadcast", rank: 0, root, world_size: 1 });
        }
        Ok(data.unwrap_or_default())
    }
    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        Ok(vec![data])
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}
