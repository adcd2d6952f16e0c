//! Benchmark (not part of the test suite): batches/s and GB/s of the prefetching loader over
//! token windows and Parquet rows.
//!
//! `cargo run --release -p dataload --example bench_sources -- DIR`
//! reads `DIR/tokens.bin` (uint16) and `DIR/rows.parquet` (written by
//! `bench/dataload_sources_bench.py`, which runs this beside torch's `DataLoader`) and prints
//! one JSON object per line.

use std::sync::Arc;
use std::time::Instant;

use dataload::{
    DataLoader, DataLoaderConfiguration, ParquetDataset, ShardedSampler, ShardedSamplerBuilder, Source, TokenDtype,
    TokenWindows,
};

fn sampler(batch: u64, shuffle: bool) -> ShardedSamplerBuilder {
    ShardedSampler::builder().batch_size(batch).world_size(1).shuffle(shuffle).config(DataLoaderConfiguration {
        use_seedable_sampler: shuffle,
        data_seed: shuffle.then_some(0),
        ..Default::default()
    })
}

/// Reads `batches` batches (or the epoch) and returns (batches, seconds, bytes).
fn run<S: Source>(
    source: Arc<S>,
    batch: u64,
    shuffle: bool,
    workers: usize,
    batches: usize,
    bytes: impl Fn(&S::Batch) -> usize,
) -> dataload::Result<(usize, f64, usize)> {
    let mut loader = DataLoader::builder(source, sampler(batch, shuffle)).workers(workers).build()?;
    let (mut n, mut total) = (0usize, 0usize);
    let t = Instant::now();
    while n < batches {
        match loader.next_batch()? {
            Some(b) => {
                total += bytes(&b);
                n += 1;
            }
            None => break,
        }
    }
    Ok((n, t.elapsed().as_secs_f64(), total))
}

fn main() -> dataload::Result<()> {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "bench/work/dataload_sources".into()));
    let block: usize = std::env::var("BENCH_BLOCK").ok().and_then(|s| s.parse().ok()).unwrap_or(1024);
    let tokens = Arc::new(TokenWindows::open(dir.join("tokens.bin"), block, TokenDtype::U16)?);
    for workers in [0usize, 2] {
        let (n, secs, bytes) = run(tokens.clone(), 32, true, workers, 400, |b| (b.inputs.len() + b.targets.len()) * 8)?;
        println!(
            "{{\"bench\": \"tokens\", \"workers\": {workers}, \"batches\": {n}, \"seconds\": {secs:.4}, \"batches_per_s\": {:.1}, \"gb_per_s\": {:.3}}}",
            n as f64 / secs,
            bytes as f64 / secs / 1e9
        );
    }
    let parquet = Arc::new(ParquetDataset::open(dir.join("rows.parquet"), None, 8)?);
    let rows = parquet.len();
    for workers in [0usize, 2] {
        let (n, secs, _) = run(parquet.clone(), 256, false, workers, usize::MAX, |_| 0)?;
        println!(
            "{{\"bench\": \"parquet\", \"workers\": {workers}, \"batches\": {n}, \"rows\": {rows}, \"seconds\": {secs:.4}, \"batches_per_s\": {:.1}, \"rows_per_s\": {:.0}}}",
            n as f64 / secs,
            rows as f64 / secs
        );
    }
    Ok(())
}
