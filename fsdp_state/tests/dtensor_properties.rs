//! Properties of `DTensorLayout` over random shapes, meshes up to 3-D and all placements: it
//! agrees with a direct model of torch's rules (index lists cut with `torch.chunk`), every rank's
//! boxes lie in bounds and fill its local tensor, the ranks' boxes tile the tensor once per
//! replica, replicated mesh dims repeat boxes, and the 1-D and FSDP2 + TP cases agree with the
//! dim-0 chunking `Fsdp2` uses.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;

use fsdp_state::{check_tiling, chunk_rows, Block, DTensorLayout, Fsdp2, Placement, ReduceOp, Region, TensorSpec};
use proptest::prelude::*;

fn placement(ndim: usize) -> impl Strategy<Value = Placement> {
    let dim = 0..ndim.max(1);
    prop_oneof![
        1 => Just(Placement::Replicate),
        1 => Just(Placement::Partial(ReduceOp::Sum)),
        3 => dim.clone().prop_map(Placement::Shard),
        2 => (dim, 1u64..5).prop_map(|(dim, split_factor)| Placement::StridedShard { dim, split_factor }),
    ]
}

/// A tensor of 1 to 3 dims (sizes 0 to 8), a mesh of 1 to 3 dims (sizes 1 to 3), placements.
fn case() -> impl Strategy<Value = (Vec<u64>, Vec<u64>, Vec<Placement>)> {
    (prop::collection::vec(0u64..9, 1..4), prop::collection::vec(1u64..4, 1..4)).prop_flat_map(|(shape, mesh)| {
        let ps = prop::collection::vec(placement(shape.len()), mesh.len());
        (Just(shape), Just(mesh), ps)
    })
}

/// `torch.chunk(list, n)`, padded with empty pieces to `n` as DTensor pads it.
fn torch_chunk(list: &[u64], n: u64) -> Vec<Vec<u64>> {
    let size = list.len().div_ceil(n as usize).max(1);
    let mut pieces: Vec<Vec<u64>> = list.chunks(size).map(<[u64]>::to_vec).collect();
    pieces.resize(n as usize, Vec::new());
    pieces
}

/// The rules as torch states them, on explicit lists of global indices per tensor dim.
fn model(shape: &[u64], mesh: &[u64], placements: &[Placement], coord: &[u64]) -> Vec<Vec<u64>> {
    let mut lists: Vec<Vec<u64>> = shape.iter().map(|&s| (0..s).collect()).collect();
    for ((p, &n), &c) in placements.iter().zip(mesh).zip(coord) {
        match *p {
            Placement::Shard(d) => lists[d] = torch_chunk(&lists[d], n).swap_remove(c as usize),
            Placement::StridedShard { dim, split_factor } => {
                lists[dim] = torch_chunk(&lists[dim], split_factor)
                    .iter()
                    .flat_map(|piece| torch_chunk(piece, n).swap_remove(c as usize))
                    .collect();
            }
            Placement::Replicate | Placement::Partial(_) => {}
        }
    }
    lists
}

/// Index lists as the blocks `blocks_of` gives: the product of each dim's runs.
fn blocks_of_lists(lists: &[Vec<u64>]) -> Vec<Block> {
    let mut blocks = vec![Block { global: Region::new(vec![], vec![]), local: vec![] }];
    for list in lists {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &x in list {
            match runs.last_mut() {
                Some(r) if r.0 + r.1 == x => r.1 += 1,
                _ => runs.push((x, 1)),
            }
        }
        let mut next = Vec::new();
        for b in &blocks {
            let mut at = 0;
            for &(start, len) in &runs {
                let mut c = b.clone();
                c.global.offsets.push(start);
                c.global.sizes.push(len);
                c.local.push(at);
                at += len;
                next.push(c);
            }
        }
        blocks = next;
    }
    blocks
}

fn layout(shape: &[u64], mesh: &[u64], placements: &[Placement]) -> DTensorLayout {
    DTensorLayout::new(shape, mesh, placements).unwrap()
}

fn coords(l: &DTensorLayout) -> impl Iterator<Item = (u64, Vec<u64>)> + '_ {
    (0..l.world()).map(|r| (r, l.coordinate(r).unwrap()))
}

