//! The prefetching loader: the same batches and states with 0, 1, 2 and 4 workers; a state
//! taken while batches are read ahead resumes at the first batch not handed out; resuming on
//! changed data is refused.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use dataload::{
    DataLoader, DataLoaderConfiguration, DataloadError, Fingerprint, LoaderState, ParquetDataset, Result,
    ShardedSampler, ShardedSamplerBuilder, Source, TokenDtype, TokenWindows,
};
use proptest::prelude::*;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/dataload_sources")
}

fn sampler(batch: u64, world: u64, rank: u64, shuffle: bool) -> ShardedSamplerBuilder {
    let config = DataLoaderConfiguration {
        data_seed: Some(1234),
        use_seedable_sampler: true,
        ..DataLoaderConfiguration::default()
    };
    ShardedSampler::builder().batch_size(batch).world_size(world).rank(rank).shuffle(shuffle).config(config)
}

/// Every item of `epochs` epochs: batches (mapped by `f`) and `None` at each epoch end, with
/// the state after each.
fn drain<S: Source, T>(
    loader: &mut DataLoader<S>,
    epochs: u64,
    f: impl Fn(S::Batch) -> T,
) -> Vec<(Option<T>, LoaderState)> {
    let mut out = Vec::new();
    let mut ends = 0;
    while ends < epochs {
        let item = loader.next_batch().unwrap().map(&f);
        ends += u64::from(item.is_none());
        out.push((item, loader.state_dict()));
    }
    out
}

#[test]
fn token_windows_same_order_and_state_for_0_1_2_4_workers() {
    let source = Arc::new(TokenWindows::open(fixtures().join("token_shards"), 16, TokenDtype::U16).unwrap());
    let run = |workers| {
        let mut loader =
            DataLoader::builder(source.clone(), sampler(4, 2, 1, true)).workers(workers).prefetch(3).build().unwrap();
        drain(&mut loader, 2, |b| b.inputs)
    };
    let reference = run(0);
    assert_eq!(reference.len(), 2 * (36usize.div_ceil(8) + 1));
    // The batches are the sampler's indices, read.
    let mut plain = sampler(4, 2, 1, true).dataset_len(36).fingerprint(source.fingerprint().id()).build().unwrap();
    let first = plain.next_batch().unwrap().unwrap();
    assert_eq!(reference[0].0.as_ref().unwrap(), &source.read_batch(&first).unwrap().inputs);
    for workers in [1, 2, 4] {
        assert_eq!(run(workers), reference, "{workers} workers");
    }
}

#[test]
fn parquet_rows_same_order_for_0_1_2_4_workers() {
    let source = Arc::new(ParquetDataset::open(fixtures().join("parquet_shards"), None, 2).unwrap());
    let run = |workers| {
        let mut loader = DataLoader::builder(source.clone(), sampler(16, 1, 0, true)).workers(workers).build().unwrap();
        drain(&mut loader, 1, |b| b)
    };
    let reference = run(0);
    assert_eq!(reference.iter().filter_map(|(b, _)| b.as_ref()).map(|b| b.num_rows()).sum::<usize>(), 130);
    for workers in [1, 2, 4] {
        assert_eq!(run(workers), reference, "{workers} workers");
    }
}

#[test]
fn resuming_on_changed_data_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["shard_000.npy", "shard_001.npy", "shard_002.npy"] {
        std::fs::copy(fixtures().join("token_shards").join(f), tmp.path().join(f)).unwrap();
    }
    let source = Arc::new(TokenWindows::open(tmp.path(), 16, TokenDtype::U16).unwrap());
    let mut loader = DataLoader::builder(source.clone(), sampler(4, 1, 0, false)).workers(2).build().unwrap();
    loader.next_batch().unwrap().unwrap();
    let state = loader.state_dict();
    assert_eq!(state.fingerprint.as_deref(), Some(source.fingerprint().id().as_str()));
    std::fs::remove_file(tmp.path().join("shard_001.npy")).unwrap();
    let changed = Arc::new(TokenWindows::open(tmp.path(), 16, TokenDtype::U16).unwrap());
    let err = DataLoader::resume(changed.clone(), state.clone(), 1, 0).build().unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "the data changed since this loader state was saved: its fingerprint was `{}`, it is `{}` now\n\
             hint: resume on the files the state was saved with, or start the loader without the state",
            source.fingerprint().id(),
            changed.fingerprint().id()
        )
    );
    let mut other = DataLoader::builder(changed, sampler(4, 1, 0, false)).build().unwrap();
    assert!(matches!(other.load_state_dict(&state), Err(DataloadError::DataChanged { .. })));
}

