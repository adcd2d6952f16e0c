//! Weighted mixtures of sources: one global order over many datasets, a pure function of
//! (definition, position), so a mixture resumes in O(1) at any position on any world size.
//!
//! # The order
//!
//! A [`MixtureSpec`] names each source's length, the weights, a seed, which sources are read
//! `once` (the others repeat), the mixture's length, and weight changes at given positions
//! (a curriculum). [`Mixture::new`] compiles it into **segments**: stretches of the global order
//! over which the set of sources and their weights are fixed. A segment ends where a weight
//! change is asked for or where a `once` source has given its last sample (it then leaves the
//! mixture and the others' weights are renormalized). Segments are computed when the mixture
//! is built, one per event, never per sample.
//!
//! Within a segment the weights are integers `m_i` out of `M` (the given floats quantized to
//! 2^32ths of their sum), and positions are cut into **blocks** of `B` samples (`B` a power of
//! two with `B·m_i ≥ M` for every source, at least 64). After `x` samples of the segment (`x` a
//! multiple of `B`), source `i` has given `⌊x·m_i/M⌋` samples, plus one for the sources with the
//! largest remainders until the counts add up to `x` (the largest-remainder method). So over
//! every prefix a source's count is within one block's share of `x·m_i/M`, and block `b` holds
//! each source's quota, the difference of two such counts, exactly. Which position of the block
//! gets which quota slot is a keyed permutation of the block (a Feistel network on its bits), so
//! the sources are interleaved at random, by the seed, with no index array anywhere.
//!
//! Within a source, its `t`-th sample overall is position `t mod n` of its own keyed
//! permutation of `0..n` (cycle-walking Feistel) for pass `⌊t/n⌋`: a repeated source is
//! reshuffled each time it runs out; a `once` source has one pass.
//!
//! [`Mixture::locate`] is therefore O(B): the segment by binary search, the block's counts in
//! closed form, and one pass over the block for the rank of the position among its source's.

use serde::{Deserialize, Serialize};

use crate::error::{DataloadError, Result};

/// Weights are quantized to this many parts of their sum.
const WEIGHT_SCALE: u128 = 1 << 32;
/// The smallest block.
const MIN_BLOCK: u64 = 64;
/// The largest block: a weight below 2^-20 of the total is refused.
const MAX_BLOCK: u64 = 1 << 20;
/// Feistel rounds of the keyed permutations.
const ROUNDS: u64 = 6;

/// The definition of a mixture: everything its order depends on. A loader state records it, and
/// refuses to resume against a mixture whose definition differs in any field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixtureSpec {
    /// Each source's number of samples.
    pub sizes: Vec<u64>,
    /// Each source's weight (any positive scale; normalized).
    pub weights: Vec<f64>,
    /// The seed of the interleaving and of every source's permutations.
    pub seed: u64,
    /// Sources read once, by index (the others repeat, reshuffled each pass).
    #[serde(default)]
    pub once: Vec<usize>,
    /// Total samples; `None` only when every source is `once` (their total).
    #[serde(default)]
    pub length: Option<u64>,
    /// Weight changes: from position `at` on, these weights (a curriculum).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<WeightChange>,
}

// Weights are finite by validation (and JSON has no NaN), so equality is an equivalence.
impl Eq for MixtureSpec {}
impl Eq for WeightChange {}

impl MixtureSpec {
    /// Refuses to continue at `cursor` of `saved`'s order with this definition: every field
    /// must be the same, by name, except that weight changes may be added from the cursor on
    /// (a curriculum decided mid-run), which leaves every position before it as it was.
    pub fn check_resumes(&self, saved: &MixtureSpec, cursor: u64) -> Result<()> {
        use crate::state::differ;
        differ("mixture.sizes", &saved.sizes, &self.sizes)?;
        differ("mixture.weights", &saved.weights, &self.weights)?;
        differ("mixture.seed", &saved.seed, &self.seed)?;
        differ("mixture.once", &saved.once, &self.once)?;
        differ("mixture.length", &saved.length, &self.length)?;
        let kept = self.changes.len() >= saved.changes.len()
            && self.changes[..saved.changes.len()] == saved.changes[..]
            && self.changes[saved.changes.len()..].iter().all(|c| c.at >= cursor);
        if !kept {
            differ("mixture.changes", &saved.changes, &self.changes)?;
        }
        Ok(())
    }
}

