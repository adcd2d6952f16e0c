//! Ranks from MPI: the byte [`Collective`] that `ckpt` and `dataload` talk through, and the
//! tensor collectives of the training loop, over one communicator.
//!
//! MPI is initialised with `MPI_THREAD_MULTIPLE` when the library offers it, so that an
//! asynchronous checkpoint can run its commit protocol from a background thread on its own
//! duplicate of the world communicator ([`Comm::world_duplicate`]) while the loop keeps using the
//! original. MPI's default error handler aborts the whole job on a transport failure, so these
//! operations either complete or the processes end; none returns a transport error.
//!
//! A process started without `mpirun` is a world of one (MPI's singleton start).

use collective::{Collective, CollectiveError};
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use mpi::Threading;

/// The MPI environment; finalises MPI when dropped.
pub(crate) struct Mpi {
    _universe: Universe,
    /// Whether a second thread may call MPI.
    pub(crate) threads: bool,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi").field("threads", &self.threads).finish()
    }
}

impl Mpi {
    /// Initialises MPI, once per process.
    pub(crate) fn init() -> anyhow::Result<(Mpi, Comm)> {
        let (universe, level) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| anyhow::anyhow!("MPI was initialised already"))?;
        let world = universe.world();
        Ok((Mpi { _universe: universe, threads: level == Threading::Multiple }, Comm { world }))
    }
}

/// One communicator: byte collectives (the [`Collective`] trait) and tensor collectives.
pub(crate) struct Comm {
    world: SimpleCommunicator,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm").field("rank", &self.world.rank()).field("size", &self.world.size()).finish()
    }
}

impl Comm {
    /// A duplicate of the world communicator, made by the calling thread. Collective over the
    /// world: every rank must call it while no other thread of it uses the world.
    pub(crate) fn world_duplicate() -> Comm {
        Comm { world: SimpleCommunicator::world().duplicate() }
    }

    /// Ends every rank of the job with `code` (after an error on one rank, so that the others
    /// do not wait in a collective forever).
    pub(crate) fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

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
        self.world.rank() as u64
    }
    fn size(&self) -> u64 {
        self.world.size() as u64
    }
    fn all_reduce_sum_into(&self, send: &[f32], out: &mut [f32]) {
        self.world.all_reduce_into(send, out, SystemOperation::sum());
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) {
        let send = buf.to_vec();
        self.world.all_reduce_into(&send[..], buf, SystemOperation::sum());
    }
    fn reduce_scatter_sum(&self, send: &[f32], out: &mut [f32]) {
        self.world.reduce_scatter_block_into(send, out, SystemOperation::sum());
    }
    fn all_gather_f32(&self, send: &[f32], out: &mut [f32]) {
        self.world.all_gather_into(send, out);
    }
    fn barrier(&self) {
        self.world.barrier();
    }
}

impl Collective for Comm {
    fn rank(&self) -> u64 {
        self.world.rank() as u64
    }
    fn world_size(&self) -> u64 {
        self.world.size() as u64
    }
    fn broadcast(&self, root: u64, data: Option<Vec<u8>>) -> collective::Result<Vec<u8>> {
        let size = self.world.size() as u64;
        if root >= size {
            return Err(CollectiveError::NoSuchRoot {
                op: "broadcast",
                rank: self.world.rank() as u64,
                root,
                world_size: size,
            });
        }
        let proc = self.world.process_at_rank(root as i32);
        let mine = root == self.world.rank() as u64;
        let mut len = if mine { data.as_ref().map_or(0, Vec::len) as u64 } else { 0 };
        proc.broadcast_into(&mut len);
        let mut buf = if mine { data.unwrap_or_default() } else { vec![0u8; len as usize] };
        if len > 0 {
            proc.broadcast_into(&mut buf[..]);
        }
        Ok(buf)
    }
    fn all_gather(&self, data: Vec<u8>) -> collective::Result<Vec<Vec<u8>>> {
        let n = self.world.size() as usize;
        // Every part is sent with one leading byte, so that no rank passes MPI an empty buffer
        // (OpenMPI refuses an `MPI_Allgatherv` whose buffers are all empty).
        let mut sent = Vec::with_capacity(data.len() + 1);
        sent.push(0u8);
        sent.extend_from_slice(&data);
        let len = i32::try_from(sent.len()).map_err(|_| CollectiveError::Failed {
            op: "all_gather",
            rank: self.world.rank() as u64,
            reason: format!("{} bytes are more than MPI counts", data.len()),
        })?;
        let mut lens = vec![0i32; n];
        self.world.all_gather_into(&len, &mut lens[..]);
        let displs: Vec<i32> = lens.iter().scan(0i32, |acc, &l| Some(std::mem::replace(acc, *acc + l))).collect();
        let total: usize = lens.iter().map(|&l| l as usize).sum();
        let mut all = vec![0u8; total];
        {
            let mut part = PartitionMut::new(&mut all[..], &lens[..], &displs[..]);
            self.world.all_gather_varcount_into(&sent[..], &mut part);
        }
        Ok(lens.iter().zip(&displs).map(|(&l, &d)| all[d as usize + 1..(d + l) as usize].to_vec()).collect())
    }
    fn barrier(&self) -> collective::Result<()> {
        self.world.barrier();
        Ok(())
    }
}
