//! torch's CPU random generator: a 32-bit Mersenne Twister (MT19937), state included.
//!
//! `torch.Generator().manual_seed(s)` keeps the full 64-bit seed for `initial_seed()` but feeds
//! only its low 32 bits to the classic `init_genrand` seeding, so `s` and `s + 2^32` give the
//! same stream. 64-bit draws take two 32-bit draws, the first one being the high half
//! (torch's `CPUGeneratorImpl::random64`). Reproducing exactly this is what lets our
//! permutations equal `torch.randperm` bit for bit.
//!
//! A generator is also what `torch.Generator.get_state()` returns, so that an order drawn from a
//! generator's *running* state (torch's `RandomSampler` with the generator accelerate gives it)
//! can be reproduced and resumed. That state is a byte tensor of [`STATE_BYTES`] bytes, torch's
//! legacy layout, little-endian on every platform torch ships:
//!
//! | offset | field |
//! |---|---|
//! | 0 | initial seed, `u64` |
//! | 8 | `left`, `i32`: draws left before the next twist, plus one (1 right after seeding) |
//! | 12 | `seeded`, `i32` (1) |
//! | 16 | `next`, `u64`: index of the next word to temper |
//! | 24 | the 624 state words, each stored as a `u64` (torch keeps the low 32 bits) |
//! | 5016, 5024, 5032 | `normal_x`, `normal_y`, `normal_rho`, `f64` (only `normal_y` is used: the cached double normal sample) |
//! | 5040 | `normal_is_valid`, `i32` |
//! | 5048 | the cached float normal sample, `f32` |
//! | 5052 | whether it is valid, one byte; then 3 bytes of padding |
//!
//! A draw decrements `left` and twists when it reaches 0 (then `left = 624`, `next = 0`), then
//! tempers word `next` and increments it. torch accepts any state with `seeded`, `1 ≤ left ≤
//! 624` and `next ≤ 624`; one whose `left` lets `next` run past the last word before the next
//! twist would read out of bounds in torch, and is refused here.

use crate::error::{DataloadError, Result};

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_B0DF;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7FFF_FFFF;

/// Size of torch's CPU generator state (`torch.Generator().get_state().numel()`).
pub const STATE_BYTES: usize = 5056;

const OFF_LEFT: usize = 8;
const OFF_SEEDED: usize = 12;
const OFF_NEXT: usize = 16;
const OFF_WORDS: usize = 24;
const OFF_NORMAL_Y: usize = 5024;
const OFF_NORMAL_VALID: usize = 5040;
const OFF_FLOAT: usize = 5048;
const OFF_FLOAT_VALID: usize = 5052;

/// A torch CPU generator: its Mersenne Twister and the normal samples it has cached.
#[derive(Clone, PartialEq, Eq)]
pub struct TorchGenerator {
    seed: u64,
    state: Box<[u32; N]>,
    /// torch's `left`: the draw that brings it to 0 twists first.
    left: u32,
    /// Index of the next word to temper.
    next: u32,
    /// `next_double_normal_sample_` (its bits), carried so a state written back is the one read.
    normal_double: Option<u64>,
    /// `next_float_normal_sample_` (its bits).
    normal_float: Option<u32>,
}

impl std::fmt::Debug for TorchGenerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchGenerator")
            .field("seed", &self.seed)
            .field("left", &self.left)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