/// New weights from a position of the global order on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightChange {
    /// The first position read with the new weights.
    pub at: u64,
    /// One weight per source (a `once` source already used up stays out).
    pub weights: Vec<f64>,
}

/// A stretch of the order with fixed weights.
#[derive(Debug, Clone)]
struct Segment {
    /// First position.
    start: u64,
    /// Samples each source had given before `start`.
    before: Vec<u64>,
    /// Integer weights (0: not in this segment).
    m: Vec<u64>,
    /// Their sum.
    total: u64,
    /// Block size.
    block: u64,
}

/// A compiled mixture (see the module docs).
#[derive(Debug, Clone)]
pub struct Mixture {
    spec: MixtureSpec,
    once: Vec<bool>,
    len: u64,
    segments: Vec<Segment>,
}

fn bad(field: &'static str, reason: impl Into<String>) -> DataloadError {
    DataloadError::BadMixture { field, reason: reason.into() }
}

/// splitmix64: the mixing function every key and round goes through.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn key(parts: &[u64]) -> u64 {
    parts.iter().fold(0x5eed_u64, |h, &p| mix(h ^ mix(p)))
}

/// A keyed bijection of `0..n`: a balanced Feistel network on the smallest even number of bits
/// that holds `n`, walking the cycle until it lands below `n` (under four steps on average).
#[derive(Debug, Clone, Copy)]
struct Permutation {
    n: u64,
    half: u32,
    key: u64,
}

impl Permutation {
    fn new(n: u64, key: u64) -> Permutation {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        Permutation { n, half: bits.div_ceil(2).max(1), key }
    }

    fn round(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half) - 1;
        let (mut l, mut r) = (x >> self.half, x & mask);
        for i in 0..ROUNDS {
            let f = mix(self.key ^ mix(r ^ (i << 56))) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half) | r
    }

    fn apply(&self, i: u64) -> u64 {
        if self.n <= 1 {
            return i;
        }
        let mut x = self.round(i);
        while x >= self.n {
            x = self.round(x);
        }
        x
    }
}

impl Segment {
    /// Samples each source has given after `x` positions of this segment, `x` a multiple of
    /// the block (largest remainders, ties to the lower index).
    fn counts_at(&self, x: u64) -> Vec<u64> {
        let x = x as u128;
        let total = self.total as u128;
        let mut counts: Vec<u64> = self.m.iter().map(|&m| (x * m as u128 / total) as u64).collect();
        let given: u128 = counts.iter().map(|&c| c as u128).sum();
        let mut short = (x - given) as usize;
        if short > 0 {
            let mut order: Vec<(u128, usize)> =
                self.m.iter().enumerate().map(|(i, &m)| ((x * m as u128) % total, i)).collect();
            order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            for &(rem, i) in &order {
                if short == 0 || rem == 0 {
                    break;
                }
                counts[i] += 1;
                short -= 1;
            }
        }
        counts
    }

    /// The source of each position of block `b`, in order, each computed as it is taken: a
    /// caller that needs the first `j` positions pays for `j`, not for the block, which may be
    /// far longer than the mixture (2^19 positions for a mixture of 177 samples weighted
    /// 1 : 357 000: listing every block whole, its compilation ran past the fuzzer's limit).
    fn block_sources(&self, seed: u64, seg: usize, b: u64) -> impl Iterator<Item = usize> {
        let lo = self.counts_at(b * self.block);
        let hi = self.counts_at((b + 1) * self.block);
        // Quota slots in source order, source i holding the slots below `ends[i]` and from
        // `ends[i - 1]` on; position j takes slot perm(j).
        let ends: Vec<u64> = hi
            .iter()
            .zip(&lo)
            .scan(0u64, |end, (h, l)| {
                *end += h - l;
                Some(*end)
            })
            .collect();
        let perm = Permutation::new(self.block, key(&[seed, 1, seg as u64, b]));
        (0..self.block).map(move |j| {
            let slot = perm.apply(j);
            ends.partition_point(|&end| end <= slot)
        })
    }
}

