//! `fsdp_state`'s layouts against what the real tools do.
//!
//! Every file in `fixtures/fsdp_state/` was written by `fixtures/gen/fsdp_layouts.py`: it ran
//! torch 2.13 (FSDP2 `fully_shard`, FSDP1 `FullyShardedDataParallel`) or DeepSpeed 0.19.8
//! (ZeRO-1, ZeRO-2 with `parameter_alignment`, ZeRO-3) on CPU ranks over a small model whose
//! sizes do not suit the world size, and recorded per rank what the tool says about its layout
//! and which element of which parameter each local buffer really holds (decoded from the
//! values: a `holds` run `{tensor, start, end, local}` is elements `[start, end)` of parameter
//! `tensor` at offset `local` of the buffer). Each case builds the matching `fsdp_state` layout
//! from the parameter names and shapes alone and requires the same answers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use fsdp_state::{chunk_rows, FlatEntry, Fsdp1Flat, Fsdp2, Layout, Piece, TensorSpec, Zero12, Zero3};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/fsdp_state")
}

fn load(case: &str) -> Value {
    let text = std::fs::read_to_string(root().join(format!("{case}.json"))).unwrap();
    let json: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["case"], case);
    json
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not an unsigned integer: {v}"))
}

/// The model's parameters in the order the generator numbered them (`tensor` in `holds`).
fn tensors(fixture: &Value) -> Vec<TensorSpec> {
    fixture["spec"]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| TensorSpec::new(t["name"].as_str().unwrap(), u64s(&t["shape"])))
        .collect()
}

fn index_of(tensors: &[TensorSpec], name: &str) -> usize {
    tensors.iter().position(|t| t.name == name).unwrap_or_else(|| panic!("no parameter `{name}`"))
}

/// A `holds` list as `(tensor, elems, local)` triples, `tensor` mapped through `renumber`.
fn holds(v: &Value, renumber: impl Fn(usize) -> usize) -> Vec<(usize, std::ops::Range<u64>, u64)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| (renumber(u(&h["tensor"]) as usize), u(&h["start"])..u(&h["end"]), u(&h["local"])))
        .collect()
}

fn triples<'a>(pieces: impl IntoIterator<Item = &'a Piece>) -> Vec<(usize, std::ops::Range<u64>, u64)> {
    pieces.into_iter().map(|p| (p.tensor, p.elems.clone(), p.local)).collect()
}

fn ranks(fixture: &Value) -> impl Iterator<Item = (u64, &Value)> {
    let world = u(&fixture["world"]);
    let ranks = fixture["ranks"].as_array().unwrap();
    assert_eq!(ranks.len() as u64, world);
    ranks.iter().enumerate().map(|(r, v)| (r as u64, v))
}

/// FSDP2: every parameter is a DTensor `Shard(0)`; its local tensor has the shape, the global
/// offset (as `compute_local_shape_and_global_offset` gives it, empty shards included) and the
/// elements that `Fsdp2` predicts.
fn fsdp2(case: &str) {
    let fixture = load(case);
    let world = u(&fixture["world"]);
    let tensors = tensors(&fixture);
    let layout = Fsdp2::new(tensors.clone(), world).unwrap();
    for (rank, report) in ranks(&fixture) {
        let params = report["params"].as_array().unwrap();
        assert_eq!(params.len(), tensors.len());
        let pieces = layout.pieces(rank);
        let slot_lens = layout.slot_lens(rank);
        for p in params {
            let name = p["name"].as_str().unwrap();
            let i = index_of(&tensors, name);
            let at = format!("{case}: `{name}` on rank {rank}");
            assert_eq!(p["placements"], serde_json::json!(["S(0)"]), "{at}");
            let shape = u64s(&p["local_shape"]);
            assert_eq!(layout.local_shape(i, rank), Some(shape.clone()), "{at}: local shape");
            assert_eq!(u64s(&p["torch_local_shape"]), shape, "{at}");
            let rows = chunk_rows(tensors[i].shape[0], world, rank).unwrap();
            let mut offset = vec![0; shape.len()];
            offset[0] = rows.start;
            assert_eq!(u64s(&p["global_offset"]), offset, "{at}: global offset");
            assert_eq!(slot_lens[i], shape.iter().product::<u64>(), "{at}: slot length");
            assert_eq!(
                triples(pieces.iter().filter(|piece| piece.tensor == i)),
                holds(&p["holds"], |t| t),
                "{at}: elements held"
            );
            assert!(pieces.iter().filter(|piece| piece.tensor == i).all(|piece| piece.slot == i), "{at}");
        }
    }
}

