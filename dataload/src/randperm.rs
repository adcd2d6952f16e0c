//! `torch.randperm(n, generator=g)` on the CPU, bit for bit.
//!
//! torch has two algorithms and picks one by `n` (see `randperm_cpu` in torch's
//! `TensorFactories.cpp`):
//!
//! * [`RandpermAlgorithm::Classic`]: a forward Fisher–Yates. For `i` in `0..n-1` it draws one
//!   32-bit value, takes it modulo `n - i` (plain modulo, torch accepts the bias) and swaps
//!   positions `i` and `i + z`. This is every `n` on torch ≤ 2.5 and `n < 214_748_364` after.
//! * [`RandpermAlgorithm::InsideOut`]: from torch 2.6, for `n ≥ u32::MAX / 20`, an
//!   "inside-out" shuffle with 64-bit draws: for each `i`, `z = draw64 % (i + 1)`,
//!   `r[i] = r[z]; r[z] = i`. The switch exists because the 32-bit modulo is too biased for
//!   huge `n`; it changed the permutations of datasets of ≥ 214.7 M samples.
//!
//! `n ≤ 1` consumes no draws in either algorithm.
//!
//! Permutations of up to 2^32 elements are stored as `u32` to halve the memory of very large
//! datasets (a 10^9-sample permutation is then 4 GB instead of 8).

use serde::{Deserialize, Serialize};

use crate::error::{DataloadError, Result};
use crate::torch_rng::TorchGenerator;

/// Smallest `n` for which torch ≥ 2.6 switches to the inside-out algorithm
/// (`u32::MAX / 20` in integer division).
pub(crate) const INSIDE_OUT_THRESHOLD: u64 = (u32::MAX / 20) as u64;

/// Which torch the permutations must equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TorchVersion {
    /// torch 2.6 and later (2.13 included): the algorithm switch at `n ≥ u32::MAX / 20`.
    #[default]
    Torch2_6Plus,
    /// torch 2.5 and earlier: the classic algorithm for every `n`.
    Torch2_5OrOlder,
}

/// One of torch's two CPU `randperm` algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RandpermAlgorithm {
    /// Forward Fisher–Yates with 32-bit draws.
    Classic,
    /// Inside-out shuffle with 64-bit draws.
    InsideOut,
}

impl RandpermAlgorithm {
    /// The algorithm `torch.randperm(n)` uses on the given torch.
    pub fn for_len(n: u64, torch: TorchVersion) -> Self {
        match torch {
            TorchVersion::Torch2_6Plus if n >= INSIDE_OUT_THRESHOLD => Self::InsideOut,
            _ => Self::Classic,
        }
    }
}

/// A permutation of `0..n`.
#[derive(Clone, PartialEq, Eq)]
pub struct Permutation(Storage);

#[derive(Clone, PartialEq, Eq)]
enum Storage {
    Narrow(Vec<u32>),
    Wide(Vec<u64>),
}

impl std::fmt::Debug for Permutation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permutation").field("len", &self.len()).finish_non_exhaustive()
    }
}

impl Permutation {
    /// Number of elements.
    pub fn len(&self) -> u64 {
        match &self.0 {
            Storage::Narrow(v) => v.len() as u64,
            Storage::Wide(v) => v.len() as u64,
        }
    }

    /// Whether the permutation is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element at position `i`, if `i < len()`.
    #[inline]
    pub fn get(&self, i: u64) -> Option<u64> {
        let i = usize::try_from(i).ok()?;
        match &self.0 {
            Storage::Narrow(v) => v.get(i).map(|&x| u64::from(x)),
            Storage::Wide(v) => v.get(i).copied(),
        }
    }

    /// All elements, in order.
    pub fn to_vec(&self) -> Vec<u64> {
        match &self.0 {
            Storage::Narrow(v) => v.iter().map(|&x| u64::from(x)).collect(),
            Storage::Wide(v) => v.clone(),
        }
    }
}

trait Slot: Copy {
    fn from_u64(v: u64) -> Self;
}

impl Slot for u32 {
    #[inline]
    fn from_u64(v: u64) -> Self {
        // Only used when every index fits in 32 bits (checked by the caller).
        v as u32
    }
}

impl Slot for u64 {
    #[inline]
    fn from_u64(v: u64) -> Self {
        v
    }
}

