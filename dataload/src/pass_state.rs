//! When a pass over a loader continues the epoch and when it starts it again.
//!
//! torch's samplers and accelerate's loaders start every `iter()` at the beginning of the
//! epoch: a pass broken off (a `break` after some batches) is not continued by the next one;
//! it starts the epoch again (a `RandomSampler` drawing anew from its running generator). A
//! statekit loader also has a position that can be *set* (a loaded state, a
//! `skip_first_batches`, a copy): the next pass continues from it, once. [`PassState`] is that
//! rule, for every edge that runs passes (the Python sampler and both accelerate loaders):
//!
//! | event              | Fresh      | Reading         | Positioned        |
//! |--------------------|------------|-----------------|-------------------|
//! | a pass begins      | `Fresh`    | `BrokenOff` → Fresh | `FromPosition` |
//! | a batch is read    | Reading    | Reading         | Reading           |
//! | the pass ends      | Fresh      | Fresh           | Positioned        |
//! | a position is set  | Positioned | Positioned      | Positioned        |
//! | the epoch is set   | Fresh      | Fresh           | Fresh             |
//!
//! A pass that ends without reading a batch from a set position leaves the position standing.

use serde::{Deserialize, Serialize};

/// Where a loader stands between passes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PassState {
    /// No pass under way and no position set: the next pass reads from where the loader is.
    #[default]
    Fresh,
    /// A pass read a batch and has not ended: if another pass begins, this one was broken off.
    Reading,
    /// A position was set and no batch has been read from it: the next pass continues it.
    Positioned,
}

/// How a pass that begins starts, as [`PassState::begin`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PassStart {
    /// Nothing to undo or keep: the pass reads from where the loader is.
    Fresh,
    /// The previous pass was broken off: this one starts the epoch again.
    BrokenOff,
    /// A position was set: this pass continues from it.
    FromPosition,
}

impl PassState {
    /// A pass begins: how it starts. A broken-off pass is forgotten here (the caller starts the
    /// epoch again); a set position stands until a batch is read from it.
    pub fn begin(&mut self) -> PassStart {
        match self {
            Self::Fresh => PassStart::Fresh,
            Self::Reading => {
                *self = Self::Fresh;
                PassStart::BrokenOff
            }
            Self::Positioned => PassStart::FromPosition,
        }
    }

    /// A batch was handed out by the pass under way.
    pub fn batch_read(&mut self) {
        *self = Self::Reading;
    }

    /// The pass was read to its end. A position no batch was read from still stands.
    pub fn ended(&mut self) {
        if *self == Self::Reading {
            *self = Self::Fresh;
        }
    }

    /// A position was set (a state loaded, batches skipped, a copy made): the next pass
    /// continues from it.
    pub fn position_set(&mut self) {
        *self = Self::Positioned;
    }

    /// The loader moved to another epoch: its passes start at that epoch's beginning.
    pub fn epoch_set(&mut self) {
        *self = Self::Fresh;
    }

    /// Whether a set position stands (no batch read from it yet).
    pub fn position_kept(&self) -> bool {
        *self == Self::Positioned
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy)]
    enum Event {
        Begin,
        Batch,
        End,
        Set,
        Epoch,
    }

    fn apply(state: &mut PassState, event: Event) -> Option<PassStart> {
        match event {
            Event::Begin => return Some(state.begin()),
            Event::Batch => state.batch_read(),
            Event::End => state.ended(),
            Event::Set => state.position_set(),
            Event::Epoch => state.epoch_set(),
        }
        None
    }

    /// The module docs' table, cell by cell: (from, event) → (to, how a pass begins).
    #[test]
    fn every_state_and_event() {
        use Event::*;
        use PassState::{Fresh, Positioned, Reading};
        let table = [
            (Fresh, Begin, Fresh, Some(PassStart::Fresh)),
            (Reading, Begin, Fresh, Some(PassStart::BrokenOff)),
            (Positioned, Begin, Positioned, Some(PassStart::FromPosition)),
            (Fresh, Batch, Reading, None),
            (Reading, Batch, Reading, None),
            (Positioned, Batch, Reading, None),
            (Fresh, End, Fresh, None),
            (Reading, End, Fresh, None),
            (Positioned, End, Positioned, None),
            (Fresh, Set, Positioned, None),
            (Reading, Set, Positioned, None),
            (Positioned, Set, Positioned, None),
            (Fresh, Epoch, Fresh, None),
            (Reading, Epoch, Fresh, None),
            (Positioned, Epoch, Fresh, None),
        ];
        for (from, event, to, start) in table {
            let mut state = from;
            assert_eq!(apply(&mut state, event), start, "{from:?} {event:?}");
            assert_eq!(state, to, "{from:?} {event:?}");
        }
    }

    #[test]
    fn a_pass_broken_off_restarts_the_next_and_a_set_position_is_continued_once() {
        use Event::*;
        let mut state = PassState::default();
        let starts: Vec<_> = [Begin, Batch, Batch, Begin, Batch, End, Begin, Set, Begin, Begin, Batch, Begin]
            .into_iter()
            .filter_map(|e| apply(&mut state, e))
            .collect();
        use PassStart::*;
        assert_eq!(starts, [Fresh, BrokenOff, Fresh, FromPosition, FromPosition, BrokenOff]);
        assert!(!state.position_kept());
    }
}