impl Mixture {
    /// Compiles `spec`, refusing a definition that does not hold together, by field.
    pub fn new(spec: MixtureSpec) -> Result<Mixture> {
        let s = spec.sizes.len();
        if s == 0 {
            return Err(bad("sizes", "a mixture needs at least one source"));
        }
        check_weights("weights", &spec.weights, s)?;
        let mut once = vec![false; s];
        for &i in &spec.once {
            if i >= s {
                return Err(bad("once", format!("source {i} does not exist ({s} sources)")));
            }
            once[i] = true;
        }
        for (i, &n) in spec.sizes.iter().enumerate() {
            if n == 0 && !once[i] {
                return Err(bad("sizes", format!("source {i} is empty and cannot repeat")));
            }
        }
        let once_total =
            spec.sizes.iter().zip(&once).filter(|(_, o)| **o).try_fold(0u64, |t, (n, _)| t.checked_add(*n));
        let Some(once_total) = once_total else {
            return Err(bad("sizes", "the sources read once hold more than 2^64 samples together"));
        };
        let all_once = once.iter().all(|o| *o);
        let len = match (spec.length, all_once) {
            (Some(l), true) if l > once_total => {
                return Err(bad(
                    "length",
                    format!("{l} is more than the {once_total} samples of the sources read once"),
                ))
            }
            (Some(l), _) => l,
            (None, true) => once_total,
            (None, false) => return Err(bad("length", "is needed when a source repeats")),
        };
        let mut last = 0;
        for c in &spec.changes {
            check_weights("changes.weights", &c.weights, s)?;
            if c.at < last || c.at > len {
                return Err(bad("changes.at", format!("{} is not in order within 0..={len}", c.at)));
            }
            last = c.at;
        }
        let mut mixture = Mixture { once, len, segments: Vec::new(), spec };
        mixture.compile()?;
        Ok(mixture)
    }

    /// The segments: one per weight change and per `once` source used up.
    fn compile(&mut self) -> Result<()> {
        let s = self.spec.sizes.len();
        let mut alive: Vec<bool> = (0..s).map(|i| self.spec.sizes[i] > 0).collect();
        let mut weights = self.spec.weights.clone();
        let mut changes = self.spec.changes.iter().peekable();
        let mut start = 0u64;
        let mut before = vec![0u64; s];
        while start < self.len {
            while let Some(c) = changes.next_if(|c| c.at <= start) {
                weights = c.weights.clone();
            }
            let seg = segment(start, before.clone(), &weights, &alive)?;
            // The segment ends at the next change, the first `once` source to run out, or the
            // end of the mixture, whichever comes first.
            let mut end = changes.peek().map_or(self.len, |c| c.at).min(self.len);
            let mut gone = None;
            for i in (0..s).filter(|&i| self.once[i] && alive[i] && seg.m[i] > 0) {
                let at = self.exhausted(&seg, self.segments.len(), i)?;
                if at < end || (at == end && gone.is_none() && at < self.len) {
                    end = at;
                    gone = Some(i);
                }
            }
            if let Some(i) = gone {
                alive[i] = false;
            }
            let idx = self.segments.len();
            self.segments.push(seg);
            before = self.counts_in(idx, end - start);
            start = end;
        }
        Ok(())
    }

