//! Benchmark (not part of the test suite): O(1) resume and index-generation throughput.
//!
//! `cargo run --release -p dataload --example bench_resume -- [N] [K] [BS] [WORLD]`
//! prints one JSON object. `bench/dataload_bench.py` runs it beside accelerate.

use std::time::Instant;

use dataload::{DataLoaderConfiguration, ShardedSampler};

fn arg(i: usize, default: u64) -> u64 {
    std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn build(n: u64, bs: u64, world: u64, shuffle: bool) -> dataload::Result<ShardedSampler> {
    ShardedSampler::builder()
        .dataset_len(n)
        .batch_size(bs)
        .world_size(world)
        .rank(0)
        .shuffle(shuffle)
        .config(DataLoaderConfiguration {
            use_seedable_sampler: shuffle,
            data_seed: shuffle.then_some(42),
            ..Default::default()
        })
        .build()
}

fn main() -> dataload::Result<()> {
    let n = arg(1, 1_000_000_000);
    let k = arg(2, 10_000_000);
    let bs = arg(3, 8);
    let world = arg(4, 8);
    let shuffled_n = arg(5, 10_000_000);

    // Resume at this rank's batch k of epoch 0: build a loader and load the saved state.
    let mut saver = build(n, bs, world, false)?;
    saver.skip_first_batches(k);
    let state_json = saver.state_dict().to_json()?;
    let t = Instant::now();
    let reps = 1000;
    let mut first = Vec::new();
    for _ in 0..reps {
        let state = dataload::LoaderState::from_json(&state_json)?;
        let mut l = build(n, bs, world, false)?;
        l.load_state_dict(&state)?;
        first = l.next_batch()?.unwrap_or_default();
    }
    let resume_s = t.elapsed().as_secs_f64() / f64::from(reps);
    // Must be the batch accelerate yields there: rank 0 of step k.
    let expect_first = k * bs * world;
    assert_eq!(first.first().copied(), Some(expect_first));

    // Shuffled resume: the epoch's permutation is drawn once (as at any epoch start).
    let mut saver = build(shuffled_n, bs, world, true)?;
    saver.skip_first_batches(shuffled_n / (bs * world) / 2);
    let state = saver.state_dict();
    let t = Instant::now();
    let mut l = build(shuffled_n, bs, world, true)?;
    l.load_state_dict(&state)?;
    let _ = l.next_batch()?;
    let resume_shuffled_s = t.elapsed().as_secs_f64();

    // Throughput: all batches of rank 0 for a sequential epoch of `tp_n` samples.
    let tp_n = shuffled_n;
    let mut l = build(tp_n, bs, world, false)?;
    let t = Instant::now();
    let mut count = 0u64;
    let mut check = 0u64;
    while let Some(b) = l.next_batch()? {
        count += b.len() as u64;
        check = check.wrapping_add(b[0]);
    }
    let seq_s = t.elapsed().as_secs_f64();

    // Throughput, shuffled (randperm included).
    let mut l = build(shuffled_n, bs, world, true)?;
    let t = Instant::now();
    let mut count_sh = 0u64;
    while let Some(b) = l.next_batch()? {
        count_sh += b.len() as u64;
        check = check.wrapping_add(b[0]);
    }
    let sh_s = t.elapsed().as_secs_f64();

    println!(
        "{{\"n\": {n}, \"k\": {k}, \"batch_size\": {bs}, \"world_size\": {world}, \
         \"resume_seconds\": {resume_s:e}, \"shuffled_n\": {shuffled_n}, \
         \"resume_shuffled_seconds\": {resume_shuffled_s}, \
         \"seq_indices\": {count}, \"seq_seconds\": {seq_s}, \
         \"shuffled_indices\": {count_sh}, \"shuffled_seconds\": {sh_s}, \"check\": {check}}}"
    );
    Ok(())
}
