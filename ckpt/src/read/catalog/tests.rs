use super::*;
use proptest::prelude::*;

/// A tensor of `shape` (i32 elements numbered row-major) cut on every dim at `cuts`, each
/// box stored compact in one file, in row-major or in reversed-dims (transposed) order.
fn tiled(shape: &[u64], cuts: &[Vec<u64>], transposed: &[bool]) -> (tempfile::TempDir, Checkpoint) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("data");
    let strides = shape::contiguous_strides(shape).unwrap_or_default();
    // Every box of the grid the cuts make.
    let edges: Vec<Vec<u64>> = shape
        .iter()
        .zip(cuts)
        .map(|(&n, c)| {
            let mut e: Vec<u64> = c.iter().map(|&x| x % (n + 1)).chain([0, n]).collect();
            e.sort_unstable();
            e.dedup();
            e
        })
        .collect();
    let mut regions = vec![Region::new(Vec::<u64>::new(), Vec::<u64>::new())];
    for e in &edges {
        regions = regions
            .into_iter()
            .flat_map(|r| {
                e.windows(2).map(move |w| {
                    let mut r = r.clone();
                    r.offsets.push(w[0]);
                    r.sizes.push(w[1] - w[0]);
                    r
                })
            })
            .collect();
    }
    let mut bytes = Vec::new();
    let mut boxes = Vec::new();
    for (i, r) in regions.iter().enumerate() {
        let flip = transposed.get(i % transposed.len().max(1)).copied().unwrap_or(false);
        // Store the box with its dims in `order` (reversed when transposed).
        let order: Vec<usize> = if flip { (0..r.sizes.len()).rev().collect() } else { (0..r.sizes.len()).collect() };
        let stored: Vec<u64> = order.iter().map(|&d| r.sizes[d]).collect();
        let stored_strides = shape::contiguous_strides(&stored).unwrap_or_default();
        let mut view = vec![0u64; r.sizes.len()];
        for (k, &d) in order.iter().enumerate() {
            view[d] = stored_strides[k];
        }
        let base = bytes.len() as u64;
        let n = shape::numel(&stored).unwrap_or(0);
        for flat in 0..n {
            // The stored element `flat` is at box index `idx` (in `order`), global `g`.
            let mut rest = flat;
            let mut g = 0u64;
            for (k, &d) in order.iter().enumerate() {
                let x = rest / stored_strides[k];
                rest %= stored_strides[k];
                g += (r.offsets[d] + x) * strides[d];
            }
            bytes.extend_from_slice(&(g as i32).to_le_bytes());
        }
        boxes.push(TensorBox { region: r.clone(), file: 0, base, len: n * 4, offset: 0, strides: view });
    }
    std::fs::write(&path, &bytes).unwrap_or_else(|e| panic!("{e}"));
    let files = vec![SourceFile::new(path, bytes.len() as u64)];
    let t = TensorInfo {
        name: "t".into(),
        dtype: Dtype::I32,
        shape: shape.to_vec(),
        stored: Dtype::I32,
        data: TensorData::Boxes(boxes),
    };
    let ck = Checkpoint::new(Parts::new(Format::Dcp, dir.path().to_path_buf(), files, vec![t]))
        .unwrap_or_else(|e| panic!("{e}"));
    (dir, ck)
}

proptest! {
    /// However a tensor is cut into boxes, and however each box is stored, reading it gives
    /// its row-major elements, and a byte range of it gives that slice.
    #[test]
    fn boxes_read_back_row_major(
        shape in proptest::collection::vec(0u64..6, 0..4),
        cuts in proptest::collection::vec(proptest::collection::vec(0u64..7, 0..3), 4),
        transposed in proptest::collection::vec(any::<bool>(), 1..4),
        lo in 0u64..400,
        len in 0u64..400,
    ) {
        let (_dir, ck) = tiled(&shape, &cuts[..shape.len()], &transposed);
        let t = &ck.tensors()[0];
        let n = shape::numel(&shape).unwrap_or(0);
        let want: Vec<u8> = (0..n).flat_map(|i| (i as i32).to_le_bytes()).collect();
        prop_assert_eq!(ck.read_tensor(t).unwrap_or_default(), want.clone());
        let (lo, hi) = (lo.min(n * 4), (lo + len).min(n * 4));
        prop_assert_eq!(ck.read_tensor_range(t, lo..hi).unwrap_or_default(), want[lo as usize..hi as usize].to_vec());
        prop_assert!(t.run_count() >= t.runs().count() as u64);
    }
}

#[test]
fn boxes_that_do_not_tile_are_refused_by_name() {
    let (dir, ck) = tiled(&[4, 4], &[vec![2], vec![2]], &[false]);
    let mut t = ck.tensors()[0].clone();
    if let TensorData::Boxes(b) = &mut t.data {
        b.pop();
    }
    let err = Checkpoint::new(Parts::new(Format::Dcp, dir.path().to_path_buf(), ck.files.clone(), vec![t]))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.ends_with("tensor `t`: the boxes leave elements of size [4, 4] uncovered, from offsets [2, 2]"),
        "{err}"
    );
}