    /// The position just after source `i`'s last sample, in segment `seg` (index `idx`).
    fn exhausted(&self, seg: &Segment, idx: usize, i: usize) -> Result<u64> {
        let left = self.spec.sizes[i] - seg.before[i];
        // The first block whose end count reaches `left` (counts at block ends only grow).
        let (mut lo, mut hi) = (0u64, (left as u128 * seg.total as u128 / seg.m[i] as u128) as u64 / seg.block + 2);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if seg.counts_at((mid + 1) * seg.block)[i] >= left {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let mut count = seg.counts_at(lo * seg.block)[i];
        for (j, src) in seg.block_sources(self.spec.seed, idx, lo).enumerate() {
            if src == i {
                count += 1;
                if count == left {
                    return Ok(seg.start + lo * seg.block + j as u64 + 1);
                }
            }
        }
        Err(bad("sizes", format!("source {i} never runs out (internal)")))
    }

    /// Samples each source has given after `x` positions of segment `idx`.
    fn counts_in(&self, idx: usize, x: u64) -> Vec<u64> {
        let seg = &self.segments[idx];
        let (b, j) = (x / seg.block, x % seg.block);
        let mut counts = seg.counts_at(b * seg.block);
        if j > 0 {
            for src in seg.block_sources(self.spec.seed, idx, b).take(j as usize) {
                counts[src] += 1;
            }
        }
        counts.iter().zip(&seg.before).map(|(c, b)| c + b).collect()
    }

    fn segment_of(&self, position: u64) -> usize {
        self.segments.partition_point(|s| s.start <= position).saturating_sub(1)
    }

    /// Number of samples of the mixture.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the mixture has no samples.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The definition.
    pub fn spec(&self) -> &MixtureSpec {
        &self.spec
    }

    /// Number of sources.
    pub fn sources(&self) -> usize {
        self.spec.sizes.len()
    }

    /// The block size in force at `position` (the granularity of the proportions there).
    pub fn block_at(&self, position: u64) -> u64 {
        self.segments.get(self.segment_of(position)).map_or(MIN_BLOCK, |s| s.block)
    }

    /// How many samples each source has given before `position` (`position ≤ len`).
    pub fn positions(&self, position: u64) -> Result<Vec<u64>> {
        if position > self.len {
            return Err(DataloadError::IndexOutOfRange { index: position, len: self.len });
        }
        if self.segments.is_empty() {
            return Ok(vec![0; self.sources()]);
        }
        let idx = self.segment_of(position);
        Ok(self.counts_in(idx, position - self.segments[idx].start))
    }

    /// `(source, sample of that source)` at `position` of the global order.
    pub fn locate(&self, position: u64) -> Result<(usize, u64)> {
        if position >= self.len {
            return Err(DataloadError::IndexOutOfRange { index: position, len: self.len });
        }
        let idx = self.segment_of(position);
        let seg = &self.segments[idx];
        let x = position - seg.start;
        let (b, j) = (x / seg.block, x % seg.block);
        let sources: Vec<usize> = seg.block_sources(self.spec.seed, idx, b).take(j as usize + 1).collect();
        let src = sources[j as usize];
        let earlier = sources[..j as usize].iter().filter(|&&s| s == src).count() as u64;
        let t = seg.before[src] + seg.counts_at(b * seg.block)[src] + earlier;
        Ok((src, self.sample(src, t)))
    }

    /// [`Mixture::locate`] of every position of `positions`, sharing the work of positions in
    /// one block (a batch of consecutive positions costs one pass per block it touches).
    pub fn locate_many(&self, positions: &[u64]) -> Result<Vec<(usize, u64)>> {
        // (segment, block, each position's source, its rank among its source's, block counts)
        type Block = (usize, u64, Vec<usize>, Vec<u64>, Vec<u64>);
        let mut cache: Option<Block> = None;
        positions
            .iter()
            .map(|&position| {
                if position >= self.len {
                    return Err(DataloadError::IndexOutOfRange { index: position, len: self.len });
                }
                let idx = self.segment_of(position);
                let seg = &self.segments[idx];
                let x = position - seg.start;
                let (b, j) = (x / seg.block, (x % seg.block) as usize);
                if !matches!(&cache, Some((i, bb, ..)) if *i == idx && *bb == b) {
                    // The block's positions up to the mixture's end: a block can be longer
                    // than the whole mixture.
                    let in_block = (self.len - (seg.start + b * seg.block)).min(seg.block);
                    let sources: Vec<usize> =
                        seg.block_sources(self.spec.seed, idx, b).take(in_block as usize).collect();
                    // Each position's rank among its source's positions in the block.
                    let mut seen = vec![0u64; self.sources()];
                    let ranks = sources
                        .iter()
                        .map(|&s| {
                            seen[s] += 1;
                            seen[s] - 1
                        })
                        .collect();
                    cache = Some((idx, b, sources, ranks, seg.counts_at(b * seg.block)));
                }
                let Some((_, _, sources, ranks, base)) = &cache else { unreachable!("filled above") };
                let src = sources[j];
                let t = seg.before[src] + base[src] + ranks[j];
                Ok((src, self.sample(src, t)))
            })
            .collect()
    }

    /// Source `src`'s `t`-th sample overall: its pass `⌊t/n⌋`'s permutation at `t mod n`.
    fn sample(&self, src: usize, t: u64) -> u64 {
        let n = self.spec.sizes[src];
        let (pass, at) = (t / n, t % n);
        Permutation::new(n, key(&[self.spec.seed, 2, src as u64, pass])).apply(at)
    }
}

fn check_weights(field: &'static str, weights: &[f64], sources: usize) -> Result<()> {
    if weights.len() != sources {
        return Err(bad(field, format!("{} weights for {sources} sources", weights.len())));
    }
    if let Some(w) = weights.iter().find(|w| !w.is_finite() || **w < 0.0) {
        return Err(bad(field, format!("{w} is not a weight (finite, not negative)")));
    }
    if !weights.iter().any(|w| *w > 0.0) {
        return Err(bad(field, "at least one weight must be positive"));
    }
    Ok(())
}

/// The segment from `start`, with the weights of the sources still `alive`.
fn segment(start: u64, before: Vec<u64>, weights: &[f64], alive: &[bool]) -> Result<Segment> {
    let sum: f64 = weights.iter().zip(alive).filter(|(_, a)| **a).map(|(w, _)| *w).sum();
    if sum <= 0.0 {
        return Err(bad("weights", format!("no source with a positive weight is left at position {start}")));
    }
    let m: Vec<u64> = weights
        .iter()
        .zip(alive)
        .map(|(w, a)| if *a { ((w / sum) * WEIGHT_SCALE as f64).round() as u64 } else { 0 })
        .collect();
    let total: u64 = m.iter().sum();
    let smallest = m.iter().copied().filter(|&x| x > 0).min().unwrap_or(1);
    let block = total.div_ceil(smallest).next_power_of_two().max(MIN_BLOCK);
    if block > MAX_BLOCK {
        return Err(bad("weights", "a weight below 2^-20 of the total is too small to schedule exactly"));
    }
    Ok(Segment { start, before, m, total, block })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn spec(sizes: &[u64], weights: &[f64], once: &[usize], length: Option<u64>) -> MixtureSpec {
        MixtureSpec {
            sizes: sizes.to_vec(),
            weights: weights.to_vec(),
            seed: 7,
            once: once.to_vec(),
            length,
            changes: Vec::new(),
        }
    }

    #[test]
    fn permutations_are_bijections() {
        for n in [1u64, 2, 3, 5, 64, 100, 1000, 4097] {
            let p = Permutation::new(n, 99);
            let mut seen: Vec<u64> = (0..n).map(|i| p.apply(i)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}");
        }
    }

    #[test]
    fn a_once_source_is_read_exactly_once_and_leaves() {
        let m = Mixture::new(spec(&[100, 37, 1000], &[0.6, 0.3, 0.1], &[1], Some(3000))).unwrap();
        let all = m.locate_many(&(0..m.len()).collect::<Vec<_>>()).unwrap();
        let mut once: Vec<u64> = all.iter().filter(|(s, _)| *s == 1).map(|(_, j)| *j).collect();
        once.sort_unstable();
        assert_eq!(once, (0..37).collect::<Vec<_>>());
        // A repeated source goes through every sample once per pass.
        let rep: Vec<u64> = all.iter().filter(|(s, _)| *s == 0).map(|(_, j)| *j).collect();
        let mut first: Vec<u64> = rep[..100].to_vec();
        first.sort_unstable();
        assert_eq!(first, (0..100).collect::<Vec<_>>());
        assert_ne!(rep[..100], rep[100..200], "each pass is reshuffled");
    }

    #[test]
    fn all_once_sources_make_their_total() {
        let m = Mixture::new(spec(&[10, 20, 5], &[1.0, 1.0, 1.0], &[0, 1, 2], None)).unwrap();
        assert_eq!(m.len(), 35);
        let mut all = m.locate_many(&(0..35).collect::<Vec<_>>()).unwrap();
        all.sort_unstable();
        let want: Vec<(usize, u64)> =
            [(0usize, 10u64), (1, 20), (2, 5)].iter().flat_map(|&(s, n)| (0..n).map(move |j| (s, j))).collect();
        assert_eq!(all, want);
        assert!(m.locate(35).is_err());
    }

    #[test]
    fn a_weight_change_starts_a_segment_with_the_earlier_positions_kept() {
        let base = spec(&[1000, 1000], &[0.9, 0.1], &[], Some(10_000));
        let mut changed = base.clone();
        changed.changes.push(WeightChange { at: 4000, weights: vec![0.2, 0.8] });
        let (a, b) = (Mixture::new(base).unwrap(), Mixture::new(changed).unwrap());
        for p in (0..4000).step_by(37) {
            assert_eq!(a.locate(p).unwrap(), b.locate(p).unwrap());
        }
        let at = b.positions(4000).unwrap();
        let end = b.positions(10_000).unwrap();
        let after = (end[1] - at[1]) as f64 / 6000.0;
        assert!((after - 0.8).abs() < 0.02, "{after}");
    }

    #[test]
    fn definitions_that_do_not_hold_are_refused_by_field() {
        let e = |s| Mixture::new(s).unwrap_err().to_string();
        assert!(e(spec(&[10], &[1.0, 2.0], &[], Some(5))).contains("`weights`"));
        assert!(e(spec(&[10, 10], &[1.0, 2.0], &[], None)).contains("`length`"));
        assert!(e(spec(&[10, 10], &[1.0, 2.0], &[5], Some(4))).contains("`once`"));
        assert!(e(spec(&[10, 10], &[-1.0, 2.0], &[], Some(4))).contains("`weights`"));
        assert!(e(spec(&[10, 10], &[1.0, 2.0], &[0, 1], Some(40))).contains("`length`"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn proportions_are_exact_within_a_block_and_locate_agrees_with_positions(
            sizes in prop::collection::vec(1u64..500, 1..5),
            raw in prop::collection::vec(1u32..100, 5),
            seed in any::<u64>(),
            k in 0u64..3000,
        ) {
            let weights: Vec<f64> = raw[..sizes.len()].iter().map(|&w| w as f64).collect();
            let mut s = spec(&sizes, &weights, &[], Some(3000));
            s.seed = seed;
            let m = Mixture::new(s).unwrap();
            let counts = m.positions(k).unwrap();
            prop_assert_eq!(counts.iter().sum::<u64>(), k);
            let sum: f64 = weights.iter().sum();
            let block = m.block_at(k) as f64;
            for (i, &c) in counts.iter().enumerate() {
                let want = k as f64 * weights[i] / sum;
                prop_assert!((c as f64 - want).abs() <= block * weights[i] / sum + 1.0,
                    "source {} gave {} of {} (k = {}, block {})", i, c, want, k, block);
            }
            if k < m.len() {
                // The sample at k is its source's next one.
                let (src, _) = m.locate(k).unwrap();
                let next = m.positions(k + 1).unwrap();
                prop_assert_eq!(next[src], counts[src] + 1);
                prop_assert_eq!(m.locate_many(&[k]).unwrap()[0], m.locate(k).unwrap());
            }
        }

        #[test]
        fn every_sample_of_every_once_source_is_read_exactly_once(
            sizes in prop::collection::vec(0u64..300, 1..5),
            raw in prop::collection::vec(1u32..50, 5),
            seed in any::<u64>(),
        ) {
            let weights: Vec<f64> = raw[..sizes.len()].iter().map(|&w| w as f64).collect();
            let once: Vec<usize> = (0..sizes.len()).collect();
            let mut s = spec(&sizes, &weights, &once, None);
            s.seed = seed;
            let m = Mixture::new(s).unwrap();
            prop_assert_eq!(m.len(), sizes.iter().sum::<u64>());
            let mut all = m.locate_many(&(0..m.len()).collect::<Vec<_>>()).unwrap();
            all.sort_unstable();
            let want: Vec<(usize, u64)> = sizes.iter().enumerate().flat_map(|(s, &n)| (0..n).map(move |j| (s, j))).collect();
            prop_assert_eq!(all, want);
        }
    }
}