/// FSDP1: each FSDP unit's flat parameter, built by `Fsdp1Flat` from the unit's parameters in
/// the order FSDP flattened them (aligned for the unit's dtype when `use_orig_params=True`), has
/// the same entries (`_numels_with_padding`, `_is_padding_mask`), unsharded length, shard size,
/// shard padding, parameter offsets and per-rank pieces as the `FlatParameter`
/// (`_shard_param_infos`) and its shard's contents.
fn fsdp1(case: &str) {
    let fixture = load(case);
    let world = u(&fixture["world"]);
    let all = tensors(&fixture);
    let orig_params = fixture["spec"]["use_orig_params"].as_bool().unwrap();
    let first = &fixture["ranks"][0]["units"];
    for (unit_index, unit0) in first.as_array().unwrap().iter().enumerate() {
        let module = unit0["module"].as_str().unwrap();
        let unit_tensors: Vec<TensorSpec> = unit0["params"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| TensorSpec::new(p["name"].as_str().unwrap(), u64s(&p["shape"])))
            .collect();
        let global: Vec<usize> = unit_tensors.iter().map(|t| index_of(&all, &t.name)).collect();
        let at = format!("{case}: flat parameter of `{module}`");
        // FSDP aligns only with `use_orig_params=True`, by the itemsize of its compute dtype.
        let aligned_numel = if orig_params { Fsdp1Flat::aligned_numel_for(u(&unit0["itemsize"])).unwrap() } else { 0 };
        assert_eq!(aligned_numel, u(&unit0["aligned_numel"]), "{at} ({}): `_aligned_numel`", unit0["dtype"]);
        let layout = Fsdp1Flat::with_alignment(unit_tensors.clone(), world, aligned_numel).unwrap();

        let entries: Vec<(u64, bool)> = layout.entries().iter().map(|e| (e.numel(), e.is_padding())).collect();
        let torch_entries: Vec<(u64, bool)> = u64s(&unit0["numels_with_padding"])
            .into_iter()
            .zip(unit0["is_padding_mask"].as_array().unwrap().iter().map(|p| p.as_bool().unwrap()))
            .collect();
        assert_eq!(entries, torch_entries, "{at}: `_numels_with_padding` and `_is_padding_mask`");
        let order: Vec<usize> = layout
            .entries()
            .iter()
            .filter_map(|e| match e {
                FlatEntry::Param { tensor, .. } => Some(*tensor),
                FlatEntry::Padding { .. } => None,
            })
            .collect();
        assert_eq!(order, (0..unit_tensors.len()).collect::<Vec<_>>(), "{at}: parameters in order");
        assert_eq!(layout.unsharded_len(), u(&unit0["unpadded_unsharded_numel"]), "{at}: unsharded numel");

        // Where FSDP put each parameter in the unsharded flat vector: the running sum of
        // `_numels_with_padding`, skipping the entries `_is_padding_mask` marks as padding.
        let mut offsets = Vec::new();
        let mut offset = 0u64;
        for (n, pad) in
            u64s(&unit0["numels_with_padding"]).into_iter().zip(unit0["is_padding_mask"].as_array().unwrap())
        {
            if !pad.as_bool().unwrap() {
                offsets.push(offset);
            }
            offset += n;
        }
        let ours: Vec<u64> = layout.params().iter().map(|p| p.offset).collect();
        assert_eq!(ours, offsets, "{at}: parameter offsets in the flat vector");
        let last = layout.params().last().unwrap();
        assert_eq!(last.offset + last.numel, offset_end_of_params(unit0), "{at}: end of the last parameter");
        for (rank, report) in ranks(&fixture) {
            let unit = &report["units"][unit_index];
            assert_eq!(unit["module"], module);
            let at = format!("{at}, rank {rank}");
            assert_eq!(layout.chunk_len(), u(&unit["sharded_numel"]), "{at}: shard numel");
            assert_eq!(layout.slot_lens(rank), vec![u(&unit["sharded_numel"])], "{at}");
            assert_eq!(layout.shard_numel_padded(rank), Some(u(&unit["shard_numel_padded"])), "{at}: shard padding");
            let pieces = layout.pieces(rank);
            let from_infos: Vec<_> = unit["shard_param_infos"]
                .as_array()
                .unwrap()
                .iter()
                .enumerate()
                .filter(|(_, info)| info["in_shard"].as_bool().unwrap())
                .map(|(k, info)| {
                    let start = u(&info["intra_param_start_idx"]);
                    let end = u(&info["intra_param_end_idx"]) + 1;
                    assert_eq!(end - start, u(&info["numel_in_shard"]));
                    (k, start..end, u(&info["offset_in_shard"]))
                })
                .collect();
            assert_eq!(triples(&pieces), from_infos, "{at}: `_shard_param_infos`");
            let held = holds(&unit["holds"], |t| global.iter().position(|&g| g == t).unwrap());
            assert_eq!(triples(&pieces), held, "{at}: elements held");
            // What the shard holds besides parameter elements is what `padding` says.
            let mut free = vec![true; layout.chunk_len() as usize];
            for (_, elems, local) in &held {
                free[*local as usize..(*local + elems.end - elems.start) as usize].fill(false);
            }
            let mut ours = vec![false; free.len()];
            for r in layout.padding(rank) {
                ours[r.start as usize..r.end as usize].fill(true);
            }
            assert_eq!(ours, free, "{at}: padding in the shard");
        }
    }
}

