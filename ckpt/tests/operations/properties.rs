//! Property tests.
//!
//! - split then merge is the identity, byte for byte, for any tensors and any shard size;
//! - kernel copies and memory-map copies produce the same bytes;
//! - our header validation accepts exactly what the `safetensors` crate accepts (except
//!   duplicate names, which we refuse and it silently collapses).
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;

use proptest::prelude::*;
use safetensors::tensor::{Dtype as StDtype, TensorView};

const DTYPES: [StDtype; 8] = [
    StDtype::F32,
    StDtype::BF16,
    StDtype::F16,
    StDtype::I64,
    StDtype::U8,
    StDtype::BOOL,
    StDtype::F8_E4M3,
    StDtype::F64,
];

#[derive(Debug, Clone)]
struct Tensor {
    name: String,
    dtype: usize,
    shape: Vec<usize>,
    seed: u8,
}

fn tensors() -> impl Strategy<Value = Vec<Tensor>> {
    let one =
        ("[a-z]{1,3}(\\.[a-z0-9]{1,3}){0,2}", 0..DTYPES.len(), prop::collection::vec(0usize..5, 0..3), any::<u8>())
            .prop_map(|(name, dtype, shape, seed)| Tensor { name, dtype, shape, seed });
    prop::collection::vec(one, 0..12).prop_map(|mut v| {
        let mut seen = std::collections::HashSet::new();
        v.retain(|t| seen.insert(t.name.clone()));
        v
    })
}

/// Writes the tensors with the `safetensors` crate itself, the reference writer.
fn write_reference(ts: &[Tensor], path: &Path) -> Vec<u8> {
    let datas: Vec<Vec<u8>> = ts
        .iter()
        .map(|t| {
            let n: usize = t.shape.iter().product::<usize>() * DTYPES[t.dtype].bitsize() / 8;
            (0..n)
                .map(|i| {
                    (i as u8).wrapping_mul(31).wrapping_add(t.seed)
                        & if DTYPES[t.dtype] == StDtype::BOOL { 1 } else { 0xff }
                })
                .collect()
        })
        .collect();
    let views: Vec<(String, TensorView)> = ts
        .iter()
        .zip(&datas)
        .map(|(t, d)| (t.name.clone(), TensorView::new(DTYPES[t.dtype], t.shape.clone(), d).unwrap()))
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
    std::fs::read(path).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn split_then_merge_is_the_identity(ts in tensors(), max in 1u64..400, mapped in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src.safetensors");
        let original = write_reference(&ts, &src);
        let copy = if mapped { ckpt::CopyMethod::Mapped } else { ckpt::CopyMethod::Auto };
        let opts = ckpt::WriteOptions { copy, ..Default::default() };

        let ck = ckpt::Checkpoint::open(src.to_str().unwrap()).unwrap();
        let shards = dir.path().join("shards");
        let split = ckpt::split(&ck, &shards, max, &opts).unwrap();
        prop_assert_eq!(split.bytes, ck.total_bytes());
        if ts.is_empty() {
            prop_assert!(split.files.is_empty());
            return Ok(());
        }
        let report = ckpt::verify(shards.to_str().unwrap()).unwrap();
        prop_assert!(report.is_valid(), "{:?}", report.problems);

        let sharded = ckpt::Checkpoint::open(shards.to_str().unwrap()).unwrap();
        let merged = dir.path().join("merged.safetensors");
        ckpt::merge(&sharded, &merged, &Default::default(), &opts).unwrap();
        prop_assert_eq!(std::fs::read(&merged).unwrap(), original);
    }

    #[test]
    fn validation_matches_the_safetensors_crate(ts in tensors(), cut in 0usize..64, extra in 0usize..3, shift in 0usize..4, victim in any::<prop::sample::Index>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let mut bytes = write_reference(&ts, &path);
        // Damage the file: move one tensor's offsets, cut its end, or append bytes.
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let names: Vec<String> = header.keys().filter(|k| *k != "__metadata__").cloned().collect();
        if shift > 0 && !names.is_empty() {
            let name = &names[victim.index(names.len())];
            let offs = header[name]["data_offsets"].as_array().unwrap().clone();
            let (b, e) = (offs[0].as_u64().unwrap(), offs[1].as_u64().unwrap());
            header[name]["data_offsets"] = serde_json::json!([b + shift as u64 - 1, e + (shift as u64 / 2)]);
            let mut h = serde_json::to_vec(&header).unwrap();
            h.resize(h.len().next_multiple_of(8), b' ');
            let data = bytes[8 + n..].to_vec();
            bytes = (h.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(&h);
            bytes.extend_from_slice(&data);
        }
        let cut = cut.min(bytes.len());
        if cut % 3 == 1 { bytes.truncate(bytes.len() - cut); }
        bytes.extend(std::iter::repeat_n(0u8, extra));
        std::fs::write(&path, &bytes).unwrap();

        let theirs = safetensors::SafeTensors::deserialize(&bytes).is_ok();
        let ours = ckpt::Checkpoint::open(path.to_str().unwrap()).is_ok();
        prop_assert_eq!(ours, theirs, "file of {} bytes", bytes.len());
    }
}
