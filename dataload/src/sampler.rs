//! Index samplers: the order of one epoch, before any sharding.
//!
//! * [`SequentialSampler`]: `0..n`, torch's `SequentialSampler`.
//! * [`SeedableRandomSampler`]: accelerate's `SeedableRandomSampler` without replacement. At the
//!   start of every epoch it re-seeds its generator with `initial_seed + epoch` and draws
//!   `torch.randperm(n)`; re-seeding makes the order a pure function of `(n, seed, epoch)`, which
//!   is what lets every rank, and every resumed run, agree without communicating.

use std::sync::Arc;

use crate::error::{DataloadError, Result};
use crate::randperm::{randperm, Permutation, TorchVersion};
use crate::torch_rng::TorchGenerator;

/// Smallest seed torch's `manual_seed` accepts (`-2^63`).
pub const MIN_SEED: i128 = i64::MIN as i128;
/// Largest seed torch's `manual_seed` accepts (`2^64 - 1`).
pub const MAX_SEED: i128 = u64::MAX as i128;

/// The order of one epoch: position → dataset index.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EpochOrder {
    /// `0..len`.
    Sequential {
        /// Dataset length.
        len: u64,
    },
    /// A torch permutation, shared so cloning a loader does not copy it.
    Shuffled(Arc<Permutation>),
}

impl EpochOrder {
    /// Number of positions.
    pub fn len(&self) -> u64 {
        match self {
            Self::Sequential { len } => *len,
            Self::Shuffled(p) => p.len(),
        }
    }

    /// Whether the order is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Dataset index at `position`, if `position < len()`.
    #[inline]
    pub fn get(&self, position: u64) -> Option<u64> {
        match self {
            Self::Sequential { len } => (position < *len).then_some(position),
            Self::Shuffled(p) => p.get(position),
        }
    }

    /// Indices at `start..end` (clipped to the length).
    pub fn range(&self, start: u64, end: u64) -> Vec<u64> {
        let end = end.min(self.len());
        (start..end).filter_map(|i| self.get(i)).collect()
    }
}

/// Something that orders a dataset, epoch by epoch.
pub trait IndexSampler {
    /// Number of indices one epoch yields.
    fn len(&self) -> u64;
    /// Whether an epoch yields nothing.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The order of `epoch`.
    fn order(&self, epoch: u64) -> Result<EpochOrder>;
}

/// torch's `SequentialSampler`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequentialSampler {
    len: u64,
}

impl SequentialSampler {
    /// Sampler over `0..len`.
    pub fn new(len: u64) -> Self {
        Self { len }
    }
}

impl IndexSampler for SequentialSampler {
    fn len(&self) -> u64 {
        self.len
    }

    fn order(&self, _epoch: u64) -> Result<EpochOrder> {
        Ok(EpochOrder::Sequential { len: self.len })
    }
}

/// accelerate's `SeedableRandomSampler` (`replacement = False`, `num_samples = len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeedableRandomSampler {
    len: u64,
    initial_seed: i128,
    torch: TorchVersion,
}

impl SeedableRandomSampler {
    /// `initial_seed` is accelerate's `data_seed`, or `torch.initial_seed()` when that is
    /// unset. It may be any value Python's `manual_seed` accepts, negatives included.
    pub fn new(len: u64, initial_seed: i128, torch: TorchVersion) -> Result<Self> {
        check_seed(initial_seed)?;
        Ok(Self { len, initial_seed, torch })
    }

    /// The seed of epoch 0.
    pub fn initial_seed(&self) -> i128 {
        self.initial_seed
    }

    /// The value handed to `manual_seed` for `epoch`, as torch's u64.
    pub fn epoch_seed(&self, epoch: u64) -> Result<u64> {
        epoch_seed(self.initial_seed, epoch)
    }
}

impl IndexSampler for SeedableRandomSampler {
    fn len(&self) -> u64 {
        self.len
    }

    fn order(&self, epoch: u64) -> Result<EpochOrder> {
        let mut gen = TorchGenerator::manual_seed(self.epoch_seed(epoch)?);
        Ok(EpochOrder::Shuffled(Arc::new(randperm(self.len, &mut gen, self.torch)?)))
    }
}

