#![allow(clippy::unwrap_used)]

use super::*;
use crate::read::catalog::{Checkpoint, Format, Parts, SourceFile};
use proptest::prelude::*;

/// A file in memory and the source tensors stored in it.
struct Store {
    bytes: Vec<u8>,
    tensors: Vec<TensorInfo>,
    /// Each source's elements, row-major, by name.
    values: HashMap<String, (Vec<u64>, Vec<Vec<u8>>)>,
}

/// A small deterministic generator, so one seed is one whole case.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

fn dtype_of(elem: u64) -> Dtype {
    match elem {
        1 => Dtype::U8,
        2 => Dtype::I16,
        _ => Dtype::I32,
    }
}

/// Element `e` of tensor `salt`: distinct bytes for every element of every tensor.
fn element(salt: u64, e: u64, elem: u64) -> Vec<u8> {
    let v = (salt << 12) | e;
    v.to_le_bytes()[..elem as usize].to_vec()
}

fn index_of(flat: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0; shape.len()];
    let mut rest = flat;
    for (i, &n) in idx.iter_mut().zip(shape).rev() {
        *i = rest % n;
        rest /= n;
    }
    idx
}

fn flat_of(idx: &[u64], shape: &[u64]) -> u64 {
    idx.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

impl Store {
    fn new() -> Store {
        Store { bytes: vec![0xee; 3], tensors: Vec::new(), values: HashMap::new() }
    }

    fn values_of(name: &str, salt: u64, shape: &[u64], elem: u64) -> (String, Vec<Vec<u8>>) {
        let n = shape.iter().product::<u64>();
        (name.to_string(), (0..n).map(|e| element(salt, e, elem)).collect())
    }

    /// A source stored row-major as byte ranges, cut at random elements, with gaps between.
    fn add_ranges(&mut self, rng: &mut Rng, name: &str, shape: &[u64], elem: u64) {
        let salt = self.tensors.len() as u64 + 1;
        let (name, vals) = Store::values_of(name, salt, shape, elem);
        let mut chunks = Vec::new();
        let mut e = 0usize;
        while e < vals.len() {
            let take = 1 + rng.below(vals.len() as u64 - e as u64) as usize;
            self.bytes.extend(std::iter::repeat_n(0xee, rng.below(5) as usize));
            let offset = self.bytes.len() as u64;
            for v in &vals[e..e + take] {
                self.bytes.extend(v);
            }
            chunks.push(Chunk { file: 0, offset, len: take as u64 * elem });
            e += take;
        }
        self.tensors.push(TensorInfo::ranges(name.clone(), dtype_of(elem), shape.to_vec(), chunks));
        self.values.insert(name, (shape.to_vec(), vals));
    }

    /// A source stored as a grid of boxes (cut in up to two on each dim), each box its own
    /// storage laid out in a random dim order (a transposed view), at a random element offset.
    fn add_boxes(&mut self, rng: &mut Rng, name: &str, shape: &[u64], elem: u64) {
        let salt = self.tensors.len() as u64 + 1;
        let (name, vals) = Store::values_of(name, salt, shape, elem);
        let cuts: Vec<Vec<(u64, u64)>> = shape
            .iter()
            .map(|&n| {
                let c = rng.below(n + 1);
                [(0, c), (c, n - c)].into_iter().filter(|&(_, s)| s > 0).collect()
            })
            .collect();
        let mut cells: Vec<Vec<(u64, u64)>> = vec![Vec::new()];
        for dim in &cuts {
            cells = cells.iter().flat_map(|c| dim.iter().map(move |d| [c.clone(), vec![*d]].concat())).collect();
        }
        let mut boxes = Vec::new();
        for cell in cells {
            let (offsets, sizes): (Vec<u64>, Vec<u64>) = cell.into_iter().unzip();
            // Storage order: a random permutation of the dims.
            let mut order: Vec<usize> = (0..sizes.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let mut strides = vec![0u64; sizes.len()];
            let mut acc = 1;
            for &d in order.iter().rev() {
                strides[d] = acc;
                acc *= sizes[d];
            }
            let skip = rng.below(3);
            let numel: u64 = sizes.iter().product();
            self.bytes.extend(std::iter::repeat_n(0xee, rng.below(5) as usize));
            let base = self.bytes.len() as u64;
            let mut storage = vec![0xddu8; ((skip + numel) * elem) as usize];
            for e in 0..numel {
                let local = index_of(e, &sizes);
                let at = skip + local.iter().zip(&strides).map(|(i, s)| i * s).sum::<u64>();
                let global: Vec<u64> = local.iter().zip(&offsets).map(|(i, o)| i + o).collect();
                let v = &vals[flat_of(&global, shape) as usize];
                storage[(at * elem) as usize..((at + 1) * elem) as usize].copy_from_slice(v);
            }
            self.bytes.extend(&storage);
            boxes.push(TensorBox {
                region: Region::new(offsets, sizes),
                file: 0,
                base,
                len: storage.len() as u64,
                offset: skip,
                strides,
            });
        }
        let dtype = dtype_of(elem);
        let data = TensorData::Boxes(boxes);
        self.tensors.push(TensorInfo { name: name.clone(), dtype, shape: shape.to_vec(), stored: dtype, data });
        self.values.insert(name, (shape.to_vec(), vals));
    }

    /// The map applied, through the catalog's own checks, each target read by its runs.
    fn read(&self, map: &ModelMap) -> Result<Vec<(String, Vec<u8>)>> {
        let root = Path::new("mem");
        let tensors = map.apply(root, &self.tensors)?;
        let files = vec![SourceFile::new("mem".into(), self.bytes.len() as u64)];
        let ck = Checkpoint::new(Parts::new(Format::Safetensors, root.into(), files, tensors))?;
        Ok(ck
            .tensors()
            .iter()
            .map(|t| {
                let mut out = Vec::new();
                for (_, off, len) in t.runs() {
                    out.extend_from_slice(&self.bytes[off as usize..(off + len) as usize]);
                }
                (t.name.clone(), out)
            })
            .collect())
    }

    /// What a target reads, computed from the sources' values in plain Rust.
    fn expect(&self, target: &Target) -> Vec<u8> {
        let numel: u64 = target.shape.iter().product();
        let mut out = Vec::new();
        for e in 0..numel {
            let idx = index_of(e, &target.shape);
            let p = target
                .pieces
                .iter()
                .find(|p| idx.iter().zip(&p.at.offsets).zip(&p.at.sizes).all(|((&i, &o), &s)| i >= o && i < o + s))
                .expect("the pieces tile the target");
            let (shape, vals) = &self.values[&p.source];
            let mut src = p.from.clone();
            for (k, axis) in p.axes.iter().enumerate() {
                if let Axis::Source { dim, step } = axis {
                    src[*dim] += (idx[k] - p.at.offsets[k]) * step;
                }
            }
            out.extend(&vals[flat_of(&src, shape) as usize]);
        }
        out
    }
}

/// A random axis-aligned view of a source: each dim held at an index or walked with a step,
/// the walked dims in a random order, maybe a new size-1 axis; then cut on its first dim into
/// pieces that together tile it.
fn random_target(rng: &mut Rng, name: &str, source: &str, shape: &[u64]) -> Target {
    let mut from = vec![0; shape.len()];
    let mut walks = Vec::new();
    for (d, &n) in shape.iter().enumerate() {
        if rng.below(4) == 0 {
            from[d] = rng.below(n);
            continue;
        }
        let start = rng.below(n);
        let step = 1 + rng.below(2);
        let count = 1 + rng.below((n - 1 - start) / step + 1);
        from[d] = start;
        walks.push((d, step, count));
    }
    for i in (1..walks.len()).rev() {
        walks.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut axes: Vec<Axis> = walks.iter().map(|&(dim, step, _)| Axis::Source { dim, step }).collect();
    let mut sizes: Vec<u64> = walks.iter().map(|w| w.2).collect();
    if rng.below(3) == 0 {
        let at = rng.below(axes.len() as u64 + 1) as usize;
        axes.insert(at, Axis::New);
        sizes.insert(at, 1);
    }
    let whole = Piece { at: Region::whole(&sizes), source: source.to_string(), from, axes };
    // Cut on the first dim, when there is one.
    let pieces = match (sizes.first(), whole.axes.first()) {
        (Some(&n), Some(&Axis::Source { dim, step })) if n > 1 => {
            let c = 1 + rng.below(n - 1);
            let mut a = whole.clone();
            a.at.sizes[0] = c;
            let mut b = whole;
            b.at.offsets[0] = c;
            b.at.sizes[0] = n - c;
            b.from[dim] += c * step;
            vec![b, a]
        }
        _ => vec![whole],
    };
    Target::new(name, sizes, pieces)
}

fn random_shape(rng: &mut Rng) -> Vec<u64> {
    (0..1 + rng.below(3)).map(|_| 1 + rng.below(5)).collect()
}

proptest! {
    /// Applying a map then reading the targets gives what slicing the source arrays gives,
    /// whatever the sources' storage (byte ranges, strided boxes) and the views.
    #[test]
    fn a_mapped_catalog_reads_as_the_sliced_sources(seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let mut store = Store::new();
        let elem = [1, 2, 4][rng.below(3) as usize];
        let shapes: Vec<Vec<u64>> = (0..2).map(|_| random_shape(&mut rng)).collect();
        for (i, shape) in shapes.iter().enumerate() {
            let name = format!("s{i}");
            if rng.below(2) == 0 {
                store.add_ranges(&mut rng, &name, shape, elem);
            } else {
                store.add_boxes(&mut rng, &name, shape, elem);
            }
        }
        let mut map = ModelMap::new("test view");
        let mut targets = Vec::new();
        for (i, shape) in shapes.iter().enumerate() {
            for j in 0..2 {
                let t = random_target(&mut rng, &format!("t{i}.{j}"), &format!("s{i}"), shape);
                targets.push(t.clone());
                map.push(t);
            }
        }
        let got = store.read(&map).unwrap();
        for (t, (name, bytes)) in targets.iter().zip(got) {
            prop_assert_eq!(&name, &t.name);
            prop_assert_eq!(bytes, store.expect(t), "{:?}", t);
        }
    }

    /// Byte ranges cut into boxes read as the ranges do, element for element.
    #[test]
    fn ranges_read_as_boxes_read_the_same(seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let mut store = Store::new();
        let shape = random_shape(&mut rng);
        store.add_ranges(&mut rng, "s", &shape, 2);
        let mut map = ModelMap::new("test view");
        // Two pieces force the boxes path: the first row apart from the rest.
        let n = shape[0];
        let mut pieces = vec![Piece::range("s", &shape, 0, 0..1, 0)];
        if n > 1 {
            pieces.push(Piece::range("s", &shape, 0, 1..n, 1));
        }
        let t = Target::new("t", shape.clone(), pieces);
        map.push(t.clone());
        let got = store.read(&map).unwrap();
        prop_assert_eq!(&got[0].1, &store.expect(&t));
        prop_assert_eq!(&got[0].1, &store.values["s"].1.concat());
    }
}

#[test]
fn a_stacked_key_cut_into_its_layers_reads_each_layer() {
    let mut rng = Rng(7);
    let mut store = Store::new();
    store.add_boxes(&mut rng, "layers.w", &[3, 4, 2], 2);
    let mut map = ModelMap::new("one-rank model");
    let targets: Vec<Target> = (0..3)
        .map(|l| Target::new(format!("layers.{l}.w"), vec![4, 2], vec![Piece::index("layers.w", &[3, 4, 2], 0, l)]))
        .collect();
    for t in &targets {
        map.push(t.clone());
    }
    let got = store.read(&map).unwrap();
    let all = store.values["layers.w"].1.concat();
    for (l, (name, bytes)) in got.into_iter().enumerate() {
        assert_eq!(name, format!("layers.{l}.w"));
        assert_eq!(bytes, all[l * 16..(l + 1) * 16]);
    }
}

#[test]
fn stacking_layers_is_the_inverse_of_cutting_them() {
    let mut rng = Rng(3);
    let mut store = Store::new();
    store.add_ranges(&mut rng, "l0", &[2, 3], 4);
    store.add_boxes(&mut rng, "l1", &[2, 3], 4);
    let mut map = ModelMap::new("stacked");
    let pieces = vec![Piece::stacked("l0", &[2, 3], 0, 0), Piece::stacked("l1", &[2, 3], 0, 1)];
    map.push(Target::new("layers.w", vec![2, 2, 3], pieces));
    let got = store.read(&map).unwrap();
    assert_eq!(got[0].1, [store.values["l0"].1.concat(), store.values["l1"].1.concat()].concat());
}

/// Megatron's fused QKV of 2 query groups, 2 query heads per group, head size 1, hidden 3:
/// rows `q0 q1 k v | q2 q3 k v`; Q is rows 0, 1, 4, 5.
#[test]
fn strided_groups_gather_the_fused_qkv_into_q_k_and_v() {
    let mut rng = Rng(11);
    let mut store = Store::new();
    let shape = [8, 3];
    store.add_boxes(&mut rng, "qkv", &shape, 2);
    let mut map = ModelMap::new("attention");
    map.push(Target::new("q", vec![4, 3], Piece::groups("qkv", &shape, 2, 4, 0, 2, 0)));
    map.push(Target::new("k", vec![2, 3], Piece::groups("qkv", &shape, 2, 4, 2, 1, 0)));
    map.push(Target::new("v", vec![2, 3], Piece::groups("qkv", &shape, 2, 4, 3, 1, 0)));
    let got = store.read(&map).unwrap();
    let rows = |rs: &[usize]| -> Vec<u8> {
        rs.iter().flat_map(|&r| store.values["qkv"].1[r * 3..r * 3 + 3].concat()).collect()
    };
    assert_eq!(got[0].1, rows(&[0, 1, 4, 5]));
    assert_eq!(got[1].1, rows(&[2, 6]));
    assert_eq!(got[2].1, rows(&[3, 7]));
}

/// Two tensor-parallel ranks' pieces of a column-parallel weight, concatenated on dim 0.
#[test]
fn row_ranges_of_two_ranks_concatenate_into_one_tensor() {
    let mut rng = Rng(5);
    let mut store = Store::new();
    store.add_boxes(&mut rng, "rank0/w", &[2, 3], 4);
    store.add_ranges(&mut rng, "rank1/w", &[2, 3], 4);
    let mut map = ModelMap::new("one-rank model");
    let pieces = vec![Piece::whole("rank0/w", &[2, 3]), Piece::whole("rank1/w", &[2, 3]).shifted(&[2, 0])];
    map.push(Target::new("w", vec![4, 3], pieces));
    let got = store.read(&map).unwrap();
    assert_eq!(got[0].1, [store.values["rank0/w"].1.concat(), store.values["rank1/w"].1.concat()].concat());
}

fn refusal(map: &ModelMap, store: &Store) -> (String, String) {
    match map.apply(Path::new("ckpt"), &store.tensors) {
        Err(Error::BadModelMap { tensor, problem, .. }) => (tensor, problem.to_string()),
        other => panic!("expected a refused map, got {other:?}"),
    }
}

#[test]
fn pieces_that_overlap_or_leave_a_hole_are_refused_naming_the_target() {
    let mut rng = Rng(1);
    let mut store = Store::new();
    store.add_ranges(&mut rng, "w", &[4, 2], 1);
    let mut overlap = ModelMap::new("view");
    overlap.push(Target::new(
        "t",
        vec![4, 2],
        vec![Piece::range("w", &[4, 2], 0, 0..3, 0), Piece::range("w", &[4, 2], 0, 2..4, 2)],
    ));
    let (tensor, problem) = refusal(&overlap, &store);
    assert_eq!(tensor, "t");
    assert!(problem.starts_with("its pieces do not tile it: "), "{problem}");

    let mut hole = ModelMap::new("view");
    hole.push(Target::new("t", vec![4, 2], vec![Piece::range("w", &[4, 2], 0, 0..3, 0)]));
    let (tensor, problem) = refusal(&hole, &store);
    assert_eq!(tensor, "t");
    assert!(problem.starts_with("its pieces do not tile it: "), "{problem}");
    let e = hole.apply(Path::new("ckpt"), &store.tensors).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::InvalidData);
    assert_eq!(e.variant_name(), "BadModelMap");
}

#[test]
fn a_source_no_target_reads_is_refused_by_name_unless_left_out() {
    let mut rng = Rng(2);
    let mut store = Store::new();
    store.add_ranges(&mut rng, "kept", &[2], 1);
    store.add_ranges(&mut rng, "optimizer.state", &[2], 1);
    let mut map = ModelMap::new("one-rank model");
    map.push(Target::renamed("model.kept", "kept", &[2]));
    let (tensor, problem) = refusal(&map, &store);
    assert_eq!(tensor, "optimizer.state");
    assert_eq!(problem, "no tensor of the one-rank model is made from it, and it is not one the format leaves out");
    map.leave_out("optimizer.state");
    let got = store.read(&map).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, "model.kept");
}

#[test]
fn a_piece_that_reads_outside_or_nowhere_is_refused() {
    let mut rng = Rng(4);
    let mut store = Store::new();
    store.add_ranges(&mut rng, "w", &[4, 2], 1);
    let mut outside = ModelMap::new("view");
    outside.push(Target::new("t", vec![2, 2], vec![Piece::range("w", &[4, 2], 0, 3..5, 0)]));
    assert_eq!(
        refusal(&outside, &store),
        ("t".into(), "a piece at offsets [0, 0] with sizes [2, 2] reads outside `w` of shape [4, 2]".into())
    );
    let mut unknown = ModelMap::new("view");
    unknown.push(Target::renamed("t", "nothing", &[4, 2]));
    assert_eq!(
        refusal(&unknown, &store),
        ("t".into(), "a piece reads `nothing`, which the source does not hold".into())
    );
    let mut twice = ModelMap::new("view");
    let mut p = Piece::whole("w", &[4, 2]);
    p.axes[1] = Axis::Source { dim: 0, step: 1 };
    twice.push(Target::new("t", vec![4, 2], vec![p]));
    assert!(refusal(&twice, &store).1.contains("reads outside `w`"));
}

#[test]
fn a_cast_target_keeps_its_stored_bytes_and_says_its_dtype() {
    let mut rng = Rng(6);
    let mut store = Store::new();
    store.add_ranges(&mut rng, "w", &[2], 4);
    store.tensors[0].dtype = Dtype::F32;
    store.tensors[0].stored = Dtype::F32;
    let mut map = ModelMap::new("view");
    map.push(Target { cast: Some(Dtype::BF16), ..Target::renamed("w", "w", &[2]) });
    let t = map.apply(Path::new("ckpt"), &store.tensors).unwrap();
    assert_eq!((t[0].dtype, t[0].stored), (Dtype::BF16, Dtype::F32));
    store.tensors[0].dtype = Dtype::I32;
    store.tensors[0].stored = Dtype::I32;
    assert_eq!(refusal(&map, &store).1, "it is stored as `I32`, which does not cast to `BF16`");
}

/// Q, K and V interleaved into the fused QKV and gathered back: the two directions of an
/// architecture table are inverse maps.
#[test]
fn interleaving_q_k_and_v_is_the_inverse_of_gathering_them() {
    let mut rng = Rng(13);
    let mut store = Store::new();
    store.add_boxes(&mut rng, "q", &[4, 3], 2);
    store.add_ranges(&mut rng, "k", &[2, 3], 2);
    store.add_boxes(&mut rng, "v", &[2, 3], 2);
    let mut fuse = ModelMap::new("megatron model");
    let pieces = [
        Piece::interleaved("q", &[4, 3], 2, 4, 0, 2),
        Piece::interleaved("k", &[2, 3], 2, 4, 2, 1),
        Piece::interleaved("v", &[2, 3], 2, 4, 3, 1),
    ]
    .concat();
    let qkv = Target::new("qkv", vec![8, 3], pieces);
    fuse.push(qkv.clone());
    let fused = store.read(&fuse).unwrap();
    assert_eq!(fused[0].1, store.expect(&qkv));
    let row = |t: &str, r: usize| store.values[t].1[r * 3..r * 3 + 3].concat();
    let want: Vec<u8> =
        [row("q", 0), row("q", 1), row("k", 0), row("v", 0), row("q", 2), row("q", 3), row("k", 1), row("v", 1)]
            .concat();
    assert_eq!(fused[0].1, want);

    // And back, from the fused tensor as the mapped catalog describes it.
    let fused_catalog = fuse.apply(Path::new("mem"), &store.tensors).unwrap();
    let mut back = ModelMap::new("hugging face model");
    back.push(Target::new("q", vec![4, 3], Piece::groups("qkv", &[8, 3], 2, 4, 0, 2, 0)));
    back.push(Target::new("k", vec![2, 3], Piece::groups("qkv", &[8, 3], 2, 4, 2, 1, 0)));
    back.push(Target::new("v", vec![2, 3], Piece::groups("qkv", &[8, 3], 2, 4, 3, 1, 0)));
    let again = Store { bytes: store.bytes.clone(), tensors: fused_catalog, values: HashMap::new() };
    let got = again.read(&back).unwrap();
    for (name, bytes) in got {
        assert_eq!(bytes, store.values[&name].1.concat(), "{name}");
    }
}

/// One expert of one layer of a tensor stacked on both.
#[test]
fn two_stacked_axes_are_held_at_once() {
    let mut rng = Rng(17);
    let mut store = Store::new();
    let shape = [2, 3, 2, 2];
    store.add_boxes(&mut rng, "experts.w", &shape, 1);
    let mut map = ModelMap::new("experts");
    let mut targets = Vec::new();
    for layer in 0..2 {
        for expert in 0..3 {
            let t = Target::new(
                format!("layers.{layer}.experts.{expert}.w"),
                vec![2, 2],
                vec![Piece::indices("experts.w", &shape, &[(0, layer), (1, expert)])],
            );
            targets.push(t.clone());
            map.push(t);
        }
    }
    let got = store.read(&map).unwrap();
    let all = store.values["experts.w"].1.concat();
    for (i, (t, (_, bytes))) in targets.iter().zip(got).enumerate() {
        assert_eq!(bytes, all[i * 4..(i + 1) * 4], "{}", t.name);
    }
}
