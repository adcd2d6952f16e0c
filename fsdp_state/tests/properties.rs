//! Properties every layout must have: each element is owned exactly once, pieces fit in their
//! slots without overlapping, and resharding N → M → N is the identity.
#![allow(clippy::unwrap_used)]

use fsdp_state::{reshard, FlatEntry, Fsdp1Flat, Fsdp2, Layout, TensorSpec, Zero12, Zero3};
use proptest::prelude::*;

fn specs() -> impl Strategy<Value = Vec<TensorSpec>> {
    prop::collection::vec(prop::collection::vec(0u64..7, 1..4), 1..7)
        .prop_map(|shapes| shapes.into_iter().enumerate().map(|(i, s)| TensorSpec::new(format!("t{i}"), s)).collect())
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Fsdp2,
    Fsdp1,
    /// FSDP1 with `use_orig_params=True`: parameters aligned to this many elements.
    Fsdp1Aligned(u64),
    Zero12,
    Zero3,
}

fn build(kind: Kind, tensors: &[TensorSpec], world: u64) -> Box<dyn Layout> {
    let t = tensors.to_vec();
    match kind {
        Kind::Fsdp2 => Box::new(Fsdp2::new(t, world).unwrap()),
        Kind::Fsdp1 => Box::new(Fsdp1Flat::new(t, world).unwrap()),
        Kind::Fsdp1Aligned(aligned_numel) => Box::new(Fsdp1Flat::with_alignment(t, world, aligned_numel).unwrap()),
        Kind::Zero12 => {
            // Two groups: even and odd tensors, with some alignment padding in the first.
            let even: Vec<usize> = (0..t.len()).step_by(2).collect();
            let odd: Vec<usize> = (1..t.len()).step_by(2).collect();
            let pads = vec![even.iter().map(|i| (*i as u64) % 3).collect(), vec![0; odd.len()]];
            Box::new(Zero12::new(t, vec![even, odd], Some(pads), world).unwrap())
        }
        Kind::Zero3 => Box::new(Zero3::new(t, world).unwrap()),
    }
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Fsdp2),
        Just(Kind::Fsdp1),
        aligned_numel().prop_map(Kind::Fsdp1Aligned),
        Just(Kind::Zero12),
        Just(Kind::Zero3),
    ]
}

/// FSDP1's alignments for 1-, 2-, 4- and 8-byte dtypes, and 3, which divides neither the
/// others nor most world sizes.
fn aligned_numel() -> impl Strategy<Value = u64> {
    prop_oneof![Just(16u64), Just(8), Just(4), Just(2), Just(1), Just(3)]
}

/// Fills each rank's slots from the global tensors (element value = a tag of tensor and index),
/// padding as `u64::MAX`.
fn scatter(l: &dyn Layout) -> Vec<Vec<Vec<u64>>> {
    (0..l.world())
        .map(|r| {
            let mut slots: Vec<Vec<u64>> = l.slot_lens(r).into_iter().map(|n| vec![u64::MAX; n as usize]).collect();
            for p in l.pieces(r) {
                for (k, e) in p.elems.clone().enumerate() {
                    slots[p.slot][p.local as usize + k] = ((p.tensor as u64) << 32) | e;
                }
            }
            slots
        })
        .collect()
}

fn apply(plan: &[fsdp_state::RangeCopy], src: &[Vec<Vec<u64>>], dst_layout: &dyn Layout) -> Vec<Vec<Vec<u64>>> {
    let mut dst: Vec<Vec<Vec<u64>>> = (0..dst_layout.world())
        .map(|r| dst_layout.slot_lens(r).into_iter().map(|n| vec![u64::MAX; n as usize]).collect())
        .collect();
    for c in plan {
        for k in 0..c.len as usize {
            dst[c.dst_rank as usize][c.dst_slot][c.dst_local as usize + k] =
                src[c.src_rank as usize][c.src_slot][c.src_local as usize + k];
        }
    }
    dst
}