fn bad_state(reason: &'static str, len: usize) -> DataloadError {
    DataloadError::InvalidValue { field: "generator", value: format!("a state of {len} bytes"), reason }
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn read_i32(b: &[u8], at: usize) -> i32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    i32::from_le_bytes(w)
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
        Self { seed, state, left: 1, next: 0, normal_double: None, normal_float: None }
    }

    /// The generator whose `get_state()` is `bytes`, refused (naming why) where torch's
    /// `set_state` would refuse it or where drawing from it would read past the state.
    pub fn from_state_bytes(bytes: &[u8]) -> Result<Self> {
        let len = bytes.len();
        if len != STATE_BYTES {
            return Err(bad_state("torch's CPU generator state is 5056 bytes", len));
        }
        let left = read_i32(bytes, OFF_LEFT);
        let seeded = read_i32(bytes, OFF_SEEDED);
        let next = read_u64(bytes, OFF_NEXT);
        if seeded == 0 {
            return Err(bad_state("the state is not seeded (torch refuses it)", len));
        }
        if !(1..=N as i32).contains(&left) || next > N as u64 {
            return Err(bad_state("`left` must be in 1..=624 and `next` at most 624 (torch refuses it)", len));
        }
        // Both fit in u32 now.
        let (left, next) = (left as u32, next as u32);
        if left > 1 && next + left - 1 > N as u32 {
            return Err(bad_state("`next` would run past the last state word before the next twist", len));
        }
        let mut state = Box::new([0u32; N]);
        for (j, w) in state.iter_mut().enumerate() {
            // torch copies each stored u64 into a u32 word: the low half.
            *w = read_u64(bytes, OFF_WORDS + 8 * j) as u32;
        }
        let normal_double = (read_i32(bytes, OFF_NORMAL_VALID) != 0).then(|| read_u64(bytes, OFF_NORMAL_Y));
        let normal_float = (bytes[OFF_FLOAT_VALID] != 0).then(|| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&bytes[OFF_FLOAT..OFF_FLOAT + 4]);
            u32::from_le_bytes(w)
        });
        Ok(Self { seed: read_u64(bytes, 0), state, left, next, normal_double, normal_float })
    }

    /// `get_state()`: the bytes torch writes for this generator (unused fields and padding 0).
    pub fn state_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; STATE_BYTES];
        b[0..8].copy_from_slice(&self.seed.to_le_bytes());
        b[OFF_LEFT..OFF_LEFT + 4].copy_from_slice(&self.left.to_le_bytes());
        b[OFF_SEEDED..OFF_SEEDED + 4].copy_from_slice(&1i32.to_le_bytes());
        b[OFF_NEXT..OFF_NEXT + 8].copy_from_slice(&u64::from(self.next).to_le_bytes());
        for (j, w) in self.state.iter().enumerate() {
            b[OFF_WORDS + 8 * j..OFF_WORDS + 8 * j + 8].copy_from_slice(&u64::from(*w).to_le_bytes());
        }
        if let Some(y) = self.normal_double {
            b[OFF_NORMAL_Y..OFF_NORMAL_Y + 8].copy_from_slice(&y.to_le_bytes());
            b[OFF_NORMAL_VALID..OFF_NORMAL_VALID + 4].copy_from_slice(&1i32.to_le_bytes());
        }
        if let Some(x) = self.normal_float {
            b[OFF_FLOAT..OFF_FLOAT + 4].copy_from_slice(&x.to_le_bytes());
            b[OFF_FLOAT_VALID] = 1;
        }
        b
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
        self.left = N as u32;
        self.next = 0;
    }

    /// One 32-bit draw (torch's `random()`).
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        self.left -= 1;
        if self.left == 0 {
            self.twist();
        }
        // In bounds: `from_state_bytes` refuses states where `next` would pass N - 1 before
        // `left` reaches 0, and a twist restarts at 0.
        let mut y = self.state[self.next as usize];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9D2C_5680;
        y ^= (y << 15) & 0xEFC6_0000;
        y ^= y >> 18;
        y
    }

    /// Advances the generator as `k` 32-bit draws would, without tempering them: a twist
    /// every 624 draws, nothing else.
    pub fn discard(&mut self, mut k: u64) {
        while k > 0 {
            // Draws before the one that twists.
            let free = u64::from(self.left - 1);
            if k <= free {
                // Both fit: k is at most `left - 1` < 624.
                self.left -= k as u32;
                self.next += k as u32;
                return;
            }
            k -= free + 1;
            self.twist();
            self.next = 1;
        }
    }

    /// One 64-bit draw (torch's `random64()`): high half first.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let hi = u64::from(self.next_u32());
        let lo = u64::from(self.next_u32());
        (hi << 32) | lo
    }
}

