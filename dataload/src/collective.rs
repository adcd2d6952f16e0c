//! The communication seam: what dispatching and gathering need from the ranks, nothing more.
//!
//! Payloads are bytes so that MPI, torch.distributed (through the Python bindings) or the
//! in-process [`InProcessGroup`] can carry them without knowing what they mean.

use std::sync::{Arc, Barrier, Mutex};

use crate::error::{DataloadError, Result};

/// Collective operations over a fixed group of ranks. Every rank of the group must call the
/// same operations in the same order, as with MPI.
pub trait Collective {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// `root`'s `data` on every rank. Only `root`'s argument is read; other ranks pass `None`.
    fn broadcast(&self, root: usize, data: Option<Vec<u8>>) -> Result<Vec<u8>>;
    /// Every rank's `data`, indexed by rank, on every rank.
    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
}

/// Threads as ranks: a group of [`InProcessCollective`] handles sharing memory.
#[derive(Debug)]
pub struct InProcessGroup;

impl InProcessGroup {
    /// One handle per rank; move each into its own thread.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world_size: usize) -> Vec<InProcessCollective> {
        let shared = Arc::new(Shared { slots: Mutex::new(vec![None; world_size]), barrier: Barrier::new(world_size) });
        (0..world_size).map(|rank| InProcessCollective { rank, world_size, shared: Arc::clone(&shared) }).collect()
    }
}

#[derive(Debug)]
struct Shared {
    slots: Mutex<Vec<Option<Vec<u8>>>>,
    barrier: Barrier,
}

/// One rank of an [`InProcessGroup`].
#[derive(Debug, Clone)]
pub struct InProcessCollective {
    rank: usize,
    world_size: usize,
    shared: Arc<Shared>,
}

impl InProcessCollective {
    fn poisoned(&self, op: &'static str) -> DataloadError {
        DataloadError::Collective { op, rank: self.rank, reason: "another rank panicked".into() }
    }

    /// Every rank deposits, all wait, every rank reads, all wait again so the slots can be
    /// reused by the next operation.
    fn exchange(&self, op: &'static str, data: Option<Vec<u8>>) -> Result<Vec<Option<Vec<u8>>>> {
        {
            let mut slots = self.shared.slots.lock().map_err(|_| self.poisoned(op))?;
            slots[self.rank] = data;
        }
        self.shared.barrier.wait();
        let all = self.shared.slots.lock().map_err(|_| self.poisoned(op))?.clone();
        self.shared.barrier.wait();
        Ok(all)
    }
}

impl Collective for InProcessCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn broadcast(&self, root: usize, data: Option<Vec<u8>>) -> Result<Vec<u8>> {
        if root >= self.world_size {
            return Err(DataloadError::Collective {
                op: "broadcast",
                rank: self.rank,
                reason: format!("root {root} is not a rank of a world of {}", self.world_size),
            });
        }
        let mine = if self.rank == root { data } else { None };
        let all = self.exchange("broadcast", mine)?;
        all.into_iter().nth(root).flatten().ok_or_else(|| DataloadError::Collective {
            op: "broadcast",
            rank: self.rank,
            reason: format!("root {root} sent nothing"),
        })
    }

    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let all = self.exchange("all_gather", Some(data))?;
        Ok(all.into_iter().map(Option::unwrap_or_default).collect())
    }

    fn barrier(&self) -> Result<()> {
        self.shared.barrier.wait();
        Ok(())
    }
}