pub(crate) fn check_seed(seed: i128) -> Result<()> {
    if (MIN_SEED..=MAX_SEED).contains(&seed) {
        Ok(())
    } else {
        Err(DataloadError::SeedOutOfRange { seed })
    }
}

/// Python computes `initial_seed + epoch` with unbounded integers and torch then refuses
/// anything ≥ 2^64; negative sums are reinterpreted as two's complement.
fn epoch_seed(seed: i128, epoch: u64) -> Result<u64> {
    let sum = seed + i128::from(epoch);
    if sum > MAX_SEED {
        return Err(DataloadError::SeedOverflow { seed, epoch });
    }
    // `sum` is in [-2^63, 2^64): the low 64 bits are torch's u64 seed in both signs.
    Ok(sum as u64)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn negative_seeds_wrap_like_python() {
        let s = SeedableRandomSampler::new(5, -5, TorchVersion::default()).unwrap();
        assert_eq!(s.epoch_seed(3).unwrap(), u64::MAX - 1);
        assert_eq!(s.epoch_seed(5).unwrap(), 0);
    }

    #[test]
    fn seed_overflow_is_refused() {
        let s = SeedableRandomSampler::new(5, MAX_SEED, TorchVersion::default()).unwrap();
        assert_eq!(s.epoch_seed(0).unwrap(), u64::MAX);
        assert_eq!(
            s.epoch_seed(1).unwrap_err().to_string(),
            "seed 18446744073709551615 + epoch 1 overflows the 64 bits torch's `manual_seed` accepts"
        );
        assert!(SeedableRandomSampler::new(5, MAX_SEED + 1, TorchVersion::default()).is_err());
        assert!(SeedableRandomSampler::new(5, MIN_SEED - 1, TorchVersion::default()).is_err());
    }

    #[test]
    fn sequential_order_is_identity() {
        let o = SequentialSampler::new(4).order(9).unwrap();
        assert_eq!(o.range(0, 10), vec![0, 1, 2, 3]);
        assert_eq!(o.get(4), None);
    }
}

/// Seeds are Python ints in `[-2^63, 2^64)`: written as JSON integers (i64 when negative,
/// u64 otherwise) because serde's buffering of tagged enums has no 128-bit integers.
pub(crate) mod seed_serde {
    use serde::{de, Deserializer, Serializer};

    use super::{MAX_SEED, MIN_SEED};

    pub(crate) fn serialize<S: Serializer>(seed: &i128, s: S) -> Result<S::Ok, S::Error> {
        if let Ok(v) = i64::try_from(*seed) {
            s.serialize_i64(v)
        } else if let Ok(v) = u64::try_from(*seed) {
            s.serialize_u64(v)
        } else {
            Err(serde::ser::Error::custom(format!("seed {seed} is out of the range torch accepts")))
        }
    }

    struct SeedVisitor;

    impl de::Visitor<'_> for SeedVisitor {
        type Value = i128;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an integer seed in [-2^63, 2^64)")
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<i128, E> {
            Ok(i128::from(v))
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<i128, E> {
            Ok(i128::from(v))
        }

        fn visit_i128<E: de::Error>(self, v: i128) -> Result<i128, E> {
            if (MIN_SEED..=MAX_SEED).contains(&v) {
                Ok(v)
            } else {
                Err(E::custom(format!("seed {v} is out of the range torch accepts")))
            }
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i128, D::Error> {
        d.deserialize_any(SeedVisitor)
    }

    pub(crate) mod option {
        use serde::{Deserialize, Deserializer, Serializer};

        pub(crate) fn serialize<S: Serializer>(seed: &Option<i128>, s: S) -> Result<S::Ok, S::Error> {
            match seed {
                Some(v) => super::serialize(v, s),
                None => s.serialize_none(),
            }
        }

        #[derive(Deserialize)]
        struct Wrapped(#[serde(deserialize_with = "super::deserialize")] i128);

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i128>, D::Error> {
            Ok(Option::<Wrapped>::deserialize(d)?.map(|w| w.0))
        }
    }
}
