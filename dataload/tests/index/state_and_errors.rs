//! Loader state: JSON round trip, refusals of states that do not fit, pinned messages; the
//! in-process collective.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::loader;
use dataload::{Collective, DataLoaderConfiguration, DataloadError, InProcessGroup, LoaderState, ShardedSampler};

fn shuffled(n: u64, seed: i128, fingerprint: &str) -> ShardedSampler {
    ShardedSampler::builder()
        .dataset_len(n)
        .batch_size(4)
        .world_size(2)
        .shuffle(true)
        .config(DataLoaderConfiguration { use_seedable_sampler: true, data_seed: Some(seed), ..Default::default() })
        .fingerprint(fingerprint)
        .build()
        .unwrap()
}

#[test]
fn json_round_trip_keeps_everything() {
    let mut l = shuffled(100, -3, "abc");
    l.set_epoch(4);
    l.next_batch().unwrap();
    let st = l.state_dict();
    let text = st.to_json().unwrap();
    assert!(text.contains("\"seed\": -3"), "{text}");
    assert_eq!(LoaderState::from_json(&text).unwrap(), st);
    assert_eq!(st.epoch, 4);
    assert_eq!(st.cursor, 8);
    assert_eq!(st.world_size, 2);
    // The largest seed torch accepts survives JSON too.
    let big = shuffled(10, dataload::MAX_SEED, "x").state_dict();
    assert_eq!(LoaderState::from_json(&big.to_json().unwrap()).unwrap(), big);
}

#[test]
fn mismatched_states_are_refused_with_the_field_named() {
    let st = shuffled(100, 1, "abc").state_dict();
    let cases: Vec<(ShardedSampler, &str)> = vec![
        (shuffled(101, 1, "abc"), "loader state does not fit this loader: `dataset_len` was 100 when saved, is 101 now"),
        (shuffled(100, 1, "abd"), "loader state does not fit this loader: `fingerprint` was \"abc\" when saved, is \"abd\" now"),
        (shuffled(100, 2, "abc"), "loader state does not fit this loader: `sampler` was {\"kind\":\"seedable_random\",\"seed\":1} when saved, is {\"kind\":\"seedable_random\",\"seed\":2} now"),
    ];
    for (mut l, msg) in cases {
        assert_eq!(l.load_state_dict(&st).unwrap_err().to_string(), msg);
    }
    let mut seq = loader(100, 4, false, 2, 0, false, true, false, None);
    // The first difference found is reported (here the missing fingerprint).
    assert!(matches!(seq.load_state_dict(&st), Err(DataloadError::StateMismatch { field: "fingerprint", .. })));
    let mut other_bs = loader(100, 5, false, 2, 0, false, true, false, None);
    let seq_state = loader(100, 4, false, 2, 0, false, true, false, None).state_dict();
    assert!(matches!(
        other_bs.load_state_dict(&seq_state),
        Err(DataloadError::StateMismatch { field: "batch_size", .. })
    ));
    let mut uneven = loader(100, 4, false, 2, 0, false, false, false, None);
    assert!(matches!(uneven.load_state_dict(&seq_state), Err(DataloadError::StateMismatch { field: "config", .. })));
}

#[test]
fn malformed_states_are_refused() {
    let good = shuffled(100, 1, "abc").state_dict().to_json().unwrap();
    let err = |t: &str| LoaderState::from_json(t).unwrap_err().to_string();
    assert_eq!(
        err(&good.replace("\"version\": 1", "\"version\": 2")),
        "unsupported loader state version 2 (this build reads version 1)"
    );
    assert_eq!(
        err(&good.replace("statekit.dataload", "other")),
        "malformed loader state: `format` is not `statekit.dataload`"
    );
    assert_eq!(
        err(&good.replace("\"cursor\": 0", "\"cursor\": 101")),
        "inconsistent loader state: cursor 101 is past the dataset length 100"
    );
    assert!(err("not json").starts_with("malformed loader state: "));
    assert!(err(&good.replace("\"epoch\"", "\"epoch_x\"")).starts_with("malformed loader state: "));
    assert!(err(&good.replace("\"seed\": 1", "\"seed\": 18446744073709551616")).starts_with("malformed"));
    // Found by the `loader_state` fuzz target under its 512 MiB limit: a batch is a list of
    // indices, so a state claiming 3·10^14 samples per batch must not start building one.
    assert_eq!(
        err(&good.replace("\"batch_size\": 4,", "\"batch_size\": 300000000000000,")),
        "inconsistent loader state: batch size 300000000000000 is more than the 4194304 samples a batch may hold"
    );
    assert_eq!(
        err(&good.replace("\"world_size\": 2,", "\"world_size\": 1000000000000,")),
        "inconsistent loader state: world size 1000000000000 is more than the 1048576 ranks any run has"
    );
}

