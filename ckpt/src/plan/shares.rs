//! Dealing one copy plan out to the ranks of a job.
//!
//! Every rank computes the same [`deal`] from the same plan, so the ranks agree on who writes
//! what without sending the plan around. A rank's [`Share`] is a set of target files it *owns*
//! (creates, writes the header of, seals, hashes) and the parts of targets it fills: range
//! copies and gathers, each a slice of the plan's. Shares are balanced by the bytes they
//! write:
//!
//! - **Whole files** when the plan has enough of them: targets go, largest first, to the rank
//!   with the least so far, and this is kept when no rank ends up with more than
//!   [`WHOLE_FILE_SLACK`] times the mean. A file is then written by one rank alone, which is
//!   what a parallel filesystem does best (no two clients in one file).
//! - **Byte ranges** otherwise (one merged file, a few large ones, more ranks than files): the
//!   plan's bytes are laid end to end, target after target, and cut into `n` equal stretches.
//!   A copy is cut at any byte; a gather (a cast or a strided view) at an element; a computed
//!   gather (block-scaled FP8) is never cut and goes whole to the stretch its start is in. A
//!   target's owner is the rank whose stretch holds its first byte.
//! - **Pinned files** when every target names its owner ([`TargetFile::owner`]): its bytes are
//!   in that rank's memory alone (a rank's file of [`crate::save_sharded`]), so it writes it whole.
//!
//! Either way every byte of every target is written by exactly one rank (the property test
//! below), and the bytes are those the one-process run writes, because the parts are slices of
//! the same copies and gathers.

use std::ops::Range;

use serde::Serialize;

use crate::write::{Gather, Plan, RangeCopy, TargetFile};

/// Whole-file shares are kept when the largest is within this factor of the mean.
const WHOLE_FILE_SLACK: f64 = 1.1;

/// What one rank writes of one target.
#[derive(Clone, Debug, Default)]
pub(crate) struct Part {
    /// The target's index in the plan.
    pub target: usize,
    pub copies: Vec<RangeCopy>,
    pub gathers: Vec<Gather>,
}

/// One rank's share of a plan.
#[derive(Clone, Debug, Default)]
pub(crate) struct Share {
    /// The rank it is dealt to.
    pub rank: u64,
    /// Targets this rank creates (header included) and seals.
    pub owned: Vec<usize>,
    /// What it fills, one entry per target it writes data into.
    pub parts: Vec<Part>,
}

/// What one rank of a job did, as `--json` reports it (`ranks`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RankShare {
    /// The rank.
    pub rank: u64,
    /// Output files it wrote into (whole or a range of).
    pub files: u64,
    /// Source bytes it read to write them.
    pub bytes_read: u64,
    /// Bytes it wrote: tensor data, and the headers of the files it owns.
    pub bytes_written: u64,
}

impl RankShare {
    /// Adds `other`'s counts (another plan of the same operation) to these.
    pub(crate) fn add(&mut self, other: &RankShare) {
        self.files += other.files;
        self.bytes_read += other.bytes_read;
        self.bytes_written += other.bytes_written;
    }
}

impl Share {
    /// This share's counts, as rank `rank`'s.
    pub(crate) fn report(&self, plan: &Plan, rank: u64) -> RankShare {
        let mut files: Vec<usize> = self.owned.iter().copied().chain(self.parts.iter().map(|p| p.target)).collect();
        files.sort_unstable();
        files.dedup();
        let head: u64 = self.owned.iter().map(|&t| plan.targets[t].head.len() as u64).sum();
        let copied: u64 = self.parts.iter().flat_map(|p| &p.copies).map(|c| c.len).sum();
        let read: u64 = self.parts.iter().flat_map(|p| &p.gathers).map(gather_read).sum();
        let gathered: u64 = self.parts.iter().flat_map(|p| &p.gathers).map(gather_len).sum();
        RankShare {
            rank,
            files: files.len() as u64,
            bytes_read: copied + read,
            bytes_written: head + copied + gathered,
        }
    }
}

/// One piece of a target's data, in the order it is laid out.
enum Item<'p> {
    Copy(&'p RangeCopy),
    Gather(&'p Gather),
}

impl Item<'_> {
    fn len(&self) -> u64 {
        match self {
            Item::Copy(c) => c.len,
            Item::Gather(g) => gather_len(g),
        }
    }
}

