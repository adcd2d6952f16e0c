#![allow(dead_code, clippy::unwrap_used)]

use dataload::{DataLoaderConfiguration, ShardedSampler};
use serde_json::Value;

pub fn fixture(name: &str) -> Option<Value> {
    let path = format!("{}/../fixtures/dataload/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).ok()?;
    Some(serde_json::from_str(&text).unwrap())
}

pub fn seed(v: &Value) -> i128 {
    v.as_i64().map(i128::from).or_else(|| v.as_u64().map(i128::from)).unwrap()
}

pub fn batches(v: &Value) -> Vec<Vec<u64>> {
    serde_json::from_value(v.clone()).unwrap()
}

pub fn u(v: &Value) -> u64 {
    v.as_u64().unwrap()
}

pub fn b(v: &Value) -> bool {
    v.as_bool().unwrap()
}

#[allow(clippy::too_many_arguments)]
pub fn loader(
    n: u64,
    bs: u64,
    drop_last: bool,
    world: u64,
    rank: u64,
    split: bool,
    even: bool,
    dispatch: bool,
    seed: Option<i128>,
) -> ShardedSampler {
    let config = DataLoaderConfiguration {
        split_batches: split,
        even_batches: even,
        dispatch_batches: Some(dispatch),
        use_seedable_sampler: seed.is_some(),
        data_seed: seed,
        ..DataLoaderConfiguration::default()
    };
    ShardedSampler::builder()
        .dataset_len(n)
        .batch_size(bs)
        .drop_last(drop_last)
        .world_size(world)
        .rank(rank)
        .shuffle(seed.is_some())
        .config(config)
        .build()
        .unwrap()
}

pub fn inner_batches(order: &[u64], bs: usize, drop_last: bool) -> Vec<Vec<u64>> {
    order.chunks(bs).filter(|c| !drop_last || c.len() == bs).map(<[u64]>::to_vec).collect()
}

pub fn wsum(v: &[u64]) -> u64 {
    v.iter().enumerate().fold(0u64, |acc, (i, &x)| acc.wrapping_add(x.wrapping_mul(i as u64 + 1)))
}
