//! torch's generator and randperm against vectors written by real torch 2.13
//! (fixtures/gen/dataload_vectors.py).
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{fixture, seed, u, wsum};
use dataload::{randperm, TorchGenerator, TorchVersion};

fn torch_seed(v: &serde_json::Value) -> u64 {
    // Python's manual_seed reinterprets negatives as two's complement.
    seed(v) as u64
}

#[test]
fn generator_matches_torch() {
    let fx = fixture("torch_rng.json").unwrap();
    assert!(fx["torch"].as_str().unwrap().starts_with("2.13"));
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for c in cases {
        let mut g = TorchGenerator::manual_seed(torch_seed(&c["seed"]));
        assert_eq!(g.initial_seed(), u(&c["initial_seed"]));
        let count = u(&c["count"]) as usize;
        let draws: Vec<u64> = (0..count).map(|_| g.next_u64() % (1u64 << 63)).collect();
        let want: Vec<u64> = serde_json::from_value(c["u64_mod_2_63"].clone()).unwrap();
        let mut got = draws[..8].to_vec();
        got.extend_from_slice(&draws[count - 4..]);
        assert_eq!(got, want, "seed {}", c["seed"]);
    }
}

#[test]
fn small_randperm_matches_torch() {
    let fx = fixture("randperm.json").unwrap();
    let cases = fx["small"].as_array().unwrap();
    assert!(cases.len() >= 100);
    for c in cases {
        let mut g = TorchGenerator::manual_seed(torch_seed(&c["seed"]));
        let p = randperm(u(&c["n"]), &mut g, TorchVersion::Torch2_6Plus).unwrap();
        let want: Vec<u64> = serde_json::from_value(c["perm"].clone()).unwrap();
        assert_eq!(p.to_vec(), want, "n {} seed {}", c["n"], c["seed"]);
    }
}

fn check_checksums(cases: &[serde_json::Value]) {
    for c in cases {
        let n = u(&c["n"]);
        let mut g = TorchGenerator::manual_seed(torch_seed(&c["seed"]));
        let p = randperm(n, &mut g, TorchVersion::Torch2_6Plus).unwrap().to_vec();
        let head: Vec<u64> = serde_json::from_value(c["head"].clone()).unwrap();
        let tail: Vec<u64> = serde_json::from_value(c["tail"].clone()).unwrap();
        assert_eq!(&p[..4], &head[..], "n {n}");
        assert_eq!(&p[p.len() - 2..], &tail[..], "n {n}");
        assert_eq!(wsum(&p), u(&c["wsum"]), "n {n}");
    }
}

#[test]
fn medium_randperm_matches_torch() {
    let fx = fixture("randperm.json").unwrap();
    let cases = fx["medium"].as_array().unwrap();
    // The 10^6 cases run in `large_randperm_matches_torch`.
    let quick: Vec<_> = cases.iter().filter(|c| u(&c["n"]) <= 100_003).cloned().collect();
    assert!(quick.len() >= 6);
    check_checksums(&quick);
}

/// Both sides of torch ≥ 2.6's algorithm switch (n = 214_748_363 / 214_748_364) and beyond.
/// Needs ~2 GB; about a minute, since the workspace builds `dataload` optimized even for tests.
#[test]
fn large_randperm_matches_torch() {
    let fx = fixture("randperm_large.json").expect("run fixtures/gen/dataload_vectors.py");
    check_checksums(fx["cases"].as_array().unwrap());
    check_checksums(fixture("randperm.json").unwrap()["medium"].as_array().unwrap());
}
