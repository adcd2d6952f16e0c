//! FP8 tensors as torch 2.13 writes them (`fixtures/gen/fp8_fixtures.py`): every FP8 dtype,
//! through `save_file` and `torch.save` (with a transposed, non-contiguous one), read back to
//! the dtype, shape and bytes torch recorded in `tensors.json`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use ckpt::{Checkpoint, Dtype};
use sha2::{Digest, Sha256};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/fp8")
}

fn check(file: &str) {
    let text = std::fs::read_to_string(root().join("tensors.json")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    let expected = expected["tensors"].as_object().unwrap();
    let ck = Checkpoint::open(root().join(file).to_str().unwrap()).unwrap();
    assert_eq!(ck.tensors().len(), expected.len(), "{file}");
    for t in ck.tensors() {
        let e = &expected[&t.name];
        assert_eq!(t.dtype.torch_name(), e["dtype"], "{file}: {}", t.name);
        assert_eq!(serde_json::json!(t.shape), e["shape"], "{file}: {}", t.name);
        let sha: String = Sha256::digest(ck.read_tensor(t).unwrap()).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(sha, e["sha256"], "{file}: {}", t.name);
    }
    let dtypes: Vec<Dtype> = ck.tensors().iter().map(|t| t.dtype).collect();
    for d in [Dtype::F8E4M3, Dtype::F8E5M2, Dtype::F8E4M3Fnuz, Dtype::F8E5M2Fnuz, Dtype::F8E8M0] {
        assert!(dtypes.contains(&d), "{file}: no {d}");
    }
}

#[test]
fn save_file_fp8_tensors_read_back_as_torch_wrote_them() {
    check("tensors.safetensors");
}

#[test]
fn torch_save_fp8_tensors_read_back_as_torch_wrote_them() {
    check("tensors.pt");
}

fn convert(src: &std::path::Path, dst: &std::path::Path, blocks: ckpt::BlockScaling) -> ckpt::Result<ckpt::Outcome> {
    let ck = Checkpoint::open(src.to_str().unwrap())?;
    let options = ckpt::ConvertOptions { blocks: Some(blocks), ..Default::default() };
    ckpt::convert(&ck, dst, &options, &ckpt::WriteOptions::default())
}

#[test]
fn dequantize_drops_the_scales_and_widens_only_the_fp8_weights() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    convert(&root().join("blockscaled"), &out, ckpt::BlockScaling::Dequantize { to: Dtype::BF16, block: 128 }).unwrap();
    let src = Checkpoint::open(root().join("blockscaled").to_str().unwrap()).unwrap();
    let got = Checkpoint::open(out.to_str().unwrap()).unwrap();
    let kept: Vec<&str> =
        src.tensors().iter().map(|t| t.name.as_str()).filter(|n| !n.ends_with("_scale_inv")).collect();
    let mut names: Vec<&str> = got.tensors().iter().map(|t| t.name.as_str()).collect();
    names.sort();
    let mut want = kept.clone();
    want.sort();
    assert_eq!(names, want);
    assert!(got.tensors().iter().all(|t| t.dtype == Dtype::BF16));
    // A 1-D norm of ones is copied as is.
    let norm = got.tensors().iter().find(|t| t.name == "model.layers.0.norm.weight").unwrap();
    assert!(got.read_tensor(norm).unwrap().chunks(2).all(|b| b == [0x80, 0x3f]));
}

#[test]
fn a_scale_shape_that_does_not_match_the_blocks_is_refused_with_both_names() {
    let dir = tempfile::tempdir().unwrap();
    let w = vec![0u8; 300 * 200];
    let s = vec![0u8; 2 * 2 * 4];
    let views = vec![
        ("a.weight", safetensors::tensor::TensorView::new(safetensors::Dtype::F8_E4M3, vec![300, 200], &w).unwrap()),
        ("a.weight_scale_inv", safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 2], &s).unwrap()),
    ];
    let src = dir.path().join("bad.safetensors");
    safetensors::serialize_to_file(views, None, &src).unwrap();
    let out = dir.path().join("out.safetensors");
    let err = convert(&src, &out, ckpt::BlockScaling::Dequantize { to: Dtype::BF16, block: 128 }).unwrap_err();
    assert_eq!(
        err.to_string(),
        "block-scaled weight `a.weight` with scales `a.weight_scale_inv`: the scales have shape [2, 2], \
         but a weight of shape [300, 200] in blocks of 128 needs [3, 2]"
    );
    assert!(!out.exists());
}
