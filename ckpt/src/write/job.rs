//! One operation over the ranks of a job: who they are, how they agree, and what each did.
//!
//! A [`Job`] wraps the [`Collective`] the ranks talk through. Every rank opens the same source,
//! builds the same plan and deals it out the same way ([`crate::plan::shares`]), so nothing but small
//! agreements crosses between them: a token and the staging folder from rank 0, a fingerprint
//! of each rank's plan, and after each step whether every rank managed it ([`agree`]). A step
//! that failed anywhere ends the operation everywhere before the commit; the rank that saw the
//! error returns it and the others return [`Error::OtherRank`], so it is reported once.
//!
//! A rank can also fail alone between two agreements, outside any step: while planning (an I/O
//! error on one node), or in an operation's own work between two plans. It then leaves the
//! operation while the others wait in their next exchange, which no rank would ever join. So
//! every exchange of an operation goes through [`Job::exchange`], each message tagged: a step's
//! message, or the last one a rank sends as it leaves the operation ([`Job::operation`], once,
//! at the outermost operation: ok, failed, or failed because another rank did). A rank that
//! hears another leave while it is still inside returns [`Error::OtherRank`] from that exchange
//! and exchanges nothing more until it has left the operation too (it does not say it leaves:
//! the other has heard it already, in the one exchange they shared). Every rank so makes the
//! same number of exchanges, whoever fails where.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use collective::{Collective, Solo};

use crate::error::{Error, Result};
use crate::plan::shares::{RankShare, Share};
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
    /// How many operations this rank is inside (one calls another: a `save_state` folder's
    /// merge merges its model); only the outermost says it leaves.
    depth: AtomicUsize,
    /// A rank heard leaving the current operation while this one was inside it: the rank whose
    /// error is reported.
    left: Mutex<Option<u64>>,
}