proptest! {
    #[test]
    fn every_element_is_owned_exactly_once(tensors in specs(), world in 1u64..9, kind in kind()) {
        let l = build(kind, &tensors, world);
        let mut owned: Vec<Vec<u32>> = tensors.iter().map(|t| vec![0; t.numel().unwrap() as usize]).collect();
        for r in 0..world {
            let lens = l.slot_lens(r);
            let mut used: Vec<Vec<bool>> = lens.iter().map(|&n| vec![false; n as usize]).collect();
            for p in l.pieces(r) {
                prop_assert!(p.local + p.len() <= lens[p.slot], "{kind:?}: piece past its slot");
                for k in 0..p.len() as usize {
                    let cell = &mut used[p.slot][p.local as usize + k];
                    prop_assert!(!*cell, "{kind:?}: two pieces overlap in a slot");
                    *cell = true;
                }
                for e in p.elems.clone() {
                    owned[p.tensor][e as usize] += 1;
                }
            }
        }
        prop_assert!(owned.iter().flatten().all(|&c| c == 1), "{kind:?}: {owned:?}");
    }

    #[test]
    fn reshard_n_to_m_to_n_is_the_identity(tensors in specs(), n in 1u64..9, m in 1u64..9, a in kind(), b in kind()) {
        let from = build(a, &tensors, n);
        let to = build(b, &tensors, m);
        let original = scatter(from.as_ref());
        let there = apply(&reshard(from.as_ref(), to.as_ref()).unwrap(), &original, to.as_ref());
        prop_assert_eq!(&there, &scatter(to.as_ref()), "N → M gives the M layout");
        let back = apply(&reshard(to.as_ref(), from.as_ref()).unwrap(), &there, from.as_ref());
        prop_assert_eq!(back, original);
    }
}

proptest! {
    /// The FSDP1 metadata agrees with itself in both layouts: entries follow each other without
    /// gaps, aligned parameters start on their alignment, the aligned flat parameter divides by
    /// the world size so no shard is padded, and parameter pieces plus padding tile every shard.
    #[test]
    fn fsdp1_entries_and_padding_tile_the_flat_parameter(
        tensors in specs(),
        world in 1u64..9,
        aligned_numel in prop_oneof![Just(0u64), aligned_numel()],
    ) {
        let l = Fsdp1Flat::with_alignment(tensors.clone(), world, aligned_numel).unwrap();
        let mut offset = 0u64;
        let mut params = l.params().iter();
        for e in l.entries() {
            if let FlatEntry::Param { tensor, numel } = *e {
                let p = params.next().unwrap();
                prop_assert_eq!((p.offset, p.numel), (offset, numel));
                prop_assert_eq!(&p.name, &tensors[tensor].name);
                if aligned_numel > 0 {
                    prop_assert_eq!(offset % aligned_numel, 0, "parameter `{}` misaligned", p.name);
                }
            } else {
                prop_assert!(aligned_numel > 0 && e.numel() > 0, "padding entry {e:?} without alignment");
            }
            offset += e.numel();
        }
        prop_assert!(params.next().is_none());
        prop_assert_eq!(l.unsharded_len(), offset);
        prop_assert_eq!(l.chunk_len(), offset.div_ceil(world));
        if aligned_numel > 0 {
            prop_assert_eq!(offset % world, 0);
            prop_assert!((0..world).all(|r| l.shard_numel_padded(r) == Some(0)));
        }
        let padded: u64 = (0..world).map(|r| l.shard_numel_padded(r).unwrap()).sum();
        prop_assert_eq!(offset + padded, l.chunk_len() * world);
        for r in 0..world {
            let mut runs: Vec<(u64, u64)> = l.pieces(r).iter().map(|p| (p.local, p.local + p.len())).collect();
            runs.extend(l.padding(r).into_iter().map(|x| (x.start, x.end)));
            runs.retain(|(s, e)| s < e);
            runs.sort_unstable();
            let mut at = 0;
            for (s, e) in runs {
                prop_assert_eq!(s, at, "rank {}: gap or overlap in the shard", r);
                at = e;
            }
            prop_assert_eq!(at, l.chunk_len(), "rank {}: shard not covered", r);
        }
    }
}

#[test]
fn layouts_over_different_tensors_do_not_reshard() {
    let a = Fsdp2::new(vec![TensorSpec::new("w", [4])], 2).unwrap();
    let b = Zero3::new(vec![TensorSpec::new("w", [5])], 2).unwrap();
    let err = reshard(&a, &b).unwrap_err();
    assert_eq!(err.to_string(), "layouts describe different tensors: `w [4]` vs `w [5]`");
}
