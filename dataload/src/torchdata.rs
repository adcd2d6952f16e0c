//! A [`LoaderState`] in torchdata's words, and back.
//!
//! torchdata's `StatefulDataLoader` records a one-process position of its own `BatchSampler`
//! as `samples_yielded` (samples of the epoch's order handed out) and, for a `RandomSampler`
//! drawing from a generator, the generator state the epoch's permutation was drawn from. Where
//! those say the whole position (one process; sequential, or shuffled from a generator whose
//! epoch is drawn) statekit saves them instead of its own state, so a torchdata or accelerate
//! run can read it; and a record torchdata wrote loads into a statekit loader with the
//! loader's own settings. The Python package moves the values between these types and
//! torchdata's dicts and tensors.

use crate::error::{DataloadError, Result};
use crate::state::{EpochGenerator, LoaderState, SamplerSpec};
use crate::torch_rng::TorchGenerator;

/// A one-process position as torchdata's `BatchSampler` iterator records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchdataPosition {
    /// Samples of the current epoch's order handed out (`samples_yielded`).
    pub samples_yielded: u64,
    /// The generator the epoch's permutation was drawn from (the `RandomSampler` iterator's
    /// `generator`); `None` for a sequential sampler.
    pub generator: Option<TorchGenerator>,
}

impl LoaderState {
    /// This position in torchdata's words, or `None` where they do not say it all: more than
    /// one process (the world size is not in them), the seedable sampler (nor its seed and
    /// epoch), an epoch not drawn yet.
    pub fn to_torchdata(&self) -> Option<TorchdataPosition> {
        if self.world_size != 1 {
            return None;
        }
        let generator = match self.sampler {
            SamplerSpec::Sequential => None,
            SamplerSpec::Random => Some(self.generator.as_ref().filter(|g| g.drawn)?.state.clone()),
            SamplerSpec::SeedableRandom { .. } => return None,
        };
        Some(TorchdataPosition { samples_yielded: self.cursor, generator })
    }

    /// The state of a loader with this state's settings at the position torchdata recorded:
    /// one process, the epoch this state is in (torchdata's record has none). Refused when the
    /// record's order is not this loader's (a generator for a loader that does not shuffle
    /// from one, or none for one that does).
    pub fn with_torchdata(&self, position: TorchdataPosition) -> Result<LoaderState> {
        let random = self.sampler == SamplerSpec::Random;
        if random != position.generator.is_some() {
            let saved = if position.generator.is_some() { "a RandomSampler's generator" } else { "no generator" };
            let current = match self.sampler {
                SamplerSpec::Random => "a shuffle drawn from a generator",
                SamplerSpec::Sequential => "the sequential sampler",
                SamplerSpec::SeedableRandom { .. } => "the seedable_random sampler",
            };
            return Err(DataloadError::TorchdataMismatch { saved, current });
        }
        let mut out = self.clone();
        out.cursor = position.samples_yielded;
        out.padding_origin = 0;
        out.world_size = 1;
        if let Some(state) = position.generator {
            out.generator = Some(EpochGenerator { state, drawn: true });
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::{DataLoaderConfiguration, ShardedSampler};

    fn state(world: u64, shuffle: bool, generator: Option<TorchGenerator>) -> LoaderState {
        let mut b = ShardedSampler::builder()
            .dataset_len(48)
            .batch_size(4)
            .world_size(world)
            .rank(0)
            .shuffle(shuffle)
            .config(DataLoaderConfiguration { use_seedable_sampler: generator.is_none(), ..Default::default() });
        if shuffle && generator.is_none() {
            b = b.torch_initial_seed(7);
        }
        if let Some(g) = generator {
            b = b.generator(g);
        }
        let mut s = b.build().unwrap();
        for _ in 0..4 {
            s.next_batch().unwrap();
        }
        s.state_dict()
    }

    #[test]
    fn one_sequential_process_is_samples_yielded() {
        // test_accelerate_torchdata_state: 4 batches of 4 read, `samples_yielded` 16
        let pos = state(1, false, None).to_torchdata().unwrap();
        assert_eq!(pos, TorchdataPosition { samples_yielded: 16, generator: None });
    }

    #[test]
    fn a_drawn_shuffle_records_the_generator_it_was_drawn_from() {
        let g = TorchGenerator::manual_seed(3);
        let pos = state(1, true, Some(g.clone())).to_torchdata().unwrap();
        assert_eq!(pos, TorchdataPosition { samples_yielded: 16, generator: Some(g) });
    }

    #[test]
    fn what_torchdata_cannot_say_stays_statekits() {
        assert_eq!(state(2, false, None).to_torchdata(), None);
        assert_eq!(state(1, true, None).to_torchdata(), None);
        let mut undrawn = state(1, true, Some(TorchGenerator::manual_seed(3)));
        undrawn.generator.as_mut().unwrap().drawn = false;
        assert_eq!(undrawn.to_torchdata(), None);
    }

    #[test]
    fn a_record_round_trips_into_the_loaders_settings() {
        let mine = state(2, true, Some(TorchGenerator::manual_seed(3)));
        let g = TorchGenerator::manual_seed(9);
        let pos = TorchdataPosition { samples_yielded: 12, generator: Some(g.clone()) };
        let back = mine.with_torchdata(pos.clone()).unwrap();
        assert_eq!((back.cursor, back.world_size, back.padding_origin), (12, 1, 0));
        assert_eq!(back.generator, Some(EpochGenerator { state: g, drawn: true }));
        assert_eq!(back.to_torchdata(), Some(pos));
    }

    #[test]
    fn a_record_of_another_order_is_refused_by_name() {
        let g = TorchGenerator::manual_seed(3);
        let err = state(1, false, None)
            .with_torchdata(TorchdataPosition { samples_yielded: 0, generator: Some(g.clone()) })
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the torchdata state holds a RandomSampler's generator, this loader's order is the sequential sampler"
        );
        let err = state(1, true, Some(g)).with_torchdata(TorchdataPosition { samples_yielded: 0, generator: None });
        assert_eq!(
            err.unwrap_err().to_string(),
            "the torchdata state holds no generator, this loader's order is a shuffle drawn from a generator"
        );
    }
}
