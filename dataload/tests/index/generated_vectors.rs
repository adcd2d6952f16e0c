//! Vectors written by real accelerate 1.15 + torch 2.13 over random configurations
//! (fixtures/gen/dataload_vectors.py).
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{b, batches, fixture, inner_batches, loader, seed, u};
use dataload::{
    base_batches, gather_for_metrics, shard_batches, DataLoaderConfiguration, DatasetKind, Dispatcher, InProcessGroup,
    IterableDatasetShard, LoaderShape, ShardMode, ShardParams,
};

#[test]
fn batch_shard_vectors() {
    let fx = fixture("batch_shard.json").unwrap();
    assert!(fx["accelerate"].as_str().unwrap().starts_with("1.15"));
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() >= 100);
    for c in cases {
        let (n, bs, world) = (u(&c["n"]), u(&c["batch_size"]), u(&c["world_size"]));
        let (split, even, dl) = (b(&c["split_batches"]), b(&c["even_batches"]), b(&c["drop_last"]));
        let s = c["seed"].is_number().then(|| seed(&c["seed"]));
        for rank in 0..world {
            let want = &c["ranks"][rank as usize];
            let mut l = loader(n, bs, dl, world, rank, split, even, false, s);
            for epoch in 0..2u64 {
                let expected = batches(&want["epochs"][epoch as usize]);
                // The batch-by-batch reference over the same epoch order.
                let order = l.order(epoch).unwrap().range(0, n);
                let params = ShardParams {
                    batch_size: Some(bs as usize),
                    drop_last: dl,
                    world_size: world as usize,
                    rank: rank as usize,
                    split_batches: split,
                    even_batches: even,
                };
                let inner = inner_batches(&order, bs as usize, dl);
                if world > 1 {
                    assert_eq!(shard_batches(&inner, params).unwrap(), expected, "{c}");
                }
                assert_eq!(l.epoch(), epoch);
                assert_eq!(l.len().unwrap(), expected.len() as u64, "true len {c}");
                assert_eq!(l.rest_of_epoch().unwrap(), expected, "epoch {epoch} {c}");
            }
            // accelerate's own len() (the quirky one).
            assert_eq!(l.plan_for_epoch(2).unwrap().accelerate_len(rank), u(&want["len"]), "{c}");
            assert_eq!(l.epoch(), 2);
            l.skip_first_batches(u(&c["skip"]));
            assert_eq!(l.rest_of_epoch().unwrap(), batches(&want["skipped_epoch2"]), "{c}");
        }
    }
}

#[test]
fn iterable_shard_vectors() {
    let fx = fixture("iterable_shard.json").unwrap();
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() >= 50);
    for c in cases {
        let (n, bs, world) = (u(&c["n"]) as usize, u(&c["batch_size"]) as usize, u(&c["world_size"]) as usize);
        let (split, dl) = (b(&c["split_batches"]), b(&c["drop_last"]));
        for rank in 0..world {
            let want = &c["ranks"][rank];
            let expected: Vec<u64> = serde_json::from_value(want["items"].clone()).unwrap();
            let got: Vec<u64> = IterableDatasetShard::new(0..n as u64, bs, dl, world, rank, split).unwrap().collect();
            assert_eq!(got, expected, "{c}");
            let true_len =
                IterableDatasetShard::<std::ops::Range<u64>>::len_for(n, bs, dl, world, rank, split).unwrap();
            assert_eq!(true_len, expected.len(), "{c}");
            assert_eq!(
                IterableDatasetShard::<std::ops::Range<u64>>::accelerate_len(n, bs, dl, world) as u64,
                u(&want["len"]),
                "{c}"
            );
        }
    }
}

