//! The arithmetic the Python package takes from `dataload` instead of computing it itself:
//! accelerate's lengths and remainders, pinned against the values accelerate's classes give
//! (the cases `tests/python/data/test_bindings_iterable.py`, `test_bindings_dispatch.py` and
//! `test_statekit_accelerate.py` compare with accelerate).
#![allow(clippy::unwrap_used)]

use dataload::{
    dispatch_len, randperm, stream_accelerate_len, DataLoaderConfiguration, ShardedSampler, TorchGenerator,
    TorchVersion,
};

fn dispatched(n: u64, batch_size: u64, world: u64, split: bool, drop_last: bool) -> ShardedSampler {
    ShardedSampler::builder()
        .dataset_len(n)
        .batch_size(batch_size)
        .world_size(world)
        .rank(0)
        .drop_last(drop_last)
        .config(DataLoaderConfiguration {
            dispatch_batches: Some(true),
            split_batches: split,
            ..DataLoaderConfiguration::default()
        })
        .build()
        .unwrap()
}

#[test]
fn iterable_shard_len_is_accelerates() {
    // (n, batch_size, drop_last, world) -> accelerate's `IterableDatasetShard.__len__`
    for (n, bs, drop_last, world, want) in [
        (20, 4, false, 2, 12), // 3 chunks of 8 (the last padded), 4 items each
        (20, 4, true, 2, 8),
        (16, 4, false, 2, 8),
        (0, 4, false, 3, 0),
        (5, 2, false, 3, 2),
        (5, 2, true, 3, 0),
        (7, 1, false, 1, 7),
    ] {
        assert_eq!(stream_accelerate_len(n, bs, drop_last, world), want, "{n} {bs} {drop_last} {world}");
    }
}

#[test]
fn dispatcher_len_counts_steps_of_base_batches() {
    // (base batches, world, split, drop_last) -> steps
    for (base, world, split, drop_last, want) in [
        (5, 2, false, false, 3),
        (5, 2, false, true, 2),
        (5, 2, true, false, 5),
        (5, 2, true, true, 5),
        (0, 3, false, false, 0),
        (6, 3, false, false, 2),
    ] {
        assert_eq!(dispatch_len(base, world, split, drop_last), want, "{base} {world} {split} {drop_last}");
    }
}

#[test]
fn dispatcher_len_is_the_plans_accelerate_len() {
    for n in [0u64, 1, 7, 23, 24, 25] {
        for (bs, world, split, drop_last) in [(3, 2, false, false), (4, 2, true, true), (3, 3, false, true)] {
            let s = dispatched(n, bs, world, split, drop_last);
            let base = if drop_last { n / bs } else { n.div_ceil(bs) };
            assert_eq!(s.epoch_len(), dispatch_len(base, world, split, drop_last), "{n} {bs} {world}");
        }
    }
}

#[test]
fn epoch_remainder_is_the_last_global_batchs_rows() {
    // 23 samples, 3 per batch, 2 ranks: global batches of 6, the last of 5 rows.
    assert_eq!(dispatched(23, 3, 2, false, false).epoch_remainder(), Some(5));
    // split: global batches of 3, the last of 2 rows.
    assert_eq!(dispatched(23, 3, 1, true, false).epoch_remainder(), Some(2));
    assert_eq!(dispatched(24, 4, 2, true, false).epoch_remainder(), Some(4));
    // drop_last: the last global batch is a full one.
    assert_eq!(dispatched(23, 3, 2, false, true).epoch_remainder(), Some(6));
    assert_eq!(dispatched(24, 3, 2, false, false).epoch_remainder(), Some(6));
    // no global batch at all: accelerate's -1
    assert_eq!(dispatched(0, 3, 2, false, false).epoch_remainder(), None);
    assert_eq!(dispatched(5, 3, 2, false, true).epoch_remainder(), None);
}

#[test]
fn global_batch_is_accelerates_total_batch_size() {
    assert_eq!(dispatched(48, 4, 3, false, false).geometry().global_batch(), 12);
    assert_eq!(dispatched(48, 4, 2, true, false).geometry().global_batch(), 4);
}

fn random_dispatched(n: u64, batch_size: u64, drop_last: bool) -> ShardedSampler {
    ShardedSampler::builder()
        .dataset_len(n)
        .batch_size(batch_size)
        .world_size(2)
        .rank(1)
        .shuffle(true)
        .drop_last(drop_last)
        .generator(TorchGenerator::manual_seed(0))
        .config(DataLoaderConfiguration { dispatch_batches: Some(true), ..DataLoaderConfiguration::default() })
        .build()
        .unwrap()
}

/// The generator after `perms` calls of `torch.randperm(n, generator=g)`.
fn after_randperms(g: &TorchGenerator, n: u64, perms: u32) -> TorchGenerator {
    let mut g = g.clone();
    for _ in 0..perms {
        randperm(n, &mut g, TorchVersion::default()).unwrap();
    }
    g
}

#[test]
fn prefetching_workers_draw_one_permutation_or_two() {
    let g = TorchGenerator::manual_seed(42);
    // (n, batch_size, drop_last, prefetched) -> permutations drawn. The pull that finds the
    // sampler empty draws the second: the third for 10 samples in batches of 4 (its short last
    // batch), for 8 (the pull after the 2 batches) and for 10 with drop_last (likewise).
    for (n, bs, drop_last, prefetched, perms) in [
        (10, 4, false, 0, 0),
        (10, 4, false, 2, 1),
        (10, 4, false, 3, 2),
        (8, 4, false, 2, 1),
        (8, 4, false, 3, 2),
        (10, 4, true, 2, 1),
        (10, 4, true, 3, 2),
        (10, 4, false, 4, 2),
        (1000, 4, false, 4, 1),
    ] {
        let s = random_dispatched(n, bs, drop_last);
        assert_eq!(
            s.prefetch_advanced(&g, prefetched),
            after_randperms(&g, n, perms),
            "{n} {bs} {drop_last} {prefetched}"
        );
    }
}
