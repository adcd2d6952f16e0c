//! The background writer of `--async-save`: a thread with its own duplicate of the world
//! communicator (made at start, while the main thread waits, so the two never run a
//! collective on one communicator at once), writing one snapshot at a time.
//!
//! A snapshot shares the rank's weights instead of copying them (an `Arc` of the set that was
//! current when the save was asked for); the thread drops it before it reports the save done,
//! so once [`Saver::wait`] returns, the loop owns that set again and may step into it.

use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};

use anyhow::Context;

use crate::comm::Comm;
use crate::state::{self, Snapshot};

/// One save for the thread: where, what, how many to keep.
type Job = (PathBuf, Snapshot, usize);

/// The writer thread and its two channels.
#[derive(Debug)]
pub(crate) struct Saver {
    tx: Option<SyncSender<Job>>,
    done: Receiver<anyhow::Result<()>>,
    pending: bool,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Saver {
    /// Starts the thread. Collective: every rank calls it at the same point.
    pub(crate) fn start() -> Saver {
        let (tx, rx) = sync_channel::<Job>(1);
        let (done_tx, done) = std::sync::mpsc::channel();
        let (ready_tx, ready) = std::sync::mpsc::channel::<()>();
        // An MPI communicator handle is not `Send`: the thread makes its own duplicate of the
        // world while this thread waits for it and calls nothing.
        let thread = std::thread::spawn(move || {
            let own = Comm::world_duplicate();
            let _ = ready_tx.send(());
            for (dir, snap, keep) in rx {
                let r = state::save(&dir, &snap, keep, &own).map(|_| ());
                // The weights go back to the loop before it hears that the save is done.
                drop(snap);
                let _ = done_tx.send(r);
            }
        });
        let _ = ready.recv();
        Saver { tx: Some(tx), done, pending: false, thread: Some(thread) }
    }

    /// Waits for the previous save, then hands this one to the thread.
    pub(crate) fn submit(&mut self, dir: PathBuf, snap: Snapshot, keep: usize) -> anyhow::Result<()> {
        self.wait()?;
        let tx = self.tx.as_ref().context("saver stopped")?;
        tx.send((dir, snap, keep)).map_err(|_| anyhow::anyhow!("saver thread ended"))?;
        self.pending = true;
        Ok(())
    }

    /// Waits until the last submitted save is committed (and its weights given back).
    pub(crate) fn wait(&mut self) -> anyhow::Result<()> {
        if std::mem::replace(&mut self.pending, false) {
            self.done.recv().map_err(|_| anyhow::anyhow!("saver thread ended"))??;
        }
        Ok(())
    }

    /// Waits for the last save and ends the thread.
    pub(crate) fn finish(mut self) -> anyhow::Result<()> {
        self.wait()?;
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        Ok(())
    }
}
