//! accelerate's default shuffle: torch's `RandomSampler` drawing each epoch from a running
//! generator ([`SamplerSpec::Random`]). Properties: each epoch is the next `randperm` of one
//! generator; a state saved after any batch (epochs crossed included) resumes the rest of
//! the run exactly, on every rank, without replaying; N → M ranks hands out the rest of the
//! epoch once and then runs as a fresh M-rank loader would.
#![allow(clippy::unwrap_used)]

use dataload::{
    randperm, DataLoaderConfiguration, EpochPlan, LoaderState, SamplerSpec, ShardedSampler, TorchGenerator,
    TorchVersion,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Cfg {
    n: u64,
    bs: u64,
    world: u64,
    split: bool,
    even: bool,
    drop_last: bool,
    seed: u64,
    /// Draws taken from the generator before the loader sees it (a user's generator in use).
    warm: usize,
}

impl Cfg {
    fn generator(&self) -> TorchGenerator {
        let mut g = TorchGenerator::manual_seed(self.seed);
        for _ in 0..self.warm {
            g.next_u32();
        }
        g
    }

    fn loader(&self, world: u64, rank: u64) -> ShardedSampler {
        let config = DataLoaderConfiguration {
            split_batches: self.split,
            even_batches: self.even,
            dispatch_batches: Some(false),
            ..DataLoaderConfiguration::default()
        };
        ShardedSampler::builder()
            .dataset_len(self.n)
            .batch_size(self.bs)
            .drop_last(self.drop_last)
            .world_size(world)
            .rank(rank)
            .shuffle(true)
            .generator(self.generator())
            .config(config)
            .build()
            .unwrap()
    }
}

fn cfg() -> impl Strategy<Value = Cfg> {
    (0u64..60, 1u64..5, 1u64..4, any::<bool>(), any::<bool>(), any::<bool>(), any::<u64>(), 0usize..1400).prop_map(
        |(n, bs, world, split, even, drop_last, seed, warm)| {
            let bs = if split { bs * world } else { bs };
            Cfg { n, bs, world, split, even, drop_last, seed, warm }
        },
    )
}

fn run(l: &mut ShardedSampler, calls: usize) -> Vec<Option<Vec<u64>>> {
    (0..calls).map(|_| l.next_batch().unwrap()).collect()
}

fn calls_for(c: &Cfg, epochs: u64) -> usize {
    (c.loader(c.world, 0).epoch_len() as usize + 1) * epochs as usize
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Epoch e is drawn from the one generator after the epochs before it, each of which took
    /// two permutations' draws (torch's RandomSampler read to its end evaluates a second,
    /// empty, `randperm`), cut as any epoch is.
    #[test]
    fn epochs_are_consecutive_draws(c in cfg()) {
        let g = c.generator();
        for rank in 0..c.world {
            let mut l = c.loader(c.world, rank);
            let mut g = g.clone();
            for _ in 0..3 {
                let order = randperm(c.n, &mut g, TorchVersion::default()).unwrap();
                let plan = EpochPlan::new(dataload::EpochOrder::Shuffled(order.into()), *l.geometry(), 0, 0);
                let expected: Vec<Vec<u64>> =
                    (0..plan.num_steps()).filter_map(|t| plan.rank_batch(t, rank)).collect();
                prop_assert_eq!(l.rest_of_epoch().unwrap(), expected);
                // torch's RandomSampler, read to its end, draws a second permutation
                randperm(c.n, &mut g, TorchVersion::default()).unwrap();
            }
            prop_assert_eq!(l.running_generator().unwrap().unwrap(), g);
        }
    }

    /// Saving after any number of calls and loading the JSON into a fresh loader yields the
    /// rest of the uninterrupted run, generator included, on every rank.
    #[test]
    fn resume_equals_uninterrupted(c in cfg(), cut_frac in 0.0f64..1.0) {
        let total = calls_for(&c, 3);
        let cut = ((total as f64) * cut_frac) as usize;
        let mut saver = c.loader(c.world, 0);
        run(&mut saver, cut);
        let state = LoaderState::from_json(&saver.state_dict().to_json().unwrap()).unwrap();
        prop_assert_eq!(state.sampler, SamplerSpec::Random);
        let lockstep = c.drop_last || (c.even && c.world > 1);
        for rank in 0..c.world {
            if rank > 0 && !lockstep {
                break;
            }
            let mut full = c.loader(c.world, rank);
            let all = run(&mut full, total);
            // Built from the state alone: the generator it started from is not needed.
            let mut resumed = ShardedSampler::from_state(&state, c.world, rank).unwrap();
            let rest = run(&mut resumed, total - cut);
            prop_assert_eq!(&rest[..], &all[cut..]);
            prop_assert_eq!(resumed.running_generator().unwrap(), full.running_generator().unwrap());
        }
    }

    /// N ranks → M ranks mid-epoch: the rest of the epoch's order is handed out once, and the
    /// next epoch is the next draw of the generator, cut for M ranks.
    #[test]
    fn elastic_resume(c in cfg(), m in 1u64..5, cut_frac in 0.0f64..1.0) {
        prop_assume!(!c.split || c.bs % m == 0);
        let mut saver = c.loader(c.world, 0);
        let steps = saver.current_plan().unwrap().num_steps();
        let cut = ((steps as f64) * cut_frac) as u64;
        for _ in 0..cut {
            saver.next_batch().unwrap();
        }
        let state = saver.state_dict();
        let order = saver.order(0).unwrap().range(0, c.n);
        let mut loaders: Vec<ShardedSampler> =
            (0..m).map(|r| ShardedSampler::from_state(&state, m, r).unwrap()).collect();
        let per_rank: Vec<Vec<Vec<u64>>> = loaders.iter_mut().map(|l| l.rest_of_epoch().unwrap()).collect();
        let g = loaders[0].geometry().global_batch();
        let remaining = c.n - state.cursor;
        let steps_m = if c.drop_last { remaining / g } else { remaining.div_ceil(g) };
        let mut stream = Vec::new();
        for t in 0..steps_m as usize {
            for r in &per_rank {
                if let Some(b) = r.get(t) {
                    stream.extend_from_slice(b);
                }
            }
        }
        let real_end = if c.drop_last { state.cursor + steps_m * g } else { c.n };
        let real = &order[state.cursor as usize..real_end as usize];
        prop_assert!(stream.len() >= real.len());
        prop_assert_eq!(&stream[..real.len()], real);
        for (r, l) in loaders.iter_mut().enumerate() {
            let mut fresh = c.loader(m, r as u64);
            fresh.rest_of_epoch().unwrap();
            prop_assert_eq!(l.rest_of_epoch().unwrap(), fresh.rest_of_epoch().unwrap());
        }
    }
}

fn small(world: u64, rank: u64, g: TorchGenerator) -> ShardedSampler {
    ShardedSampler::builder()
        .dataset_len(10)
        .batch_size(2)
        .world_size(world)
        .rank(rank)
        .shuffle(true)
        .generator(g)
        .build()
        .unwrap()
}

/// A caller's generator replaces the running state until the epoch is drawn, never after.
#[test]
fn the_generator_is_set_until_the_epoch_is_drawn() {
    let mut l = small(2, 0, TorchGenerator::manual_seed(1));
    assert!(l.needs_generator());
    l.set_generator(TorchGenerator::manual_seed(2)).unwrap();
    let first = l.next_batch().unwrap().unwrap();
    assert!(!l.needs_generator());
    assert_eq!(
        l.set_generator(TorchGenerator::manual_seed(3)).unwrap_err().to_string(),
        "invalid `generator`: for a random (a running torch generator) sampler (the current epoch's permutation is already drawn)"
    );
    let mut g = TorchGenerator::manual_seed(2);
    let perm = randperm(10, &mut g, TorchVersion::default()).unwrap();
    assert_eq!(first, vec![perm.get(0).unwrap(), perm.get(1).unwrap()]);
    assert_eq!(l.running_generator().unwrap().unwrap(), g);
    // A state saved mid-epoch holds the generator the epoch was drawn from.
    let state = l.state_dict();
    let saved = state.generator.clone().unwrap();
    assert!(saved.drawn);
    assert_eq!(saved.state, TorchGenerator::manual_seed(2));
    l.rest_of_epoch().unwrap();
    // At the start of the next epoch: the running state, not drawn yet, past the second
    // permutation torch's RandomSampler draws when it is read to its end.
    let next = l.state_dict().generator.unwrap();
    assert!(!next.drawn);
    randperm(10, &mut g, TorchVersion::default()).unwrap();
    assert_eq!(next.state, g);
    let seeded = ShardedSampler::builder().dataset_len(4).batch_size(2).world_size(1).build().unwrap();
    let mut seq = seeded.clone();
    assert!(seq
        .set_generator(TorchGenerator::manual_seed(0))
        .unwrap_err()
        .to_string()
        .contains("only a `random` sampler"));
    assert_eq!(seq.running_generator().unwrap(), None);
}

/// Hostile and inconsistent states are refused by name.
#[test]
fn generator_states_are_checked() {
    let good = small(2, 0, TorchGenerator::manual_seed(9)).state_dict().to_json().unwrap();
    let err = |text: &str| LoaderState::from_json(text).unwrap_err().to_string();
    let v: serde_json::Value = serde_json::from_str(&good).unwrap();
    let hex = v["generator"]["state"].as_str().unwrap().to_owned();
    assert_eq!(hex.len(), 2 * dataload::GENERATOR_STATE_BYTES);
    assert!(err(&good.replace(&hex, "abcd")).contains("`generator` must be 10112 hex digits"));
    assert!(err(&good.replace(&hex, &hex.to_uppercase())).contains("not a lowercase hex digit"));
    // `left` (bytes 8..12) set to 0, which torch's `set_state` refuses.
    let zero_left = format!("{}00000000{}", &hex[..16], &hex[24..]);
    assert!(err(&good.replace(&hex, &zero_left)).contains("`left` must be in 1..=624"));
    let mut no_gen = v.clone();
    no_gen.as_object_mut().unwrap().remove("generator");
    assert_eq!(err(&no_gen.to_string()), "inconsistent loader state: a `random` sampler needs its `generator`");
    let mut seq = v.clone();
    seq["sampler"] = serde_json::json!({"kind": "sequential"});
    assert_eq!(err(&seq.to_string()), "inconsistent loader state: a sequential sampler has no `generator`");
}

/// Without a generator a `random` sampler cannot be built.
#[test]
fn builder_refusals() {
    let base = || ShardedSampler::builder().dataset_len(10).batch_size(2).world_size(2).shuffle(true);
    assert_eq!(base().build().unwrap_err().to_string(), "missing `generator`: set it on the builder before `build()`");
}

/// `randperm(n)` drawn from `g`, as a vector.
fn perm(n: u64, g: &mut TorchGenerator) -> Vec<u64> {
    let p = randperm(n, g, TorchVersion::default()).unwrap();
    (0..n).map(|i| p.get(i).unwrap()).collect()
}

/// Dispatched, every rank given rank 0's generator cuts its slice of the one order rank 0
/// draws: together the ranks' rows of each step are rank 0's underlying batches, in order.
#[test]
fn a_dispatched_random_sampler_slices_rank_zeros_order() {
    let (n, bs, world) = (23u64, 3u64, 2u64);
    let dispatch = DataLoaderConfiguration { dispatch_batches: Some(true), ..Default::default() };
    let mut g = TorchGenerator::manual_seed(5);
    let mut loaders: Vec<ShardedSampler> = (0..world)
        .map(|r| {
            let b = ShardedSampler::builder().dataset_len(n).batch_size(bs).world_size(world).rank(r).shuffle(true);
            b.config(dispatch).generator(TorchGenerator::manual_seed(100 + r)).build().unwrap()
        })
        .collect();
    for _epoch in 0..2 {
        let order = perm(n, &mut g.clone());
        for l in &mut loaders {
            l.set_generator(g.clone()).unwrap();
        }
        let per_rank: Vec<Vec<Vec<u64>>> = loaders.iter_mut().map(|l| l.rest_of_epoch().unwrap()).collect();
        let joined: Vec<u64> =
            (0..per_rank[0].len()).flat_map(|s| per_rank.iter().flat_map(move |b| b[s].clone())).collect();
        assert_eq!(&joined[..n as usize], &order[..]);
        // The running generator moves on by the epoch's two permutations' draws, on every rank.
        for _ in 0..2 {
            randperm(n, &mut g, TorchVersion::default()).unwrap();
        }
        for l in &mut loaders {
            assert_eq!(l.running_generator().unwrap().unwrap(), g);
        }
    }
}

/// A pass broken off and begun again draws a new order from the running generator (the
/// broken-off pass's draw taken), in the same epoch; an order that follows from the epoch
/// (the seedable sampler's) starts again unchanged.
#[test]
fn a_restarted_pass_draws_anew_from_the_running_generator() {
    let mut g = TorchGenerator::manual_seed(9);
    let builder = ShardedSampler::builder().dataset_len(10).batch_size(2).world_size(1).shuffle(true);
    let mut l = builder.generator(g.clone()).build().unwrap();
    let first = perm(10, &mut g);
    assert_eq!(l.next_batch().unwrap().unwrap(), first[..2].to_vec());
    l.restart_epoch().unwrap();
    assert_eq!(l.epoch(), 0);
    let second = perm(10, &mut g);
    assert_ne!(first, second);
    assert_eq!(l.rest_of_epoch().unwrap().concat(), second);

    let seeded = DataLoaderConfiguration { use_seedable_sampler: true, data_seed: Some(3), ..Default::default() };
    let builder = ShardedSampler::builder().dataset_len(10).batch_size(2).world_size(1).shuffle(true);
    let mut s = builder.config(seeded).build().unwrap();
    let whole = s.clone().rest_of_epoch().unwrap();
    s.next_batch().unwrap();
    s.restart_epoch().unwrap();
    assert_eq!(s.rest_of_epoch().unwrap(), whole);
}