/// Batches are their indices; index `bad` fails to read.
#[derive(Debug)]
struct Echo {
    len: u64,
    bad: Option<u64>,
    fingerprint: Fingerprint,
}

impl Echo {
    fn new(len: u64, bad: Option<u64>) -> Arc<Self> {
        Arc::new(Self { len, bad, fingerprint: Fingerprint { format: "echo", options: String::new(), files: vec![] } })
    }
}

impl Source for Echo {
    type Batch = Vec<u64>;
    fn len(&self) -> u64 {
        self.len
    }
    fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }
    fn read_batch(&self, indices: &[u64]) -> Result<Vec<u64>> {
        if let Some(i) = indices.iter().find(|&&i| Some(i) == self.bad) {
            return Err(DataloadError::IndexOutOfRange { index: *i, len: self.len });
        }
        Ok(indices.to_vec())
    }
}

#[test]
fn a_failed_batch_is_an_error_in_its_place() {
    let source = Echo::new(10, Some(5));
    let mut loader = DataLoader::builder(source, sampler(2, 1, 0, false)).workers(2).build().unwrap();
    assert_eq!(loader.next_batch().unwrap(), Some(vec![0, 1]));
    assert_eq!(loader.next_batch().unwrap(), Some(vec![2, 3]));
    assert_eq!(loader.next_batch().unwrap_err(), DataloadError::IndexOutOfRange { index: 5, len: 10 });
    assert_eq!(loader.next_batch().unwrap(), Some(vec![6, 7]));
    assert_eq!(loader.state_dict().cursor, 8);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn mid_epoch_state_with_prefetch_resumes_at_the_next_unconsumed_batch(
        len in 1u64..60,
        batch in 1u64..6,
        world in 1u64..4,
        rank_seed in 0u64..4,
        shuffle in any::<bool>(),
        workers in 0usize..5,
        prefetch in 1usize..7,
        consumed in 0usize..40,
        resume_workers in 0usize..3,
    ) {
        let rank = rank_seed % world;
        let source = Echo::new(len, None);
        let mut whole = DataLoader::builder(source.clone(), sampler(batch, world, rank, shuffle)).build().unwrap();
        let reference = drain(&mut whole, 2, |b| b);
        let k = consumed.min(reference.len() - 1);

        let mut loader = DataLoader::builder(source.clone(), sampler(batch, world, rank, shuffle))
            .workers(workers)
            .prefetch(prefetch)
            .build()
            .unwrap();
        for item in &reference[..k] {
            prop_assert_eq!(&loader.next_batch().unwrap(), &item.0);
        }
        let state = loader.state_dict();
        let before = if k == 0 { None } else { Some(reference[k - 1].1.clone()) };
        if let Some(s) = before {
            prop_assert_eq!(&state, &s);
        }
        let text = state.to_json().unwrap();
        let mut resumed = DataLoader::resume(source, LoaderState::from_json(&text).unwrap(), world, rank)
            .workers(resume_workers)
            .build()
            .unwrap();
        // The rest of the current epoch (and the whole next one) is what the uninterrupted run got.
        let mut expect = reference[k..].iter();
        let mut ends = 0u64;
        let epochs_left = reference[k..].iter().filter(|(b, _)| b.is_none()).count() as u64;
        while ends < epochs_left {
            let got = resumed.next_batch().unwrap();
            let want = expect.next().unwrap();
            prop_assert_eq!(&got, &want.0);
            prop_assert_eq!(&resumed.state_dict(), &want.1);
            ends += u64::from(got.is_none());
        }
    }
}