/// Whole bytes per element of `bits`, or `None` for a sub-byte dtype (never cut).
fn elem_bytes(bits: u64) -> Option<u64> {
    (bits.is_multiple_of(8) && bits > 0).then_some(bits / 8)
}

/// Elements a gather covers.
fn gather_elems(g: &Gather) -> u64 {
    match (&g.range, elem_bytes(g.tensor.stored.bits())) {
        (Some(r), Some(e)) => (r.end - r.start) / e,
        _ => g.tensor.numel(),
    }
}

/// Bytes a gather writes.
fn gather_len(g: &Gather) -> u64 {
    gather_elems(g).saturating_mul(g.to.bits()) / 8
}

/// Source bytes a gather reads.
fn gather_read(g: &Gather) -> u64 {
    match &g.range {
        Some(r) => r.end - r.start,
        None => g.tensor.stored_len(),
    }
}

/// The bytes a cut inside a gather must fall on a multiple of, or `None` when it is never cut.
fn gather_grain(g: &Gather) -> Option<u64> {
    if g.compute.is_some() {
        return None;
    }
    elem_bytes(g.tensor.stored.bits())?;
    elem_bytes(g.to.bits())
}

/// The items of a target, by output offset.
fn items(t: &TargetFile) -> Vec<Item<'_>> {
    let mut items: Vec<(u64, Item<'_>)> = t.copies.iter().map(|c| (c.dst_off, Item::Copy(c))).collect();
    items.extend(t.gathers.iter().map(|g| (g.dst_off, Item::Gather(g))));
    items.sort_by_key(|(at, _)| *at);
    items.into_iter().map(|(_, i)| i).collect()
}

/// Deals `plan` out to `n` ranks (see the module docs): share `r` is rank `r`'s.
pub(crate) fn deal(plan: &Plan, n: u64) -> Vec<Share> {
    let n = n.max(1) as usize;
    let per_target: Vec<Vec<Item<'_>>> = plan.targets.iter().map(items).collect();
    let sizes: Vec<u64> = per_target
        .iter()
        .zip(&plan.targets)
        .map(|(i, t)| i.iter().map(Item::len).sum::<u64>() + t.head.len() as u64)
        .collect();
    // Targets whose bytes only one rank holds go whole to it; then no rank shares their files.
    let pinned: Option<Vec<usize>> = plan.targets.iter().map(|t| t.owner.map(|r| r as usize % n)).collect();
    let pinned = pinned.filter(|_| !plan.targets.is_empty());
    if let Some(owner) = pinned.or_else(|| whole_files(&sizes, n)) {
        let mut shares: Vec<Share> = (0..n as u64).map(|rank| Share { rank, ..Share::default() }).collect();
        for (ti, (&r, t)) in owner.iter().zip(&plan.targets).enumerate() {
            shares[r].owned.push(ti);
            if !t.copies.is_empty() || !t.gathers.is_empty() {
                shares[r].parts.push(Part { target: ti, copies: t.copies.clone(), gathers: t.gathers.clone() });
            }
        }
        return shares;
    }
    ranges(plan, &per_target, n)
}

/// The owner of each target when whole files balance well enough, else `None`.
fn whole_files(sizes: &[u64], n: usize) -> Option<Vec<usize>> {
    if n == 1 {
        return Some(vec![0; sizes.len()]);
    }
    if sizes.len() < n {
        return None;
    }
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
    let mut load = vec![0u64; n];
    let mut owner = vec![0usize; sizes.len()];
    for i in order {
        // The least loaded rank, the lowest on a tie: the same answer on every rank.
        let r = (0..n).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        owner[i] = r;
        load[r] += sizes[i];
    }
    let total: u64 = load.iter().sum();
    let mean = total as f64 / n as f64;
    let max = load.iter().copied().max().unwrap_or(0) as f64;
    (total == 0 || max <= mean * WHOLE_FILE_SLACK).then_some(owner)
}