/// Where the last parameter of a flat parameter ends: the sum of `_numels_with_padding` up to
/// its last non-padding entry (with `use_orig_params=True` FSDP records the padding up to a
/// multiple of the world size as a padding entry; without, it is `_shard_numel_padded`).
fn offset_end_of_params(unit: &Value) -> u64 {
    let numels = u64s(&unit["numels_with_padding"]);
    let mask = unit["is_padding_mask"].as_array().unwrap();
    let last = mask.iter().rposition(|p| !p.as_bool().unwrap()).unwrap();
    numels[..=last].iter().sum()
}

/// ZeRO-1/2: `Zero12`, given each group's parameters in DeepSpeed's flattening order and, with
/// `parameter_alignment`, DeepSpeed's per-parameter padding, has DeepSpeed's partition size,
/// saves what DeepSpeed saves (`partition - groups_padding`), and places each parameter's
/// fragments where DeepSpeed's fp32 partition holds them.
fn zero12(case: &str) {
    let fixture = load(case);
    let world = u(&fixture["world"]);
    let tensors = tensors(&fixture);
    let groups0 = fixture["ranks"][0]["groups"].as_array().unwrap();
    let groups: Vec<Vec<usize>> = groups0
        .iter()
        .map(|g| g["params"].as_array().unwrap().iter().map(|n| index_of(&tensors, n.as_str().unwrap())).collect())
        .collect();
    let padding: Vec<Vec<u64>> = groups0.iter().map(|g| u64s(&g["param_padding"])).collect();
    let aligned = fixture["spec"]["parameter_alignment"].as_bool().unwrap();
    assert_eq!(aligned, padding.iter().flatten().any(|&p| p > 0), "{case}: alignment padding appears iff asked for");
    let layout = Zero12::new(tensors.clone(), groups, aligned.then_some(padding), world).unwrap();
    for (rank, report) in ranks(&fixture) {
        let pieces = layout.pieces(rank);
        let mut partitions = Vec::new();
        for (g, group) in report["groups"].as_array().unwrap().iter().enumerate() {
            let at = format!("{case}: group {g} on rank {rank}");
            let partition = u(&group["partition_numel"]);
            partitions.push(partition);
            assert_eq!(layout.partition_len(g), Some(partition), "{at}: partition numel");
            assert_eq!(u(&group["flat_numel"]), partition * world, "{at}");
            assert_eq!(layout.saved_len(g, rank), Some(partition - u(&group["groups_padding"])), "{at}: saved length");
            let ours = triples(pieces.iter().filter(|p| p.slot == g));
            let fragments: Vec<_> = group["fragments"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| {
                    let start = u(&f["lp_start"]);
                    (index_of(&tensors, f["name"].as_str().unwrap()), start..start + u(&f["numel"]), u(&f["hp_start"]))
                })
                .collect();
            assert_eq!(ours, fragments, "{at}: `_hp_mapping` fragments");
            assert_eq!(ours, holds(&group["holds"], |t| t), "{at}: elements held");
        }
        assert_eq!(layout.slot_lens(rank), partitions, "{case}: rank {rank}");
    }
}

