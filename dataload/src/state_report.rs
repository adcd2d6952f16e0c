//! What a saved [`LoaderState`] means, rank by rank: where the epoch is, what each rank reads
//! next, and for a mixture where its sources are. This is the document `ckpt data state --json`
//! prints and the text it prints without `--json`, built here once so that the tool and any
//! other caller render the same thing.

use std::fmt;

use serde::Serialize;

use crate::{LoaderState, Mixture, Result, ShardMode, ShardedSampler};

/// A loader state explained (`ckpt data state`): its position, and each rank's next batch.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct StateReport {
    /// The epoch the state is in.
    pub epoch: u64,
    /// Samples all ranks together have consumed in the epoch.
    pub cursor: u64,
    /// Samples in the dataset.
    pub dataset_len: u64,
    /// The ranks the state was saved by.
    pub world_size: u64,
    /// Samples per global step.
    pub global_batch_size: u64,
    /// Global steps done in the epoch.
    pub steps_done: u64,
    /// Global steps left in the epoch.
    pub steps_left: u64,
    /// How the loader shards.
    pub mode: ShardMode,
    /// The sampler, as the state names it.
    pub sampler: String,
    /// What each rank reads next.
    pub ranks: Vec<RankReport>,
    /// Where a mixture's sources are (mixtures only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mixture: Option<MixtureReport>,
}

/// One rank's next batch, and how many are left to it in the epoch.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct RankReport {
    /// The rank.
    pub rank: u64,
    /// The indices of its next batch; `None` when its epoch is done.
    pub next_batch: Option<Vec<u64>>,
    /// Batches left to it in the epoch.
    pub batches_left: u64,
    /// A mixture's `(source, index)` of each sample of `next_batch`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_samples: Option<Vec<(usize, u64)>>,
}

/// Where a mixture's sources are at the cursor.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct MixtureReport {
    /// Number of sources.
    pub sources: usize,
    /// The block size in force at the cursor: proportions hold to within one block.
    pub block: u64,
    /// Samples each source has given before the cursor.
    pub positions: Vec<u64>,
}

impl StateReport {
    /// Explains `st`: resumes it on each of its ranks and looks at what each reads next.
    pub fn new(st: &LoaderState) -> Result<StateReport> {
        let mixture = st.mixture.clone().map(Mixture::new).transpose()?;
        let mut ranks = Vec::new();
        let mut geometry = None;
        let mut steps_left = 0;
        for rank in 0..st.world_size {
            let mut l = ShardedSampler::from_state(st, st.world_size, rank)?;
            geometry.get_or_insert(*l.geometry());
            steps_left = l.current_plan()?.num_steps();
            let batches_left = l.remaining()?;
            let next_batch = l.clone().next_batch()?;
            let next_samples = match (&mixture, &next_batch) {
                (Some(m), Some(b)) => Some(m.locate_many(b)?),
                _ => None,
            };
            ranks.push(RankReport { rank, next_batch, batches_left, next_samples });
        }
        let mixture = match mixture {
            Some(m) => Some(MixtureReport {
                sources: m.sources(),
                block: m.block_at(st.cursor),
                positions: m.positions(st.cursor)?,
            }),
            None => None,
        };
        let g = geometry.map(|g| g.global_batch()).unwrap_or(0);
        Ok(StateReport {
            epoch: st.epoch,
            cursor: st.cursor,
            dataset_len: st.dataset_len,
            world_size: st.world_size,
            global_batch_size: g,
            steps_done: st.cursor.checked_div(g).unwrap_or(0),
            steps_left,
            mode: st.mode,
            sampler: st.sampler.to_string(),
            ranks,
            mixture,
        })
    }
}

/// `1, 2, 3` of a batch, `[]` when empty.
fn list(b: &[u64]) -> String {
    let items: Vec<String> = b.iter().map(u64::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// The text `ckpt data state` prints without `--json`.
impl fmt::Display for StateReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "epoch {}: {} of {} samples consumed ({} sampler, {} ranks, global batch {})",
            self.epoch, self.cursor, self.dataset_len, self.sampler, self.world_size, self.global_batch_size
        )?;
        writeln!(f, "{} global steps left in this epoch", self.steps_left)?;
        if let Some(m) = &self.mixture {
            let given: Vec<String> = m.positions.iter().enumerate().map(|(i, p)| format!("source {i}: {p}")).collect();
            writeln!(f, "mixture of {} sources, samples given before the cursor: {}", m.sources, given.join(", "))?;
        }
        for r in &self.ranks {
            match (&r.next_batch, &r.next_samples) {
                (Some(_), Some(samples)) => {
                    let shown: Vec<String> = samples.iter().map(|(src, j)| format!("{src}:{j}")).collect();
                    writeln!(f, "rank {}: next [{}] ({} batches left)", r.rank, shown.join(", "), r.batches_left)?
                }
                (Some(b), None) => writeln!(f, "rank {}: next {} ({} batches left)", r.rank, list(b), r.batches_left)?,
                (None, _) => writeln!(f, "rank {}: epoch done, next batch starts epoch {}", r.rank, self.epoch + 1)?,
            }
        }
        Ok(())
    }
}