#[test]
fn configuration_defaults_and_refusals() {
    let fx = fixture("config.json").unwrap();
    let ours = serde_json::to_value(DataLoaderConfiguration::default()).unwrap();
    assert_eq!(ours, fx["defaults"]);
    let probes = fx["probes"].as_array().unwrap();
    assert!(probes.len() >= 100);
    for p in probes {
        let config = DataLoaderConfiguration {
            split_batches: b(&p["split_batches"]),
            dispatch_batches: p["dispatch_batches"].as_bool(),
            ..DataLoaderConfiguration::default()
        };
        let shape = LoaderShape {
            dataset: if p["dataset"] == "map" { DatasetKind::Map } else { DatasetKind::Iterable },
            batch_size: Some(u(&p["batch_size"]) as usize),
            world_size: u(&p["world_size"]) as usize,
            put_on_device: b(&p["put_on_device"]),
        };
        let got = config.resolve(shape);
        assert_eq!(got.is_err(), b(&p["refused"]), "{p}");
        if let Ok(mode) = got {
            let want = if p["mode"] == "dispatch" { ShardMode::Dispatch } else { ShardMode::PerRank };
            assert_eq!(mode, want, "{p}");
        }
    }
}

#[test]
fn dispatch_vectors() {
    let Some(fx) = fixture("dispatch.json") else {
        panic!("fixtures/dataload/dispatch.json is missing: run fixtures/gen/dataload_vectors.py");
    };
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() >= 40);
    for c in cases {
        let (n, bs, world) = (u(&c["n"]), u(&c["batch_size"]), u(&c["world_size"]));
        let (split, dl) = (b(&c["split_batches"]), b(&c["drop_last"]));
        let s = c["seed"].is_number().then(|| seed(&c["seed"]));
        // Closed form, rank by rank.
        for rank in 0..world {
            let want = &c["ranks"][rank as usize];
            let mut l = loader(n, bs, dl, world, rank, split, true, true, s);
            for epoch in 0..2usize {
                let steps = want["epochs"][epoch].as_array().unwrap();
                let plan = l.current_plan().unwrap().clone();
                assert_eq!(plan.num_steps(), steps.len() as u64, "{c}");
                for (t, step) in steps.iter().enumerate() {
                    let last = t + 1 == steps.len();
                    assert_eq!(b(&step["end"]), last, "{c}");
                    if last {
                        assert_eq!(Some(u(&step["remainder"])), plan.remainder(), "{c}");
                    }
                }
                let rows: Vec<Vec<u64>> = steps.iter().map(|st| row(&st["rows"])).collect();
                assert_eq!(l.rest_of_epoch().unwrap(), rows, "epoch {epoch} {c}");
            }
            assert_eq!(l.plan_for_epoch(2).unwrap().accelerate_len(rank), u(&want["len"]), "{c}");
            l.skip_first_batches(u(&c["skip"]));
            assert_eq!(l.rest_of_epoch().unwrap(), batches(&want["skipped_epoch2"]), "{c}");
        }
        // The communicating dispatcher, threads as ranks, epoch 0, with gather_for_metrics.
        let probe = loader(n, bs, dl, world, 0, split, true, true, s);
        let order = probe.order(0).unwrap();
        let comms = InProcessGroup::new(world);
        std::thread::scope(|scope| {
            for comm in comms {
                let order = order.clone();
                let c = &c;
                scope.spawn(move || {
                    use dataload::Collective;
                    let rank = comm.rank();
                    let source = (rank == 0)
                        .then(|| Box::new(base_batches(order, bs, dl)) as Box<dyn Iterator<Item = Vec<u64>>>);
                    let mut d = Dispatcher::new(&comm, source, split, dl, 0);
                    let steps = c["ranks"][rank as usize]["epochs"][0].as_array().unwrap();
                    for step in steps {
                        let got = d.next_batch().unwrap().unwrap();
                        assert_eq!(got.rows, row(&step["rows"]), "{c}");
                        assert_eq!(got.end_of_dataloader, b(&step["end"]));
                        if got.end_of_dataloader {
                            assert_eq!(got.remainder, Some(u(&step["remainder"])));
                        }
                        let g = gather_for_metrics(&comm, &got.rows, got.end_of_dataloader, got.remainder).unwrap();
                        if step["gathered"].is_array() {
                            assert_eq!(g, row(&step["gathered"]), "gather {c}");
                        }
                    }
                    assert!(d.next_batch().unwrap().is_none());
                });
            }
        });
    }
}

fn row(v: &serde_json::Value) -> Vec<u64> {
    serde_json::from_value(v.clone()).unwrap()
}
