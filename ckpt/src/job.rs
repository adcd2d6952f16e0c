//! One operation over the ranks of a job: who they are, how they agree, and what each did.
//!
//! A [`Job`] wraps the [`Collective`] the ranks talk through. Every rank opens the same source,
//! builds the same plan and deals it out the same way ([`crate::shares`]), so nothing but small
//! agreements crosses between them: a token and the staging folder from rank 0, a fingerprint
//! of each rank's plan, and after each step whether every rank managed it ([`agree`]). A step
//! that failed anywhere ends the operation everywhere before the commit; the rank that saw the
//! error returns it and the others return [`Error::OtherRank`], so it is reported once.

use std::path::Path;
use std::sync::Mutex;

use collective::{Collective, Solo};

use crate::error::{Error, Result};
use crate::shares::{RankShare, Share};
use crate::write::Plan;

/// The ranks one operation runs over, and what each of them did.
///
/// Pass it in [`crate::WriteOptions::job`]. Every rank of the collective must call the same
/// operation with the same arguments; each then writes only its share, and rank 0 commits. The
/// [`crate::Outcome`] then lists every rank's share (`ranks`).
pub struct Job<'a> {
    comm: &'a dyn Collective,
    dry_run: bool,
    shares: Mutex<Vec<RankShare>>,
}

impl std::fmt::Debug for Job<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("dry_run", &self.dry_run)
            .finish()
    }
}

static SOLO: Solo = Solo;

impl<'a> Job<'a> {
    /// The job of the ranks of `comm`.
    pub fn new(comm: &'a dyn Collective) -> Job<'a> {
        Job { comm, dry_run: false, shares: Mutex::new(Vec::new()) }
    }

    /// A job of one rank: this process alone.
    pub fn solo() -> Job<'static> {
        Job::new(&SOLO)
    }

    /// Plans and deals out every write without performing any: the outcome lists the files
    /// and each rank's share, and nothing is created, replaced or removed.
    pub fn dry_run(mut self, yes: bool) -> Self {
        self.dry_run = yes;
        self
    }

    /// Whether this is a dry run.
    pub fn is_dry_run(&self) -> bool {
        self.dry_run
    }

    /// This rank.
    pub fn rank(&self) -> u64 {
        self.comm.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> u64 {
        self.comm.world_size()
    }

    /// What each rank has done so far, by rank (every rank knows every share: they are dealt
    /// the same way everywhere).
    pub fn shares(&self) -> Vec<RankShare> {
        self.shares.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Every rank says whether a step of its own failed (one that is not an operation of this
    /// library: parsing its arguments, opening its source); returns the lowest rank that did, on
    /// every rank, so that only that rank reports its error and none goes on alone into an
    /// operation the others left. `at` names the job's output in an error of the collective.
    pub fn first_failure(&self, at: &Path, failed: bool) -> Result<Option<u64>> {
        first_failure(self.comm, at, failed)
    }

    pub(crate) fn comm(&self) -> &dyn Collective {
        self.comm
    }

    /// Adds one plan's shares to the record.
    pub(crate) fn record(&self, plan: &Plan, shares: &[Share]) {
        let Ok(mut log) = self.shares.lock() else { return };
        if log.is_empty() {
            *log = (0..shares.len() as u64).map(|rank| RankShare { rank, ..RankShare::default() }).collect();
        }
        for (r, (mine, share)) in log.iter_mut().zip(shares).enumerate() {
            mine.add(&share.report(plan, r as u64));
        }
    }
}

/// Whether every rank managed a step. On every rank: its own result when all succeeded, its
/// own error when it is the lowest rank that failed, and [`Error::OtherRank`] naming that rank
/// otherwise (an `Ok` is dropped then, which removes what it held: temporaries). `at` names the
/// output in an error of the collective itself.
pub(crate) fn agree<T>(comm: &dyn Collective, at: &Path, mine: Result<T>) -> Result<T> {
    match first_failure(comm, at, mine.is_err())? {
        Some(first) if first != comm.rank() => Err(Error::OtherRank { rank: first }),
        _ => mine,
    }
}

/// The lowest rank that says it failed, if any (every rank must call it).
fn first_failure(comm: &dyn Collective, at: &Path, failed: bool) -> Result<Option<u64>> {
    let all = comm
        .all_gather(vec![u8::from(failed)])
        .map_err(|source| Error::Collective { dir: at.to_path_buf(), source })?;
    Ok(all.iter().position(|s| s.first() == Some(&1)).map(|r| r as u64))
}