#[test]
fn builder_refusals_are_pinned() {
    let e = |b: dataload::ShardedSamplerBuilder| b.build().unwrap_err().to_string();
    let base = || ShardedSampler::builder().dataset_len(10).batch_size(2).world_size(2);
    assert_eq!(e(ShardedSampler::builder()), "missing `dataset_len`: set it on the builder before `build()`");
    assert_eq!(e(base().rank(2)), "rank 2 is out of range for a world of 2 ranks");
    assert_eq!(e(base().batch_size(0)), "invalid `batch_size`: 0 (must be positive)");
    // accelerate's default shuffle draws from a running generator, which must be given.
    assert_eq!(e(base().shuffle(true)), "missing `generator`: set it on the builder before `build()`");
    let seedable = DataLoaderConfiguration { use_seedable_sampler: true, ..Default::default() };
    assert_eq!(
        e(base().shuffle(true).config(seedable)),
        "shuffling needs a seed: set `data_seed` in the configuration or give the torch initial seed"
    );
    // data_seed unset: accelerate falls back to torch.initial_seed(), which we are told.
    assert!(base().shuffle(true).config(seedable).torch_initial_seed(5).build().is_ok());
    let dispatch = DataLoaderConfiguration { dispatch_batches: Some(true), ..Default::default() };
    assert_eq!(
        e(base().config(dispatch).put_on_device(false)),
        "`dispatch_batches = true` requires `put_on_device = true`"
    );
    assert_eq!(
        e(base().shuffle(true).config(DataLoaderConfiguration { data_seed: Some(-(1i128 << 63) - 1), ..seedable })),
        "seed -9223372036854775809 is out of the range torch accepts ([-2^63, 2^64))"
    );
}

#[test]
fn seed_overflow_surfaces_at_the_epoch_that_overflows() {
    let mut l = shuffled(10, dataload::MAX_SEED, "x");
    assert!(l.rest_of_epoch().is_ok());
    assert_eq!(l.next_batch().unwrap_err(), DataloadError::SeedOverflow { seed: dataload::MAX_SEED, epoch: 1 });
}

#[test]
fn in_process_collective() {
    let comms = InProcessGroup::new(3);
    let results: Vec<(Vec<u8>, Vec<Vec<u8>>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let r = c.rank() as u8;
                    let b = c.broadcast(1, (r == 1).then(|| vec![7, 8])).unwrap();
                    c.barrier().unwrap();
                    let g = c.all_gather(vec![r; r as usize]).unwrap();
                    assert!(c.broadcast(5, None).is_err());
                    (b, g)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (b, g) in results {
        assert_eq!(b, vec![7, 8]);
        assert_eq!(g, vec![vec![], vec![1], vec![2, 2]]);
    }
}

#[test]
fn oversized_inner_batches_are_refused() {
    let params = dataload::ShardParams {
        batch_size: Some(2),
        drop_last: false,
        world_size: 2,
        rank: 0,
        split_batches: false,
        even_batches: true,
    };
    let err = dataload::shard_batches(&[vec![0u64, 1, 2]], params).unwrap_err();
    assert_eq!(err.to_string(), "invalid `batch_size`: 2 (an inner batch is larger than the batch size)");
}

/// `skip_batches` (accelerate's iterable-dataset skip) produces and discards whole steps:
/// the rest, padding included, is what the unskipped dispatcher yields after them.
#[test]
fn dispatcher_skip_discards_whole_steps() {
    use dataload::{base_batches, Dispatcher, EpochOrder};
    for (n, bs, world, split, skip) in [(23u64, 3u64, 2u64, false, 2u64), (9, 4, 2, true, 1), (7, 2, 3, false, 1)] {
        let run = |skip: u64| -> Vec<Vec<Vec<u64>>> {
            let comms = InProcessGroup::new(world);
            std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|c| {
                        s.spawn(move || {
                            let src = (c.rank() == 0).then(|| {
                                Box::new(base_batches(EpochOrder::Sequential { len: n }, bs, false))
                                    as Box<dyn Iterator<Item = Vec<u64>>>
                            });
                            let mut d = Dispatcher::new(&c, src, split, false, skip);
                            d.collect_all().unwrap().into_iter().map(|b| b.rows).collect::<Vec<_>>()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let full = run(0);
        let skipped = run(skip);
        for (f, s) in full.iter().zip(&skipped) {
            assert_eq!(&f[skip as usize..], &s[..]);
        }
    }
}
