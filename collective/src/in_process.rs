//! Threads as ranks: a group of handles that meet in shared memory.
//!
//! Every operation is an exchange: each rank deposits its part in its slot, all ranks meet,
//! each reads what it needs, and all meet again so the slots can be reused by the next
//! operation. The meeting point is a generation-counted barrier of our own rather than
//! [`std::sync::Barrier`], because the standard one waits forever for a rank that panicked:
//! here a rank's handle, when dropped (by unwinding, or because the rank is done), marks the
//! group broken and wakes everyone, so the ranks still waiting get an error instead of a hang.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use crate::error::{CollectiveError, Result};
use crate::Collective;

/// Constructor of a group of [`InProcessCollective`] handles sharing memory.
#[derive(Debug)]
pub struct InProcessGroup;

impl InProcessGroup {
    /// One handle per rank, in rank order; move each into its own thread.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world_size: u64) -> Vec<InProcessCollective> {
        let slots = usize::try_from(world_size).expect("an in-process group has fewer ranks than memory has bytes");
        let shared = Arc::new(Shared {
            world_size,
            state: Mutex::new(State { slots: vec![None; slots], arrived: 0, generation: 0, gone: None }),
            wake: Condvar::new(),
        });
        (0..world_size)
            .map(|rank| InProcessCollective {
                rank,
                shared: Arc::clone(&shared),
                _member: Arc::new(Member { rank, shared: Arc::clone(&shared) }),
            })
            .collect()
    }
}

#[derive(Debug)]
struct Shared {
    world_size: u64,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Debug)]
struct State {
    slots: Vec<Option<Vec<u8>>>,
    /// Ranks waiting at the current meeting.
    arrived: u64,
    /// Meetings completed so far; a waiter is released when it changes.
    generation: u64,
    /// The first rank that left the group, and whether it panicked.
    gone: Option<(u64, bool)>,
}

/// Lives as long as some handle of its rank does: its drop is the rank leaving the group.
#[derive(Debug)]
struct Member {
    rank: u64,
    shared: Arc<Shared>,
}

impl Drop for Member {
    fn drop(&mut self) {
        let mut state = self.shared.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.gone.is_none() {
            state.gone = Some((self.rank, std::thread::panicking()));
        }
        drop(state);
        self.shared.wake.notify_all();
    }
}

/// One rank of an [`InProcessGroup`]. Clones are the same rank; the rank leaves the group
/// when its last clone is dropped.
#[derive(Debug, Clone)]
pub struct InProcessCollective {
    rank: u64,
    shared: Arc<Shared>,
    /// Held only for its drop: the last clone of this rank going away is the rank leaving.
    _member: Arc<Member>,
}

impl InProcessCollective {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock, and the state stays consistent if something
        // did: a poisoned lock is still usable.
        self.shared.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn gone(&self, op: &'static str, (peer, panicked): (u64, bool)) -> CollectiveError {
        CollectiveError::PeerGone { op, rank: self.rank, peer, panicked }
    }

    /// Waits until every rank has reached this meeting, or one has left the group.
    fn meet<'g>(&'g self, op: &'static str, mut state: MutexGuard<'g, State>) -> Result<MutexGuard<'g, State>> {
        if let Some(gone) = state.gone {
            return Err(self.gone(op, gone));
        }
        state.arrived += 1;
        if state.arrived == self.shared.world_size {
            state.arrived = 0;
            state.generation += 1;
            self.shared.wake.notify_all();
            return Ok(state);
        }
        let generation = state.generation;
        while state.generation == generation {
            if let Some(gone) = state.gone {
                return Err(self.gone(op, gone));
            }
            state = self.shared.wake.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
        Ok(state)
    }

    /// Deposits `data` in this rank's slot and returns every slot once all ranks have.
    fn exchange(&self, op: &'static str, data: Option<Vec<u8>>) -> Result<Vec<Option<Vec<u8>>>> {
        let mut state = self.lock();
        state.slots[self.slot()] = data;
        let state = self.meet(op, state)?;
        let all = state.slots.clone();
        // The second meeting keeps a fast rank from overwriting its slot with the next
        // operation's data before a slow one has read this one's.
        drop(self.meet(op, state)?);
        Ok(all)
    }

    fn slot(&self) -> usize {
        // `new` checked that every rank fits a `usize`.
        usize::try_from(self.rank).unwrap_or(usize::MAX)
    }
}

impl Collective for InProcessCollective {
    fn rank(&self) -> u64 {
        self.rank
    }

    fn world_size(&self) -> u64 {
        self.shared.world_size
    }

