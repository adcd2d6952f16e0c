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
