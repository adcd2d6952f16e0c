//! Ranks from MPI: the [`Collective`] of a job started by `mpirun` (or any MPI launcher), shared
//! by the training core and the `ckpt` binary.
//!
//! MPI is initialised with `MPI_THREAD_MULTIPLE` when the library offers it, so that a background
//! thread (an asynchronous checkpoint's commit) can talk on its own duplicate of the world
//! communicator ([`MpiComm::world_duplicate`]) while the main thread keeps the original. MPI's
//! default error handler aborts the whole job on a transport failure, so these operations either
//! complete or every process ends; none returns a transport error.
//!
//! A process started without a launcher is a world of one (MPI's singleton start); the `ckpt`
//! binary does not even initialise MPI then ([`launched`]).

use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use mpi::Threading;

use crate::{Collective, CollectiveError};

/// Whether this process was started by an MPI launcher (Open MPI's `mpirun`, or a PMI/PMIx
/// launcher such as Slurm's `srun` or MPICH's Hydra), from the variables they set.
pub fn launched() -> bool {
    const VARS: [&str; 4] = ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"];
    VARS.iter().any(|v| std::env::var_os(v).is_some())
}

/// The MPI environment: finalises MPI when dropped, so it must outlive every [`MpiComm`].
pub struct Mpi {
    _universe: Universe,
    threads: bool,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi").field("threads", &self.threads).finish()
    }
}

impl Mpi {
    /// Initialises MPI (once per process) and returns it with the world communicator; `None`
    /// when MPI was initialised already.
    pub fn init() -> Option<(Mpi, MpiComm)> {
        let (universe, level) = mpi::initialize_with_threading(Threading::Multiple)?;
        let world = universe.world();
        Some((Mpi { _universe: universe, threads: level == Threading::Multiple }, MpiComm { world }))
    }

    /// Whether a second thread may call MPI (the library granted `MPI_THREAD_MULTIPLE`).
    pub fn threads(&self) -> bool {
        self.threads
    }
}

/// One MPI communicator, as a [`Collective`] of bytes.
pub struct MpiComm {
    world: SimpleCommunicator,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm").field("rank", &self.world.rank()).field("size", &self.world.size()).finish()
    }
}

impl MpiComm {
    /// A duplicate of the world communicator, made by the calling thread. Collective over the
    /// world: every rank must call it while no other thread of it uses the world.
    pub fn world_duplicate() -> MpiComm {
        MpiComm { world: SimpleCommunicator::world().duplicate() }
    }

    /// The communicator itself, for collectives this trait does not carry (the training core's
    /// tensor reductions).
    pub fn communicator(&self) -> &SimpleCommunicator {
        &self.world
    }

    /// Ends every rank of the job with `code` (after an error on one rank, so that the others
    /// do not wait in a collective forever).
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

impl Collective for MpiComm {
    fn rank(&self) -> u64 {
        self.world.rank() as u64
    }
    fn world_size(&self) -> u64 {
        self.world.size() as u64
    }
    fn broadcast(&self, root: u64, data: Option<Vec<u8>>) -> crate::Result<Vec<u8>> {
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
    fn all_gather(&self, data: Vec<u8>) -> crate::Result<Vec<Vec<u8>>> {
        let n = self.world.size() as usize;
        // Every part is sent with one leading byte, so that no rank passes MPI an empty buffer
        // (Open MPI refuses an `MPI_Allgatherv` whose buffers are all empty).
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
    fn barrier(&self) -> crate::Result<()> {
        self.world.barrier();
        Ok(())
    }
}