    fn broadcast(&self, root: u64, data: Option<Vec<u8>>) -> Result<Vec<u8>> {
        if root >= self.shared.world_size {
            return Err(CollectiveError::NoSuchRoot {
                op: "broadcast",
                rank: self.rank,
                root,
                world_size: self.shared.world_size,
            });
        }
        let mine = if self.rank == root { data } else { None };
        let all = self.exchange("broadcast", mine)?;
        let sent = usize::try_from(root).ok().and_then(|r| all.into_iter().nth(r)).flatten();
        sent.ok_or_else(|| CollectiveError::Failed {
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
        drop(self.meet("barrier", self.lock())?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Runs `f` on every rank of a fresh group of `world` threads; results in rank order.
    fn on_ranks<T: Send>(world: u64, f: impl Fn(InProcessCollective) -> T + Sync) -> Vec<std::thread::Result<T>> {
        let f = &f;
        std::thread::scope(|s| {
            let hs: Vec<_> = InProcessGroup::new(world).into_iter().map(|c| s.spawn(move || f(c))).collect();
            hs.into_iter().map(|h| h.join()).collect()
        })
    }

    #[test]
    fn broadcast_reaches_every_rank() {
        let got = on_ranks(4, |c| {
            let r = c.rank();
            let first = c.broadcast(2, (r == 2).then(|| vec![7, 8])).unwrap();
            // Only the root's argument counts.
            let second = c.broadcast(0, Some(vec![u8::try_from(r).unwrap()])).unwrap();
            (first, second)
        });
        for g in got {
            assert_eq!(g.unwrap(), (vec![7, 8], vec![0]));
        }
    }

    #[test]
    fn broadcast_refuses_a_root_outside_the_group() {
        let got = on_ranks(2, |c| c.broadcast(5, None).unwrap_err().to_string());
        assert_eq!(
            got[1].as_ref().unwrap(),
            "collective `broadcast` failed on rank 1: root 5 is not a rank of a world of 2"
        );
    }

    #[test]
    fn broadcast_from_a_root_that_sends_nothing_is_an_error() {
        let got = on_ranks(2, |c| c.broadcast(0, None).unwrap_err().to_string());
        assert_eq!(got[0].as_ref().unwrap(), "collective `broadcast` failed on rank 0: root 0 sent nothing");
    }

    #[test]
    fn all_gather_is_in_rank_order_and_reusable() {
        let got = on_ranks(3, |c| {
            let r = u8::try_from(c.rank()).unwrap();
            (0..50u8).map(|i| c.all_gather(vec![r + i; usize::from(r)]).unwrap()).collect::<Vec<_>>()
        });
        for g in got {
            for (i, step) in g.unwrap().into_iter().enumerate() {
                let i = u8::try_from(i).unwrap();
                assert_eq!(step, vec![vec![], vec![1 + i], vec![2 + i, 2 + i]]);
            }
        }
    }

    #[test]
    fn barrier_waits_for_every_rank() {
        let counter = std::sync::atomic::AtomicU64::new(0);
        let got = on_ranks(4, |c| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            c.barrier().unwrap();
            counter.load(std::sync::atomic::Ordering::SeqCst)
        });
        for g in got {
            assert_eq!(g.unwrap(), 4);
        }
    }

    #[test]
    fn a_single_rank_needs_nobody() {
        let c = InProcessGroup::new(1).pop().unwrap();
        assert_eq!((c.rank(), c.world_size()), (0, 1));
        c.barrier().unwrap();
        assert_eq!(c.broadcast(0, Some(vec![1])).unwrap(), vec![1]);
        assert_eq!(c.all_gather(vec![2]).unwrap(), vec![vec![2]]);
    }

    #[test]
    fn a_panicking_rank_is_an_error_not_a_hang() {
        let got = on_ranks(3, |c| {
            if c.rank() == 1 {
                panic!("rank 1 fails before the barrier");
            }
            c.barrier().unwrap_err().to_string()
        });
        assert!(got[1].is_err());
        for r in [0, 2] {
            assert_eq!(got[r].as_ref().unwrap(), &format!("collective `barrier` failed on rank {r}: rank 1 panicked"));
        }
    }

    #[test]
    fn a_rank_that_leaves_early_is_an_error_not_a_hang() {
        let got =
            on_ranks(2, |c| if c.rank() == 0 { c.all_gather(vec![1]).unwrap_err().to_string() } else { String::new() });
        assert_eq!(got[0].as_ref().unwrap(), "collective `all_gather` failed on rank 0: rank 1 left the group");
    }

    #[test]
    fn a_clone_is_the_same_rank_and_does_not_leave() {
        let got = on_ranks(2, |c| {
            drop(c.clone());
            c.all_gather(vec![u8::try_from(c.rank()).unwrap()]).unwrap()
        });
        for g in got {
            assert_eq!(g.unwrap(), vec![vec![0], vec![1]]);
        }
    }

    #[test]
    fn handles_can_move_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<InProcessCollective>();
        send_sync::<CollectiveError>();
    }
}
