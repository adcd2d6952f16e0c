//! torch's CPU random generator: a 32-bit Mersenne Twister (MT19937).
//!
//! `torch.Generator().manual_seed(s)` keeps the full 64-bit seed for `initial_seed()` but feeds
//! only its low 32 bits to the classic `init_genrand` seeding, so `s` and `s + 2^32` give the
//! same stream. 64-bit draws take two 32-bit draws, the first one being the high half
//! (torch's `CPUGeneratorImpl::random64`). Reproducing exactly this is what lets our
//! permutations equal `torch.randperm` bit for bit.

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_B0DF;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7FFF_FFFF;

/// A torch CPU generator after `manual_seed(seed)`.
#[derive(Clone)]
pub struct TorchGenerator {
    seed: u64,
    state: Box<[u32; N]>,
    /// Index of the next word to temper; `N` means "twist before the next draw".
    next: usize,
}

impl std::fmt::Debug for TorchGenerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchGenerator").field("seed", &self.seed).field("next", &self.next).finish_non_exhaustive()
    }
}

impl TorchGenerator {
    /// Same as `torch.Generator().manual_seed(seed)`. Negative Python seeds are their
    /// two's complement (`manual_seed(-1)` is `manual_seed(2**64 - 1)`).
    pub fn manual_seed(seed: u64) -> Self {
        let mut state = Box::new([0u32; N]);
        // Truncation is the point: torch seeds the engine with the low 32 bits only.
        state[0] = seed as u32;
        for j in 1..N {
            let prev = state[j - 1];
            state[j] = 1_812_433_253u32.wrapping_mul(prev ^ (prev >> 30)).wrapping_add(j as u32);
        }
        // torch starts with `left = 1`, so the very first draw twists: same as `next = N`.
        Self { seed, state, next: N }
    }

    /// The seed given to [`TorchGenerator::manual_seed`] (torch's `initial_seed()`).
    pub fn initial_seed(&self) -> u64 {
        self.seed
    }

    fn twist(&mut self) {
        let mt = &mut self.state;
        for k in 0..N {
            let y = (mt[k] & UPPER_MASK) | (mt[(k + 1) % N] & LOWER_MASK);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            mt[k] = mt[(k + M) % N] ^ (y >> 1) ^ mag;
        }
        self.next = 0;
    }

    /// One 32-bit draw (torch's `random()`).
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        if self.next >= N {
            self.twist();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9D2C_5680;
        y ^= (y << 15) & 0xEFC6_0000;
        y ^= y >> 18;
        y
    }

    /// One 64-bit draw (torch's `random64()`): high half first.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let hi = u64::from(self.next_u32());
        let lo = u64::from(self.next_u32());
        (hi << 32) | lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Published reference outputs of MT19937 (Matsumoto & Nishimura's `mt19937ar.out` uses
    // `init_by_array`, but the seed-5489 default stream of `init_genrand` is the one every
    // implementation documents: its first output is 3499211612).
    #[test]
    fn default_seed_matches_reference_stream() {
        let mut g = TorchGenerator::manual_seed(5489);
        assert_eq!(g.next_u32(), 3_499_211_612);
    }

    #[test]
    fn only_low_32_bits_seed_the_engine() {
        let mut a = TorchGenerator::manual_seed(42);
        let mut b = TorchGenerator::manual_seed(42 + (1u64 << 32));
        for _ in 0..2000 {
            assert_eq!(a.next_u32(), b.next_u32());
        }
        assert_eq!(b.initial_seed(), 42 + (1u64 << 32));
    }

    #[test]
    fn u64_is_two_u32_high_first() {
        let mut a = TorchGenerator::manual_seed(7);
        let mut b = TorchGenerator::manual_seed(7);
        let hi = u64::from(b.next_u32());
        let lo = u64::from(b.next_u32());
        assert_eq!(a.next_u64(), (hi << 32) | lo);
    }
}