proptest! {
    #[test]
    fn agrees_with_a_direct_model_of_torch((shape, mesh, placements) in case()) {
        let l = layout(&shape, &mesh, &placements);
        for (rank, coord) in coords(&l) {
            prop_assert_eq!(l.rank_of(&coord), Some(rank));
            let lists = model(&shape, &mesh, &placements, &coord);
            let sizes: Vec<u64> = lists.iter().map(|x| x.len() as u64).collect();
            // torch's offset: the first index, or the dim's size when there is none.
            let offsets: Vec<u64> = lists.iter().zip(&shape).map(|(x, &s)| x.first().copied().unwrap_or(s)).collect();
            let (got_sizes, got_offsets) = l.local_shape_and_global_offset(&coord).unwrap();
            prop_assert_eq!(&got_sizes, &sizes);
            prop_assert_eq!(&got_offsets, &offsets);
            let blocks = l.blocks_of(&coord).unwrap();
            if sizes.contains(&0) {
                prop_assert_eq!(blocks.len(), 1);
                prop_assert_eq!(&blocks[0].global, &Region::new(offsets.clone(), sizes.clone()));
            } else {
                prop_assert_eq!(&blocks, &blocks_of_lists(&lists));
            }
            match l.box_of(&coord) {
                Ok(b) => {
                    prop_assert_eq!(blocks.len(), 1);
                    prop_assert_eq!(b, Region::new(offsets, sizes));
                }
                Err(_) => prop_assert!(blocks.len() > 1),
            }
        }
    }

    #[test]
    fn blocks_fill_the_local_tensor_and_stay_in_bounds((shape, mesh, placements) in case()) {
        let l = layout(&shape, &mesh, &placements);
        for (_, coord) in coords(&l) {
            let (local_shape, _) = l.local_shape_and_global_offset(&coord).unwrap();
            let blocks = l.blocks_of(&coord).unwrap();
            let global: Vec<Region> = blocks.iter().map(|b| b.global.clone()).collect();
            let local: Vec<Region> = blocks.iter().map(|b| Region::new(b.local.clone(), b.global.sizes.clone())).collect();
            check_tiling(&local_shape, &local).unwrap();
            for b in &global {
                let inside = b.offsets.iter().zip(&b.sizes).zip(&shape).all(|((&o, &n), &s)| o + n <= s);
                prop_assert!(inside, "{:?} outside {:?}", b, shape);
            }
            prop_assert!(global.iter().enumerate().all(|(i, a)| global[i + 1..].iter().all(|b| !a.overlaps(b))));
        }
    }

    /// Across ranks, the distinct blocks tile the tensor (and so do the distinct boxes when every
    /// rank holds one), and every element is held by exactly as many ranks as the replicated
    /// mesh dims multiply to.
    #[test]
    fn ranks_tile_the_tensor_once_per_replica((shape, mesh, placements) in case()) {
        let l = layout(&shape, &mesh, &placements);
        let mut seen = HashSet::new();
        let mut distinct = Vec::new();
        let mut held = 0u64;
        for (_, coord) in coords(&l) {
            for b in l.blocks_of(&coord).unwrap() {
                held += b.global.numel().unwrap();
                if seen.insert(b.global.clone()) {
                    distinct.push(b.global);
                }
            }
        }
        check_tiling(&shape, &distinct).unwrap();
        let replicas: u64 = mesh.iter().zip(&placements).filter(|(_, p)| p.shard_dim().is_none()).map(|(&n, _)| n).product();
        prop_assert_eq!(held, shape.iter().product::<u64>() * replicas);
        if let Ok(boxes) = l.distinct_boxes() {
            check_tiling(&shape, &boxes).unwrap();
            let all = l.boxes().unwrap();
            prop_assert_eq!(all.len() as u64, l.world());
            for (rank, b) in all {
                prop_assert_eq!(Ok(b), l.box_of_rank(rank));
            }
        }
    }

    #[test]
    fn replicated_mesh_dims_repeat_boxes((shape, mesh, placements) in case()) {
        let l = layout(&shape, &mesh, &placements);
        for (_, coord) in coords(&l) {
            let blocks = l.blocks_of(&coord).unwrap();
            for (i, p) in placements.iter().enumerate() {
                if p.shard_dim().is_none() {
                    let mut other = coord.clone();
                    other[i] = (coord[i] + 1) % mesh[i];
                    prop_assert_eq!(&l.blocks_of(&other).unwrap(), &blocks, "mesh dim {} is {}", i, p);
                }
            }
        }
    }

    #[test]
    fn one_d_shard_0_is_fsdp2(shape in prop::collection::vec(0u64..9, 1..4), world in 1u64..9) {
        let l = layout(&shape, &[world], &[Placement::Shard(0)]);
        let fsdp2 = Fsdp2::new(vec![TensorSpec::new("t", shape.clone())], world).unwrap();
        for rank in 0..world {
            let b = l.box_of_rank(rank).unwrap();
            prop_assert_eq!(Some(b.sizes.clone()), fsdp2.local_shape(0, rank));
            let rows = chunk_rows(shape[0], world, rank).unwrap();
            prop_assert_eq!(b.offsets[0], rows.start);
            prop_assert!(b.offsets[1..].iter().all(|&o| o == 0));
        }
    }

    /// FSDP2 over TP as torch writes it, `(_StridedShard(0, sf=tp), Shard(0))` on (dp, tp):
    /// when the rows divide evenly, rank (i, j) holds chunk i of tp chunk j, the order of
    /// chunking over tp first and dp second, and nested `Shard(0)`s chunk dp first.
    #[test]
    fn fsdp2_over_tp_chunks_tp_first(dp in 1u64..5, tp in 1u64..5, k in 0u64..4, cols in 0u64..4) {
        let rows = k * dp * tp;
        let strided = layout(&[rows, cols], &[dp, tp], &[Placement::StridedShard { dim: 0, split_factor: tp }, Placement::Shard(0)]);
        let nested = layout(&[rows, cols], &[dp, tp], &[Placement::Shard(0), Placement::Shard(0)]);
        for i in 0..dp {
            for j in 0..tp {
                let outer = chunk_rows(rows, tp, j).unwrap();
                let inner = chunk_rows(outer.end - outer.start, dp, i).unwrap();
                let want = Region::new([outer.start + inner.start, 0], [inner.end - inner.start, cols]);
                let at_end = Region { offsets: vec![rows, 0], ..want.clone() };
                let got = strided.box_of(&[i, j]).unwrap();
                prop_assert!(got == want || (want.is_empty() && got == at_end), "{:?} vs {:?}", got, want);
                let outer = chunk_rows(rows, dp, i).unwrap();
                let inner = chunk_rows(outer.end - outer.start, tp, j).unwrap();
                let got = nested.box_of(&[i, j]).unwrap();
                prop_assert_eq!(got.offsets[0], if inner.is_empty() { rows } else { outer.start + inner.start });
                prop_assert_eq!(got.sizes[0], inner.end - inner.start);
            }
        }
    }

    #[test]
    fn placements_print_and_parse_back(p in placement(4)) {
        prop_assert_eq!(Placement::parse(&p.to_string()), Ok(p));
    }
}
