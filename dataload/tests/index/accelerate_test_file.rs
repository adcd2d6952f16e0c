//! The expected lists of accelerate's `tests/test_data_loader.py`, kept as data in
//! fixtures/dataload/accelerate_test_data_loader.json, against both the batch-by-batch
//! reference and the closed form.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{b, batches, fixture, inner_batches, loader, u};
use dataload::{
    accelerate_shard_len, base_batches, shard_batches, DataloadError, Dispatcher, EpochOrder, InProcessGroup,
    ShardParams,
};

#[test]
fn batch_sampler_shards() {
    let fx = fixture("accelerate_test_data_loader.json").unwrap();
    let cases = fx["batch_sampler_shards"].as_array().unwrap();
    assert_eq!(cases.len(), 36);
    for c in cases {
        let (n, bs, dl) = (u(&c["n"]), u(&c["batch_size"]), b(&c["drop_last"]));
        let (split, even) = (b(&c["split_batches"]), b(&c["even_batches"]));
        let order: Vec<u64> = (0..n).collect();
        let inner = inner_batches(&order, bs as usize, dl);
        for rank in 0..2u64 {
            let expected = batches(&c["expected"][rank as usize]);
            let params = ShardParams {
                batch_size: Some(bs as usize),
                drop_last: dl,
                world_size: 2,
                rank: rank as usize,
                split_batches: split,
                even_batches: even,
            };
            assert_eq!(shard_batches(&inner, params).unwrap(), expected, "{c}");
            let mut l = loader(n, bs, dl, 2, rank, split, even, false, None);
            assert_eq!(l.len().unwrap(), expected.len() as u64, "{c}");
            assert_eq!(l.rest_of_epoch().unwrap(), expected, "{c}");
            if let Some(len) = c["len"].as_array() {
                let want = u(&len[rank as usize]);
                assert_eq!(accelerate_shard_len(inner.len(), params).unwrap() as u64, want);
                assert_eq!(l.plan_for_epoch(0).unwrap().accelerate_len(rank), want);
            }
        }
    }
}

#[test]
fn varying_batch_sizes() {
    let fx = fixture("accelerate_test_data_loader.json").unwrap();
    let cases = fx["varying_batch_sizes"].as_array().unwrap();
    assert_eq!(cases.len(), 8);
    for c in cases {
        let inner = batches(&c["inner"]);
        let world = u(&c["world_size"]) as usize;
        for rank in 0..world {
            let params = ShardParams {
                batch_size: None,
                drop_last: b(&c["drop_last"]),
                world_size: world,
                rank,
                split_batches: false,
                even_batches: b(&c["even_batches"]),
            };
            assert_eq!(shard_batches(&inner, params).unwrap(), batches(&c["expected"][rank]), "{c}");
            if let Some(len) = c["len"].as_array() {
                assert_eq!(accelerate_shard_len(inner.len(), params).unwrap() as u64, u(&len[rank]));
            }
        }
    }
}

#[test]
fn split_refusals() {
    let dynamic = ShardParams {
        batch_size: None,
        drop_last: false,
        world_size: 2,
        rank: 0,
        split_batches: true,
        even_batches: true,
    };
    let inner = vec![vec![0u64, 1], vec![2]];
    assert_eq!(shard_batches(&inner, dynamic), Err(DataloadError::SplitNeedsBatchSize));
    let three = ShardParams { batch_size: Some(3), ..dynamic };
    let err = shard_batches(&inner, three).unwrap_err();
    assert_eq!(
        err.to_string(),
        "`split_batches` needs the batch size (3) to be a round multiple of the number of processes (2)"
    );
}

#[test]
fn skip_first_batches() {
    let fx = fixture("accelerate_test_data_loader.json").unwrap();
    for c in fx["skip_first_batches"].as_array().unwrap() {
        let mut l = loader(u(&c["n"]), u(&c["batch_size"]), false, 1, 0, false, true, false, None);
        l.skip_first_batches(u(&c["skip"]));
        assert_eq!(l.rest_of_epoch().unwrap(), batches(&c["expected"]));
    }
}

#[test]
fn end_of_dataloader_only_on_last_batch() {
    let fx = fixture("accelerate_test_data_loader.json").unwrap();
    let c = &fx["end_of_dataloader"][0];
    let (n, bs) = (u(&c["n"]), u(&c["batch_size"]));
    let comm = InProcessGroup::new(1).pop().unwrap();
    for _ in 0..u(&c["passes"]) {
        let source = base_batches(EpochOrder::Sequential { len: n }, bs, false);
        let got = Dispatcher::new(&comm, Some(Box::new(source)), false, false, 0).collect_all().unwrap();
        let ends: Vec<usize> = got.iter().enumerate().filter(|(_, x)| x.end_of_dataloader).map(|(i, _)| i).collect();
        assert_eq!(ends, vec![u(&c["end_at"]) as usize]);
    }
}
