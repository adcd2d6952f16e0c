//! Benchmark (not part of the test suite): resume of accelerate's default shuffle (torch's
//! `RandomSampler` drawing each epoch from a running generator) at this rank's batch K.
//!
//! `cargo run --release -p dataload --example bench_resume_random -- [N] [K] [BS] [WORLD]`
//! prints one JSON object: `load_seconds`, the O(1) part (parse the saved state, build the
//! loader, load it: no batch before K is produced and nothing is drawn), averaged over 1000
//! repetitions; `first_batch_seconds`, load plus the first batch, which draws the epoch's
//! `randperm` once from the saved generator, as the start of any epoch does.

use std::time::Instant;

use dataload::{LoaderState, ShardedSampler, TorchGenerator};

fn arg(i: usize, default: u64) -> u64 {
    std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn main() -> dataload::Result<()> {
    let n = arg(1, 20_000_000);
    let k = arg(2, 10_000_000);
    let bs = arg(3, 1);
    let world = arg(4, 1);
    // A generator in use: 1000 draws past its seed, then one epoch drawn and crossed.
    let mut g = TorchGenerator::manual_seed(2024);
    for _ in 0..1000 {
        g.next_u32();
    }
    let mut saver =
        ShardedSampler::builder().dataset_len(n).batch_size(bs).world_size(world).shuffle(true).generator(g).build()?;
    saver.skip_first_batches(k);
    let state_json = saver.state_dict().to_json()?;
    let expect = saver.next_batch()?;

    let reps = 1000u32;
    let t = Instant::now();
    let mut cursor = 0;
    for _ in 0..reps {
        let state = LoaderState::from_json(&state_json)?;
        let l = ShardedSampler::from_state(&state, world, 0)?;
        cursor = l.cursor();
    }
    let load_s = t.elapsed().as_secs_f64() / f64::from(reps);
    assert_eq!(cursor, k * bs * world);

    let t = Instant::now();
    let state = LoaderState::from_json(&state_json)?;
    let mut l = ShardedSampler::from_state(&state, world, 0)?;
    let first = l.next_batch()?;
    let first_s = t.elapsed().as_secs_f64();
    assert_eq!(first, expect);
    println!(
        "{{\"load_seconds\": {load_s:e}, \"first_batch_seconds\": {first_s:e}, \"state_bytes\": {}, \"first\": {:?}}}",
        state_json.len(),
        first.unwrap_or_default()
    );
    Ok(())
}