/// How many 32-bit draws `torch.randperm(n)` takes from its generator: `n - 1` (classic) or
/// `2n` (inside-out, two per 64-bit draw), none for `n ≤ 1`.
pub(crate) fn randperm_draws(n: u64, torch: TorchVersion) -> u64 {
    if n < 2 {
        return 0;
    }
    match RandpermAlgorithm::for_len(n, torch) {
        RandpermAlgorithm::Classic => n - 1,
        RandpermAlgorithm::InsideOut => n.saturating_mul(2),
    }
}

/// `torch.randperm(n, generator=gen)` with the algorithm the given torch picks.
pub fn randperm(n: u64, gen: &mut TorchGenerator, torch: TorchVersion) -> Result<Permutation> {
    randperm_with(n, gen, RandpermAlgorithm::for_len(n, torch))
}

/// `randperm` with an explicit algorithm (for tests and for reproducing other torch versions).
pub fn randperm_with(n: u64, gen: &mut TorchGenerator, algorithm: RandpermAlgorithm) -> Result<Permutation> {
    let len = usize::try_from(n).map_err(|_| DataloadError::TooLarge { len: n })?;
    if n <= 1u64 << 32 {
        let mut v: Vec<u32> = alloc(len, n)?;
        fill(&mut v, n, gen, algorithm);
        Ok(Permutation(Storage::Narrow(v)))
    } else {
        let mut v: Vec<u64> = alloc(len, n)?;
        fill(&mut v, n, gen, algorithm);
        Ok(Permutation(Storage::Wide(v)))
    }
}

fn alloc<T>(len: usize, n: u64) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| DataloadError::TooLarge { len: n })?;
    Ok(v)
}

fn fill<T: Slot>(v: &mut Vec<T>, n: u64, gen: &mut TorchGenerator, algorithm: RandpermAlgorithm) {
    match algorithm {
        RandpermAlgorithm::Classic => {
            v.extend((0..n).map(T::from_u64));
            if n < 2 {
                return;
            }
            for i in 0..(n - 1) {
                let z = u64::from(gen.next_u32()) % (n - i);
                // Both indices are < n, which fits in usize (checked by the caller).
                v.swap(i as usize, (i + z) as usize);
            }
        }
        RandpermAlgorithm::InsideOut => {
            if n < 2 {
                v.extend((0..n).map(T::from_u64));
                return;
            }
            for i in 0..n {
                let z = gen.next_u64() % (i + 1);
                // `r[i] = r[z]` reads the slot before it is written when z == i; pushing a
                // placeholder first and then overwriting reproduces torch, whose buffer slot i
                // ends up holding i in that case.
                v.push(T::from_u64(i));
                let (iu, zu) = (i as usize, z as usize);
                v[iu] = v[zu];
                v[zu] = T::from_u64(i);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn is_perm(p: &Permutation) -> bool {
        let mut v = p.to_vec();
        v.sort_unstable();
        v.iter().enumerate().all(|(i, &x)| i as u64 == x)
    }

    #[test]
    fn both_algorithms_give_permutations() {
        for n in [0u64, 1, 2, 3, 10, 1000] {
            for algo in [RandpermAlgorithm::Classic, RandpermAlgorithm::InsideOut] {
                let p = randperm_with(n, &mut TorchGenerator::manual_seed(n), algo).unwrap();
                assert_eq!(p.len(), n);
                assert!(is_perm(&p), "n={n} {algo:?}");
            }
        }
    }

    #[test]
    fn draw_counts_are_what_randperm_takes() {
        for n in [0u64, 1, 2, 3, 700, 1500] {
            let mut a = TorchGenerator::manual_seed(n);
            let mut b = a.clone();
            randperm(n, &mut a, TorchVersion::default()).unwrap();
            b.discard(randperm_draws(n, TorchVersion::default()));
            assert_eq!(a, b, "n = {n}");
        }
    }

    #[test]
    fn tiny_n_draws_nothing() {
        for algo in [RandpermAlgorithm::Classic, RandpermAlgorithm::InsideOut] {
            let mut g = TorchGenerator::manual_seed(3);
            randperm_with(1, &mut g, algo).unwrap();
            assert_eq!(g.next_u32(), TorchGenerator::manual_seed(3).next_u32());
        }
    }

    #[test]
    fn threshold_picks_the_algorithm() {
        let t = TorchVersion::Torch2_6Plus;
        assert_eq!(RandpermAlgorithm::for_len(214_748_363, t), RandpermAlgorithm::Classic);
        assert_eq!(RandpermAlgorithm::for_len(214_748_364, t), RandpermAlgorithm::InsideOut);
        assert_eq!(RandpermAlgorithm::for_len(214_748_364, TorchVersion::Torch2_5OrOlder), RandpermAlgorithm::Classic);
    }
}