/// Byte-range shares: the targets' bytes end to end, cut into `n` equal stretches.
fn ranges(plan: &Plan, per_target: &[Vec<Item<'_>>], n: usize) -> Vec<Share> {
    let total: u64 = per_target.iter().flatten().map(Item::len).sum();
    // Ideal cuts, each moved down to where the item under it may be cut.
    let mut cuts: Vec<u64> = (0..=n).map(|r| ((total as u128 * r as u128) / n as u128) as u64).collect();
    let mut at = 0u64;
    let mut c = 1;
    for item in per_target.iter().flatten() {
        let (a, b) = (at, at + item.len());
        while c < n && cuts[c] < b {
            if cuts[c] > a {
                cuts[c] = match item {
                    Item::Copy(_) => cuts[c],
                    Item::Gather(g) => match gather_grain(g) {
                        Some(e) => a + (cuts[c] - a) / e * e,
                        None => a,
                    },
                };
            }
            c += 1;
        }
        at = b;
    }
    let rank_at = |pos: u64| cuts[1..n].iter().filter(|&&c| c <= pos).count();
    let mut shares: Vec<Share> = (0..n as u64).map(|rank| Share { rank, ..Share::default() }).collect();
    let mut at = 0u64;
    for (ti, items) in per_target.iter().enumerate() {
        shares[rank_at(at)].owned.push(ti);
        for item in items {
            let (a, b) = (at, at + item.len());
            at = b;
            for r in rank_at(a)..n {
                let (lo, hi) = (a.max(cuts[r]), b.min(cuts[r + 1]));
                if cuts[r] >= b {
                    break;
                }
                if lo >= hi {
                    continue;
                }
                let part = part_of(&mut shares[r], ti);
                match item {
                    Item::Copy(c) => part.copies.push(RangeCopy {
                        src: c.src,
                        src_off: c.src_off + (lo - a),
                        dst_off: c.dst_off + (lo - a),
                        len: hi - lo,
                    }),
                    Item::Gather(g) => part.gathers.push(slice_gather(g, lo - a..hi - a)),
                }
            }
        }
    }
    let _ = plan;
    shares
}

/// The part of `share` for target `ti`, added when it has none yet.
fn part_of(share: &mut Share, ti: usize) -> &mut Part {
    if share.parts.last().is_none_or(|p| p.target != ti) {
        share.parts.push(Part { target: ti, ..Part::default() });
    }
    let last = share.parts.len() - 1;
    &mut share.parts[last]
}

/// Output bytes `out` of gather `g` (on its element grain) as a gather of their own.
fn slice_gather(g: &Gather, out: Range<u64>) -> Gather {
    if out.start == 0 && out.end == gather_len(g) {
        return g.clone();
    }
    // Only cut on the grain, so both element sizes are whole bytes here.
    let out_e = elem_bytes(g.to.bits()).unwrap_or(1);
    let in_e = elem_bytes(g.tensor.stored.bits()).unwrap_or(1);
    let base = g.range.as_ref().map_or(0, |r| r.start);
    let (e0, e1) = (out.start / out_e, out.end / out_e);
    Gather {
        tensor: g.tensor.clone(),
        to: g.to,
        dst_off: g.dst_off + out.start,
        compute: None,
        range: Some(base + e0 * in_e..base + e1 * in_e),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::read::catalog::{Chunk, TensorInfo};
    use crate::read::dtype::Dtype;
    use proptest::prelude::*;

    /// A target: its header length, then its items (`(is a copy, elements, casts)`).
    type Spec = (u64, Vec<(bool, u64, bool)>);
    /// Written byte intervals, and each gather's `(name, first element, end)`.
    type Written = (Vec<(u64, u64)>, Vec<(String, u64, u64)>);

    /// A plan of random targets: each a header, then copies and gathers (some casting) laid
    /// back to back, as the planners lay them.
    fn plan_of(spec: &[Spec]) -> Plan {
        let mut plan = Plan::default();
        for (ti, (head, items)) in spec.iter().enumerate() {
            let mut t = TargetFile::new(format!("t{ti}").into(), vec![0; *head as usize], 0);
            let mut at = *head;
            for (k, &(is_copy, n, cast)) in items.iter().enumerate() {
                if is_copy {
                    t.copies.push(RangeCopy { src: k % 3, src_off: 1000 * k as u64, dst_off: at, len: n });
                    at += n;
                } else {
                    let chunk = Chunk { file: 0, offset: 0, len: n * 4 };
                    let tensor = TensorInfo::ranges(format!("g{k}"), Dtype::F32, vec![n], vec![chunk]);
                    let to = if cast { Dtype::BF16 } else { Dtype::F32 };
                    t.gathers.push(Gather { tensor, to, dst_off: at, compute: None, range: None });
                    at += n * to.bits() / 8;
                }
            }
            t.len = at;
            plan.targets.push(t);
        }
        plan
    }

    /// Each rank's written intervals of target `ti`, and the elements of each gather it covers.
    fn written(share: &Share, plan: &Plan, ti: usize) -> Written {
        let mut spans = Vec::new();
        let mut elems = Vec::new();
        if share.owned.contains(&ti) {
            spans.push((0, plan.targets[ti].head.len() as u64));
        }
        for p in share.parts.iter().filter(|p| p.target == ti) {
            spans.extend(p.copies.iter().map(|c| (c.dst_off, c.dst_off + c.len)));
            for g in &p.gathers {
                spans.push((g.dst_off, g.dst_off + gather_len(g)));
                let r = g.range.clone().unwrap_or(0..g.tensor.stored_len());
                elems.push((g.tensor.name.clone(), r.start / 4, r.end / 4));
            }
        }
        (spans, elems)
    }

    proptest! {
        #[test]
        fn every_byte_of_every_target_is_written_by_exactly_one_rank(
            spec in prop::collection::vec(
                (0u64..64, prop::collection::vec((any::<bool>(), 0u64..5000, any::<bool>()), 0..6)),
                0..8,
            ),
            n in 1u64..12,
        ) {
            let plan = plan_of(&spec);
            let shares = deal(&plan, n);
            prop_assert_eq!(shares.len() as u64, n);
            for (ti, t) in plan.targets.iter().enumerate() {
                let owners = shares.iter().filter(|s| s.owned.contains(&ti)).count();
                prop_assert_eq!(owners, 1, "target {} has one owner", ti);
                let mut spans: Vec<(u64, u64)> = Vec::new();
                let mut elems: Vec<(String, u64, u64)> = Vec::new();
                for s in &shares {
                    let (sp, el) = written(s, &plan, ti);
                    spans.extend(sp.into_iter().filter(|(a, b)| a < b));
                    elems.extend(el);
                }
                spans.sort();
                let mut at = 0;
                for (a, b) in &spans {
                    prop_assert_eq!(*a, at, "target {}: a gap or an overlap at {}", ti, at);
                    at = *b;
                }
                prop_assert_eq!(at, t.len, "target {} is covered to its end", ti);
                // Each gather's elements are read exactly once, in order.
                elems.sort();
                for g in &t.gathers {
                    let mine: Vec<_> = elems.iter().filter(|(n, ..)| *n == g.tensor.name).collect();
                    let mut e = 0;
                    for (_, a, b) in mine {
                        prop_assert_eq!(*a, e);
                        e = *b;
                    }
                    prop_assert_eq!(e, g.tensor.numel());
                }
            }
        }

        #[test]
        fn byte_range_shares_are_even(n in 2u64..9, len in 1u64 << 20..1u64 << 30) {
            // One merged file: every rank writes a stretch, none more than a grain over the mean.
            let plan = plan_of(&[(128, vec![(true, len, false)])]);
            let shares = deal(&plan, n);
            let written: Vec<u64> = shares.iter().enumerate().map(|(r, s)| s.report(&plan, r as u64).bytes_written).collect();
            let mean = written.iter().sum::<u64>() / n;
            prop_assert!(written.iter().all(|w| w.abs_diff(mean) <= 128 + 1), "{:?}", written);
        }
    }

    #[test]
    fn many_even_files_go_whole() {
        let plan = plan_of(&vec![(16, vec![(true, 1000, false)]); 8]);
        let shares = deal(&plan, 4);
        for s in &shares {
            assert_eq!(s.owned.len(), 2);
            assert!(s.parts.iter().all(|p| s.owned.contains(&p.target)), "a rank fills only the files it owns");
        }
    }

    #[test]
    fn a_computed_gather_is_never_cut() {
        let mut plan = plan_of(&[(0, vec![(false, 1000, false)])]);
        let c: crate::map::blockscale::SharedCompute =
            std::sync::Arc::new(crate::map::blockscale::Compute::Bytes(vec![0; 4000]));
        plan.targets[0].gathers[0].compute = Some(c);
        let shares = deal(&plan, 3);
        let holders: Vec<_> = shares.iter().filter(|s| !s.parts.is_empty()).collect();
        assert_eq!(holders.len(), 1);
        assert!(holders[0].parts[0].gathers[0].range.is_none());
    }
}
