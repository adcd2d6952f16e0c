//! `DTensorLayout` against real torch 2.13.
//!
//! `fixtures/fsdp_state/dtensor_layouts.json` was written by `fixtures/gen/dtensor_layouts.py`.
//! For every (shape, mesh, placements) case and every mesh coordinate it holds torch's own local
//! shape and global offset (`_compute_local_shape_and_global_offset`, the function DCP builds
//! chunk metadata with) and what torch's own split of an index-coded tensor really leaves on the
//! rank (`holds`: runs of global indices per tensor dim, `null` when it holds nothing). The
//! `distributed` cases are the same under `torchrun` with a real `DeviceMesh` and
//! `distribute_tensor`; `fsdp2_tp` is `parallelize_module` + `fully_shard` on (dp, tp) and
//! (replicate, shard, tp) meshes. Each case builds a `DTensorLayout` from the shape, the mesh and
//! the placements' reprs alone and requires the same answers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use fsdp_state::{check_tiling, Block, DTensorLayout, Placement, Region};
use serde_json::Value;

fn fixture() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/fsdp_state/dtensor_layouts.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(json["tool"], "torch 2.13.0");
    json
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap_or_else(|| panic!("not a list: {v}")).iter().map(|x| x.as_u64().unwrap()).collect()
}

fn placements(v: &Value) -> Vec<Placement> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let text = p.as_str().unwrap();
            let placement = Placement::parse(text).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(placement.to_string(), text, "torch's repr round-trips");
            placement
        })
        .collect()
}

/// The blocks a `holds` entry describes: the product of its per-dim runs, row-major, with their
/// starts in the local tensor.
fn blocks_from_holds(holds: &Value) -> Vec<Block> {
    let dims: Vec<Vec<(u64, u64)>> = holds
        .as_array()
        .unwrap()
        .iter()
        .map(|runs| runs.as_array().unwrap().iter().map(|r| (r[0].as_u64().unwrap(), r[1].as_u64().unwrap())).collect())
        .collect();
    let mut blocks = vec![Block { global: Region::new(vec![], vec![]), local: vec![] }];
    for runs in &dims {
        let mut next = Vec::new();
        for b in &blocks {
            let mut at = 0;
            for &(start, end) in runs {
                let mut c = b.clone();
                c.global.offsets.push(start);
                c.global.sizes.push(end - start);
                c.local.push(at);
                at += end - start;
                next.push(c);
            }
        }
        blocks = next;
    }
    blocks
}

/// Checks one rank against torch's local shape and offset, and against what its local tensor
/// holds. Returns false, the contents unchecked, when the local tensor does not even have
/// torch's local shape (the caller decides whether that is allowed).
fn check_rank(at: &str, layout: &DTensorLayout, rank: u64, r: &Value) -> bool {
    let coord = u64s(&r["coordinate"]);
    assert_eq!(layout.coordinate(rank), Some(coord.clone()), "{at}: rank {rank}'s coordinate");
    let (shape, offset) = (u64s(&r["local_shape"]), u64s(&r["global_offset"]));
    assert_eq!(
        layout.local_shape_and_global_offset(&coord).unwrap(),
        (shape.clone(), offset.clone()),
        "{at}: rank {rank}: torch's local shape and global offset"
    );
    let blocks = layout.blocks_of(&coord).unwrap();
    let is_box = blocks.len() == 1;
    match layout.box_of(&coord) {
        Ok(b) => {
            assert!(is_box, "{at}: rank {rank}");
            assert_eq!(b, Region::new(offset, shape.clone()), "{at}: rank {rank}: box");
            assert_eq!(blocks[0].global, b, "{at}: rank {rank}");
        }
        Err(e) => assert!(!is_box, "{at}: rank {rank}: {e}"),
    }
    if u64s(&r["local_tensor_shape"]) != shape {
        return false;
    }
    if r["holds"].is_null() {
        assert!(shape.contains(&0), "{at}: rank {rank} holds nothing");
        assert_eq!(blocks.len(), 1, "{at}: rank {rank}");
    } else {
        assert_eq!(blocks, blocks_from_holds(&r["holds"]), "{at}: rank {rank}: the elements held");
    }
    true
}

/// A `cases` or `distributed` entry: every rank agrees, torch's local tensors included, and
/// the distinct boxes of a layout that has them tile the tensor.
fn check_case(section: &str, c: &Value) -> (bool, usize) {
    let name = c["name"].as_str().unwrap();
    let at = format!("{section} `{name}`");
    let shape = u64s(&c["shape"]);
    let layout = DTensorLayout::new(shape.clone(), u64s(&c["mesh"]), placements(&c["placements"]))
        .unwrap_or_else(|e| panic!("{at}: {e}"));
    let ranks = c["ranks"].as_array().unwrap();
    assert_eq!(ranks.len() as u64, layout.world(), "{at}: one entry per rank");
    for (rank, r) in ranks.iter().enumerate() {
        assert_eq!(r["rank"], rank as u64);
        assert!(check_rank(&at, &layout, rank as u64, r), "{at}: rank {rank}: torch's local tensor has another shape");
    }
    match layout.distinct_boxes() {
        Ok(boxes) => {
            check_tiling(&shape, &boxes).unwrap_or_else(|e| panic!("{at}: {e}"));
            (true, ranks.len())
        }
        Err(_) => (false, ranks.len()),
    }
}