/// The tag of a step's message in an exchange.
const STEP: u8 = 0;
/// The tag of the message a rank sends as it leaves an operation, followed by one of the three
/// states below.
const LEAVES: u8 = 1;
const LEFT_OK: u8 = 0;
const LEFT_FAILED: u8 = 1;
const LEFT_AFTER_OTHER: u8 = 2;

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
        Job { comm, dry_run: false, shares: Mutex::new(Vec::new()), depth: AtomicUsize::new(0), left: Mutex::new(None) }
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
        Ok(first_said(self, at, failed.then(Vec::new))?.map(|(rank, _)| rank))
    }

    /// `mine` on every rank once all have settled it: its own error on the lowest rank that
    /// failed, [`Error::OtherRank`] naming that rank on the others (through `lift`, which also
    /// turns an error of the collective into the caller's type), and `mine` where all succeeded.
    ///
    /// Every rank must call it. An error that `only_other` recognises as another rank's failure
    /// (an [`Error::OtherRank`] from an operation that already agreed) does not count as this
    /// rank's own, so the rank that saw the error reports it and the others stay quiet.
    pub fn agree<T, E>(
        &self,
        at: &Path,
        mine: std::result::Result<T, E>,
        only_other: impl FnOnce(&E) -> bool,
        lift: impl Fn(Error) -> E,
    ) -> std::result::Result<T, E> {
        let say = |e: &E| (!only_other(e)).then(Vec::new);
        agree_with(self, at, mine, say, |rank, _| lift(Error::OtherRank { rank }), &lift)
    }

    /// Runs one operation of the library (`f`) on this rank. The outermost operation ends with
    /// every rank saying how it left it, so that all return the same way: a rank that failed
    /// alone (while planning, or between two plans) reports its error, and the others, wherever
    /// they were waiting for it, return [`Error::OtherRank`] (see the module docs). `at` names
    /// the output in an error of the collective.
    pub(crate) fn operation<T>(&self, at: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.depth.fetch_add(1, Ordering::SeqCst);
        let done = f();
        if self.depth.fetch_sub(1, Ordering::SeqCst) > 1 || self.world_size() == 1 {
            return done;
        }
        // Another rank left while this one was inside: they have already shared the exchange
        // that ends the operation.
        if let Some(rank) = self.left.lock().ok().and_then(|mut l| l.take()) {
            return Err(Error::OtherRank { rank });
        }
        let state = match &done {
            Ok(_) => LEFT_OK,
            Err(Error::OtherRank { .. }) => LEFT_AFTER_OTHER,
            Err(_) => LEFT_FAILED,
        };
        let all = self
            .comm
            .all_gather(vec![LEAVES, state])
            .map_err(|source| Error::Collective { dir: at.to_path_buf(), source })?;
        let me = self.rank();
        let still_inside = all.iter().any(|m| m.first() != Some(&LEAVES));
        match first_leaving(&all) {
            // A rank that leaves with its own error reports it, the lowest if several do.
            Some(rank) if rank == me => done,
            Some(rank) => match done {
                Err(e @ Error::OtherRank { .. }) => Err(e),
                _ => Err(Error::OtherRank { rank }),
            },
            // This rank finished while others are still inside the operation: they planned
            // another one (it reports that; they hear it leave).
            None if still_inside && state == LEFT_OK => Err(Error::PlanMismatch { path: at.to_path_buf(), rank: me }),
            None => done,
        }
    }

    /// Every rank's `payload` (indexed by rank), within an operation: [`Error::OtherRank`]
    /// instead where another rank left the operation meanwhile, and at once, without a word,
    /// once one has (see the module docs). Every exchange of an operation's steps goes through it.
    pub(crate) fn exchange(&self, at: &Path, payload: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        if let Some(rank) = self.left.lock().ok().and_then(|l| *l) {
            return Err(Error::OtherRank { rank });
        }
        let all = self
            .comm
            .all_gather([vec![STEP], payload].concat())
            .map_err(|source| Error::Collective { dir: at.to_path_buf(), source })?;
        let Some(first) = all.iter().position(|m| m.first() == Some(&LEAVES)) else {
            return Ok(all.into_iter().map(|m| m.get(1..).unwrap_or_default().to_vec()).collect());
        };
        // The lowest rank that left with its own error reports it; else the lowest that left
        // (one that finished where this rank had not reports the mismatch).
        let rank = first_leaving(&all).unwrap_or(first as u64);
        if let Ok(mut left) = self.left.lock() {
            *left = Some(rank);
        }
        Err(Error::OtherRank { rank })
    }

    /// The fault switch's `open` point, for an edge to call once this rank has opened its
    /// source `src`: in a test build, the error `STATEKIT_FAULT=RANK:open` asks this rank for;
    /// `Ok` otherwise, and always in a release build (see `ckpt/src/write/fault.rs`).
    pub fn fault_at_open(&self, src: &Path) -> Result<()> {
        crate::write::fault::at(crate::write::fault::Phase::Open, self.rank(), src)
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
pub(crate) fn agree<T>(job: &Job<'_>, at: &Path, mine: Result<T>) -> Result<T> {
    agree_with(job, at, mine, |_| Some(Vec::new()), |rank, _| Error::OtherRank { rank }, |e| e)
}

/// The one agreement every other is made of. Every rank says whether its step failed on its
/// own (`say` gives `None` for an error that only reports another rank's failure, else a note
/// for the others, empty for most callers); the lowest rank that did keeps its error, every
/// other rank returns `other(that rank, its note)`, and a rank whose step succeeded alone keeps
/// its result. An error of the collective itself goes through `lift`.
pub(crate) fn agree_with<T, E>(
    job: &Job<'_>,
    at: &Path,
    mine: std::result::Result<T, E>,
    say: impl FnOnce(&E) -> Option<Vec<u8>>,
    other: impl FnOnce(u64, &[u8]) -> E,
    lift: impl FnOnce(Error) -> E,
) -> std::result::Result<T, E> {
    let note = mine.as_ref().err().and_then(say);
    let first = match first_said(job, at, note) {
        Ok(first) => first,
        Err(e) => return Err(lift(e)),
    };
    match first {
        Some((rank, note)) if rank != job.rank() => Err(other(rank, &note)),
        _ => mine,
    }
}

/// The lowest rank whose message in `all` says it left the operation with its own error.
fn first_leaving(all: &[Vec<u8>]) -> Option<u64> {
    all.iter().position(|m| m[..] == [LEAVES, LEFT_FAILED]).map(|r| r as u64)
}

/// The lowest rank that says it failed, and its note, if any (every rank must call it). A rank
/// sends one byte when it did not fail, and a marker byte and its note when it did.
fn first_said(job: &Job<'_>, at: &Path, note: Option<Vec<u8>>) -> Result<Option<(u64, Vec<u8>)>> {
    let mine = match note {
        None => vec![0],
        Some(note) => [vec![1], note].concat(),
    };
    let all = job.exchange(at, mine)?;
    Ok(all.into_iter().enumerate().find(|(_, s)| s.first() == Some(&1)).map(|(r, s)| (r as u64, s[1..].to_vec())))
}
