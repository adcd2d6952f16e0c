//! Claiming a destination for one operation, so that no two writers race over it.
//!
//! Two processes writing one destination at once (two jobs, two Python processes, a launcher
//! that started one process per rank of a `ckpt` built without MPI) each plan, stage and commit
//! on their own: one's sweep of leftovers removes the other's temporaries, and the commit that
//! lands last wins over a set the other half-replaced. Every public operation therefore claims
//! its destination first and holds the claim until its commit is durable:
//!
//! - the ranks of a job agree that they all name the same destination (ranks given different
//!   ones would each commit their own, none of them whole: [`Error::DestinationsDiffer`]);
//! - the one process that commits (rank 0, or the process alone) takes the destination's
//!   advisory lock (`durable::DestLock`); another process holding it is refused at once, by its
//!   pid ([`Error::DestinationLocked`]), never waited for. A lock left by a killed process is
//!   taken over.
//!
//! A dry run writes nothing and takes no lock, but its ranks still agree on the destination.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::read::io::fs_error;
use crate::write::job::agree;
use crate::write::WriteOptions;

/// A destination held for one operation: its lock (on the process that commits, where one can
/// be placed), released when dropped.
#[derive(Debug)]
#[must_use = "the destination is only held while the claim lives"]
pub(crate) struct Claim {
    _lock: Option<durable::DestLock>,
}

/// Claims `dst` for the operation `opts` describes (see the module docs). Every rank of the
/// job must call it, in the same place of the same operation (inside [`crate::Job::operation`],
/// so that a rank failing here alone ends the others' wait too).
pub(crate) fn claim(dst: &Path, opts: &WriteOptions<'_>) -> Result<Claim> {
    let job = opts.job.filter(|j| j.world_size() > 1);
    if let Some(job) = job {
        let mine = as_named(dst);
        let all = job.exchange(dst, mine.as_os_str().as_bytes().to_vec())?;
        let first = all.first().map(|b| PathBuf::from(std::ffi::OsStr::from_bytes(b))).unwrap_or_default();
        let same = match first == mine {
            true => Ok(()),
            false => Err(Error::DestinationsDiffer { dst: first, rank: job.rank(), other: dst.to_path_buf() }),
        };
        agree(job, dst, same)?;
    }
    if opts.job.is_some_and(crate::Job::is_dry_run) {
        return Ok(Claim { _lock: None });
    }
    let root = opts.job.is_none_or(|j| j.rank() == 0);
    let lock = match root {
        true => durable::DestLock::acquire(dst).map_err(fs_error),
        false => Ok(None),
    };
    let lock = match job {
        Some(job) => agree(job, dst, lock)?,
        None => lock?,
    };
    Ok(Claim { _lock: lock })
}

/// `dst` as the ranks compare it: its components, so that `out/` and `./out` are the one
/// destination `out`. Relative paths stay relative: ranks on other nodes may mount the shared
/// filesystem elsewhere, and a job's ranks are started in one working folder.
fn as_named(dst: &Path) -> PathBuf {
    dst.components().filter(|c| !matches!(c, std::path::Component::CurDir)).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::Job;
    use collective::Collective;

    #[test]
    fn a_destination_being_written_is_refused_by_the_holders_pid() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let solo = Job::solo();
        let opts = WriteOptions { job: Some(&solo), ..WriteOptions::default() };
        let held = claim(&out, &opts).unwrap();
        let err = claim(&out, &WriteOptions::default()).unwrap_err();
        let pid = std::process::id();
        assert!(matches!(&err, Error::DestinationLocked { pid: Some(p), .. } if *p == pid), "{err}");
        assert_eq!(err.kind(), crate::ErrorKind::Usage);
        // A dry run writes nothing: it needs no lock, and is not refused by one.
        let dry = Job::solo().dry_run(true);
        let dry_claim = claim(&out, &WriteOptions { job: Some(&dry), ..WriteOptions::default() }).unwrap();
        assert!(dry_claim._lock.is_none());
        drop(held);
        assert!(claim(&out, &opts).unwrap()._lock.is_some(), "once released, the destination is free");
    }

    #[test]
    fn ranks_given_different_destinations_are_refused_before_any_locks() {
        let tmp = tempfile::tempdir().unwrap();
        let results: Vec<Result<Claim>> = std::thread::scope(|s| {
            let handles: Vec<_> = collective::InProcessGroup::new(2)
                .into_iter()
                .map(|comm| {
                    let dir = tmp.path().to_path_buf();
                    s.spawn(move || {
                        let job = Job::new(&comm);
                        let out = dir.join(format!("out{}", comm.rank()));
                        claim(&out, &WriteOptions { job: Some(&job), ..WriteOptions::default() })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let err = results[1].as_ref().unwrap_err();
        let expected = format!(
            "{}: rank 1 was given `{}` as its destination; every rank of a job must name the destination rank 0 \
             names",
            tmp.path().join("out0").display(),
            tmp.path().join("out1").display()
        );
        assert_eq!(err.to_string(), expected);
        assert!(matches!(results[0], Err(Error::OtherRank { rank: 1 })), "rank 0 leaves too: {:?}", results[0]);
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert!(left.is_empty(), "no lock was taken");
        // `./out/` and `out` are one destination.
        assert_eq!(as_named(Path::new("./out/")), as_named(Path::new("out")));
    }
}