#[test]
fn every_case_matches_torch() {
    let json = fixture();
    let cases = json["cases"].as_array().unwrap();
    let (mut boxed, mut scattered, mut ranks) = (0, 0, 0);
    for c in cases {
        let (is_box, n) = check_case("case", c);
        if is_box {
            boxed += 1;
        } else {
            scattered += 1;
        }
        ranks += n;
    }
    // The generator's hand-picked cases and 80 random ones; some `_StridedShard` orders leave
    // ranks with more than one box.
    assert!(cases.len() >= 130 && ranks > 600, "{} cases, {ranks} ranks", cases.len());
    assert!(scattered >= 10 && boxed >= 100, "{boxed} box layouts, {scattered} others");
}

#[test]
fn the_fixture_covers_the_cases_asked_for() {
    let json = fixture();
    let cases = json["cases"].as_array().unwrap();
    let has = |pred: &dyn Fn(&Value) -> bool| cases.iter().any(pred);
    let texts = |c: &Value| -> Vec<String> {
        c["placements"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_string()).collect()
    };
    for d in 0..4 {
        let s = format!("Shard(dim={d})");
        assert!(has(&|c| texts(c).contains(&s)), "{s}");
    }
    assert!(has(&|c| texts(c) == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]));
    assert!(has(&|c| texts(c) == ["Shard(dim=0)", "Shard(dim=1)"]));
    assert!(has(&|c| texts(c) == ["Replicate()", "Shard(dim=1)"]));
    assert!(has(&|c| texts(c) == ["Shard(dim=0)", "Shard(dim=0)"]), "nested shards");
    assert!(has(&|c| texts(c).iter().any(|t| t.starts_with("Partial("))));
    assert!(has(&|c| c["mesh"].as_array().unwrap().len() == 3));
    assert!(has(&|c| c["ranks"].as_array().unwrap().iter().any(|r| r["holds"].is_null())), "empty shards");
}

#[test]
fn distributed_runs_match_torch() {
    let json = fixture();
    let runs = json["distributed"].as_array().unwrap();
    assert!(runs.len() >= 20);
    let cases = json["cases"].as_array().unwrap();
    for c in runs {
        check_case("distributed", c);
        // The in-process evaluation is what a real mesh gives.
        let same = cases.iter().find(|x| x["name"] == c["name"]).unwrap();
        assert_eq!(same["ranks"], c["ranks"], "{}", c["name"]);
    }
}

/// FSDP2 + TP: the placements torch recorded give torch's own local shapes and offsets on every
/// rank, and (with one exception) the elements the local tensors hold. The exception is torch's:
/// on a (3, 2) mesh, the 7-row `ColwiseParallel` layer `side` is recorded as
/// `(_StridedShard(0, sf=2), Shard(0))`, whose meaning puts row 6 on coordinate (2, 0) and
/// nothing on (2, 1), while FSDP2 chunked each tp shard (rows 0-3 and 4-6) over dp by itself and
/// left row 6 on (2, 1).
#[test]
fn fsdp2_tp_matches_torch() {
    let json = fixture();
    let models = json["fsdp2_tp"].as_array().unwrap();
    let mut disagree = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for m in models {
        let model = m["name"].as_str().unwrap();
        for p in m["params"].as_array().unwrap() {
            let name = p["name"].as_str().unwrap();
            let at = format!("`{model}` `{name}`");
            let ps = placements(&p["placements"]);
            seen.insert(p["placements"].to_string());
            let layout = DTensorLayout::new(u64s(&p["shape"]), u64s(&p["mesh"]), ps).unwrap();
            let ranks = p["ranks"].as_array().unwrap();
            assert_eq!(ranks.len() as u64, layout.world(), "{at}");
            for (rank, r) in ranks.iter().enumerate() {
                if !check_rank(&at, &layout, rank as u64, r) {
                    disagree.push(format!("{model} {name} {rank}"));
                }
            }
            let boxes = layout.distinct_boxes().unwrap();
            check_tiling(layout.shape(), &boxes).unwrap_or_else(|e| panic!("{at}: {e}"));
        }
    }
    for want in [
        r#"["_StridedShard(dim=0, sf=2)","Shard(dim=0)"]"#,
        r#"["Shard(dim=0)","Shard(dim=1)"]"#,
        r#"["Replicate()","_StridedShard(dim=0, sf=2)","Shard(dim=0)"]"#,
    ] {
        assert!(seen.contains(want), "{want} not among {seen:?}");
    }
    assert_eq!(
        disagree,
        [
            "fsdp_tp_3x2 side.weight 4",
            "fsdp_tp_3x2 side.weight 5",
            "fsdp_tp_3x2 side.bias 4",
            "fsdp_tp_3x2 side.bias 5"
        ]
    );
}