/// ZeRO-3: `Zero3`, given the parameters in the order of the optimizer's sub groups (the order
/// of a rank's fp32 partitions), gives each parameter `ds_tensor.ds_numel` elements per rank,
/// pads it as `padding_size()` says, and places each piece where `ds_tensor` and the
/// concatenated fp32 partitions hold it.
fn zero3(case: &str) {
    let fixture = load(case);
    let world = u(&fixture["world"]);
    let spec_order = tensors(&fixture);
    let sub_groups = &fixture["ranks"][0]["sub_groups"];
    let order: Vec<usize> = sub_groups
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g.as_array().unwrap().iter().map(|n| index_of(&spec_order, n.as_str().unwrap())))
        .collect();
    let tensors: Vec<TensorSpec> = order.iter().map(|&i| spec_order[i].clone()).collect();
    let renumber = |t: usize| order.iter().position(|&i| i == t).unwrap();
    let layout = Zero3::new(tensors.clone(), world).unwrap();
    // A parameter's part is the distance between its offset and the next one's in a rank's
    // buffer (its `local`), the last one's the distance to the buffer's end.
    let mut locals = vec![0u64; tensors.len()];
    for r in 0..world {
        for p in layout.pieces(r) {
            locals[p.tensor] = p.local;
        }
    }
    let ends: Vec<u64> = locals.iter().skip(1).copied().chain([layout.rank_len()]).collect();
    for (rank, report) in ranks(&fixture) {
        assert_eq!(report["sub_groups"], *sub_groups, "{case}: rank {rank}: same sub groups everywhere");
        let pieces = layout.pieces(rank);
        for p in report["params"].as_array().unwrap() {
            let name = p["name"].as_str().unwrap();
            let i = index_of(&tensors, name);
            let at = format!("{case}: `{name}` on rank {rank}");
            let part = u(&p["partition_numel"]);
            assert_eq!(ends[i] - locals[i], part, "{at}: partition numel");
            assert_eq!(u(&p["ds_numel"]), tensors[i].numel().unwrap(), "{at}");
            assert_eq!(part * world - u(&p["ds_numel"]), u(&p["padding_size"]), "{at}: padding");
            let ours: Vec<_> = pieces
                .iter()
                .filter(|piece| piece.tensor == i)
                .map(|piece| (piece.tensor, piece.elems.clone(), 0))
                .collect();
            assert_eq!(ours, holds(&p["holds"], renumber), "{at}: elements `ds_tensor` holds");
        }
        assert_eq!(layout.slot_lens(rank), vec![u(&report["flat_numel"])], "{case}: rank {rank}: buffer length");
        assert_eq!(triples(&pieces), holds(&report["flat_holds"], renumber), "{case}: rank {rank}: fp32 partitions");
    }
}

/// One test per fixture, named after it, and `COVERED`: every fixture name, in this order.
macro_rules! cases {
    ($($check:ident: [$($name:ident),* $(,)?]),* $(,)?) => {
        $($(
            #[test]
            fn $name() {
                $check(stringify!($name));
            }
        )*)*
        const COVERED: &[&str] = &[$($(stringify!($name)),*),*];
    };
}

cases!(
    fsdp2: [
        fsdp2_awkward_w2,
        fsdp2_awkward_w3,
        fsdp2_awkward_w4,
        fsdp2_tiny_w2,
        fsdp2_tiny_w3,
        fsdp2_tiny_w4,
    ],
    fsdp1: [
        fsdp1_flat_awkward_w2,
        fsdp1_flat_awkward_w3,
        fsdp1_flat_awkward_w4,
        fsdp1_flat_tiny_w2,
        fsdp1_flat_tiny_w3,
        fsdp1_flat_tiny_w4,
        fsdp1_orig_awkward_w2,
        fsdp1_orig_awkward_w3,
        fsdp1_orig_awkward_w4,
        fsdp1_orig_tiny_w2,
        fsdp1_orig_tiny_w3,
        fsdp1_orig_tiny_w4,
    ],
    zero12: [
        zero1_awkward_w2,
        zero1_awkward_w3,
        zero1_awkward_w4,
        zero1_tiny_w2,
        zero1_tiny_w3,
        zero1_tiny_w4,
        zero2_aligned_awkward_w2,
        zero2_aligned_awkward_w3,
        zero2_aligned_awkward_w4,
        zero2_aligned_tiny_w2,
        zero2_aligned_tiny_w3,
        zero2_aligned_tiny_w4,
    ],
    zero3: [
        zero3_awkward_w2,
        zero3_awkward_w3,
        zero3_awkward_w4,
        zero3_tiny_w2,
        zero3_tiny_w3,
        zero3_tiny_w4,
    ],
);

/// The fixtures in `fixtures/fsdp_state/` are exactly the cases tested above, but for the
/// DTensor one, which `dtensor_layouts.rs` reads.
#[test]
fn every_fixture_has_a_test() {
    let mut found: Vec<String> = std::fs::read_dir(root())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|f| f.strip_suffix(".json").map(str::to_owned))
        .filter(|f| f != "dtensor_layouts")
        .collect();
    found.sort();
    let mut covered = COVERED.to_vec();
    covered.sort_unstable();
    assert_eq!(found, covered);
}