/// A generator in a saved state: torch's `get_state()` bytes as lowercase hex, so the JSON
/// holds exactly what `Generator.set_state` takes back.
pub(crate) mod hex_serde {
    use serde::{de, Deserialize, Deserializer, Serializer};

    use super::{TorchGenerator, STATE_BYTES};

    pub(crate) fn serialize<S: Serializer>(g: &TorchGenerator, s: S) -> Result<S::Ok, S::Error> {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let bytes = g.state_bytes();
        let mut text = String::with_capacity(2 * bytes.len());
        for b in bytes {
            text.push(char::from(DIGITS[usize::from(b >> 4)]));
            text.push(char::from(DIGITS[usize::from(b & 15)]));
        }
        s.serialize_str(&text)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TorchGenerator, D::Error> {
        let text = String::deserialize(d)?;
        if text.len() != 2 * STATE_BYTES {
            return Err(de::Error::custom(format!(
                "`generator` must be {} hex digits (torch's {STATE_BYTES}-byte state), not {}",
                2 * STATE_BYTES,
                text.len()
            )));
        }
        let digit = |c: u8| match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            _ => Err(de::Error::custom("`generator` holds a character that is not a lowercase hex digit")),
        };
        let bytes = text
            .as_bytes()
            .chunks_exact(2)
            .map(|p| Ok((digit(p[0])? << 4) | digit(p[1])?))
            .collect::<Result<Vec<u8>, D::Error>>()?;
        TorchGenerator::from_state_bytes(&bytes).map_err(de::Error::custom)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
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

    #[test]
    fn discarding_equals_drawing() {
        for (warm, k) in [(0u64, 0u64), (0, 1), (0, 623), (0, 624), (0, 625), (5, 2000), (623, 1), (100, 1248)] {
            let mut a = TorchGenerator::manual_seed(99);
            a.discard(warm);
            let mut b = a.clone();
            a.discard(k);
            for _ in 0..k {
                b.next_u32();
            }
            assert_eq!(a, b, "warm {warm}, k {k}");
        }
    }

    #[test]
    fn a_state_continues_the_stream_it_was_taken_from() {
        let mut g = TorchGenerator::manual_seed(11);
        for k in [0usize, 1, 623, 624, 625, 1300] {
            let mut a = g.clone();
            let mut b = TorchGenerator::from_state_bytes(&a.state_bytes()).unwrap();
            assert_eq!(b, a, "after {k} draws");
            for _ in 0..700 {
                assert_eq!(a.next_u32(), b.next_u32());
            }
            for _ in 0..k {
                g.next_u32();
            }
        }
    }

    #[test]
    fn states_torch_refuses_or_that_read_past_the_words_are_refused() {
        let good = TorchGenerator::manual_seed(3).state_bytes();
        let with = |at: usize, v: &[u8]| {
            let mut b = good.clone();
            b[at..at + v.len()].copy_from_slice(v);
            TorchGenerator::from_state_bytes(&b).unwrap_err().to_string()
        };
        assert_eq!(
            TorchGenerator::from_state_bytes(&good[..100]).unwrap_err().to_string(),
            "invalid `generator`: a state of 100 bytes (torch's CPU generator state is 5056 bytes)"
        );
        assert!(with(OFF_LEFT, &0i32.to_le_bytes()).contains("`left` must be in 1..=624"));
        assert!(with(OFF_NEXT, &625u64.to_le_bytes()).contains("`left` must be in 1..=624"));
        assert!(with(OFF_SEEDED, &0i32.to_le_bytes()).contains("not seeded"));
        // left = 624 with next = 624: torch would temper word 624 of 624.
        let mut b = good.clone();
        b[OFF_LEFT..OFF_LEFT + 4].copy_from_slice(&624i32.to_le_bytes());
        b[OFF_NEXT..OFF_NEXT + 8].copy_from_slice(&624u64.to_le_bytes());
        assert!(TorchGenerator::from_state_bytes(&b).unwrap_err().to_string().contains("run past"));
    }
}
