//! The fault switch of test builds: `STATEKIT_FAULT=RANK:PHASE` makes rank `RANK` of a job fail
//! at `PHASE`, alone, with an ordinary I/O error that names the path it was working on and says
//! `injected fault at PHASE`. The multi-rank protocol is tested with it (`cli/tests/ranks/faults.rs`):
//! whichever rank fails wherever, every rank must end, nothing may be committed, and the error
//! must be reported once.
//!
//! The phases, in the order a write goes through them:
//! - `open`: after the source is opened (the edges call [`crate::Job::fault_at_open`]);
//! - `plan`: after planning, before the plan's execution meets the other ranks;
//! - `stage`: the checks and the staging folder (the protocol's first agreement);
//! - `create`: creating the owned targets' temporaries;
//! - `copy`: inside a range copy of the rank's share;
//! - `fsync`: making the rank's share durable, after the copies;
//! - `seal`: sealing and hashing the owned targets;
//! - `commit`: the committing rank (rank 0), before its first rename. The other ranks have no
//!   commit work of their own: a fault they could have there is the seal's.
//!
//! Only builds with debug assertions read the variable (cargo's dev and test profiles, which is
//! how `make test` builds the `ckpt` it runs): the release binaries (`make demo`, `make bench`)
//! and the release-built Python package never look at it, so a stray variable in a user's
//! environment cannot fail their job. A value that is not `RANK:PHASE` is ignored.

use std::path::Path;

use crate::error::{Error, Result};

/// Where in an operation the switch can make a rank fail (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Open,
    Plan,
    Stage,
    Create,
    Copy,
    Fsync,
    Seal,
    Commit,
}

impl Phase {
    const ALL: [Phase; 8] =
        [Phase::Open, Phase::Plan, Phase::Stage, Phase::Create, Phase::Copy, Phase::Fsync, Phase::Seal, Phase::Commit];

    fn name(self) -> &'static str {
        match self {
            Phase::Open => "open",
            Phase::Plan => "plan",
            Phase::Stage => "stage",
            Phase::Create => "create",
            Phase::Copy => "copy",
            Phase::Fsync => "fsync",
            Phase::Seal => "seal",
            Phase::Commit => "commit",
        }
    }
}

/// An error when the switch names `rank` and `phase`, about `path`; `Ok` otherwise, and always
/// in a release build.
pub(crate) fn at(phase: Phase, rank: u64, path: &Path) -> Result<()> {
    match armed() == Some((rank, phase)) {
        true => Err(Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(format!("injected fault at {}", phase.name())),
        }),
        false => Ok(()),
    }
}

/// The rank and phase the switch names, read once per process; never in a release build.
fn armed() -> Option<(u64, Phase)> {
    if !cfg!(debug_assertions) {
        return None;
    }
    static ARMED: std::sync::OnceLock<Option<(u64, Phase)>> = std::sync::OnceLock::new();
    *ARMED.get_or_init(|| parse(&std::env::var("STATEKIT_FAULT").ok()?))
}

/// `RANK:PHASE`.
fn parse(value: &str) -> Option<(u64, Phase)> {
    let (rank, phase) = value.split_once(':')?;
    let phase = Phase::ALL.into_iter().find(|p| p.name() == phase)?;
    Some((rank.parse().ok()?, phase))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_names_a_rank_and_a_phase() {
        assert_eq!(parse("1:copy"), Some((1, Phase::Copy)));
        assert_eq!(parse("0:commit"), Some((0, Phase::Commit)));
        for bad in ["", "1", "copy", "x:copy", "1:copies", "-1:open", "1:open:2"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}
