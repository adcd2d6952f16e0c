//! One flipped byte inside a tensor's stored bytes (issue 22, section 1). Every storage of a
//! torch file, and every tensor item of a DCP rank file, is a zip record whose CRC32 the
//! archive carries: reads check it, so merge, convert, reshard, reads and verify refuse the
//! damaged tensor by file, tensor and rank, and nothing is written. Made at test time from the
//! real tools' fixtures.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::{Path, PathBuf};

use common::copy_tree;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// The damage done: where, and the CRCs before and after.
struct Flip {
    file: PathBuf,
    tensor: String,
    /// What the message calls it.
    named: String,
    rank: Option<u64>,
    stored: u32,
    actual: u32,
}

/// Flips one byte in the middle of the stored bytes of the first tensor (with bytes) whose
/// name satisfies `pick`, in the checkpoint at `src`.
fn flip(src: &Path, pick: impl Fn(&str) -> bool) -> Flip {
    let ck = ckpt::Checkpoint::open(src.to_str().unwrap()).unwrap();
    let (t, b) = ck
        .tensors()
        .iter()
        .filter(|t| pick(&t.name))
        .find_map(|t| t.boxes().iter().find(|b| b.len > 0).map(|b| (t, b.clone())))
        .expect("a tensor with stored bytes");
    let f = &ck.files()[b.file];
    let mut bytes = std::fs::read(&f.path).unwrap();
    let record = b.base as usize..(b.base + b.len) as usize;
    let stored = crc32fast::hash(&bytes[record.clone()]);
    bytes[record.start + record.len() / 2] ^= 0x40;
    let actual = crc32fast::hash(&bytes[record]);
    std::fs::write(&f.path, &bytes).unwrap();
    Flip { file: f.path.clone(), tensor: t.name.clone(), named: t.name.clone(), rank: f.rank, stored, actual }
}

/// The message's start (the record's name follows) and end.
fn expected(f: &Flip) -> (String, String) {
    let rank = f.rank.map(|r| format!(" (rank {r})")).unwrap_or_default();
    (
        format!("{}{rank}: tensor `{}`: record `", f.file.display(), f.named),
        format!(
            "fails its CRC32 check (the archive says {:08x}, the bytes give {:08x}): the file was damaged after it was written",
            f.stored, f.actual
        ),
    )
}

fn assert_refused(err: &ckpt::Error, f: &Flip) {
    let (head, tail) = expected(f);
    let text = err.to_string();
    assert!(text.starts_with(&head) && text.ends_with(&tail), "{text}\nexpected {head}…{tail}");
    assert!(err.is_invalid_data());
}

fn empty(dir: &Path) -> bool {
    std::fs::read_dir(dir).unwrap().next().is_none()
}

/// Every operation that reads the damaged tensor refuses it, and `verify` reports it.
fn all_refuse(src: &Path, f: &Flip) {
    let s = src.to_str().unwrap();
    let ck = ckpt::Checkpoint::open(s).unwrap();
    let t = ck.tensors().iter().find(|t| t.name == f.tensor).unwrap();
    assert_refused(&ck.read_tensor(t).unwrap_err(), f);
    // A slice of the tensor is refused too: the CRC covers its whole record.
    assert_refused(&ck.read_tensor_range(t, 0..t.byte_len().min(4)).unwrap_err(), f);

    let out = tempfile::tempdir().unwrap();
    let w = ckpt::WriteOptions::default();
    let err = ckpt::convert(&ck, &out.path().join("m.safetensors"), &ckpt::ConvertOptions::default(), &w).unwrap_err();
    assert_refused(&err, f);
    assert!(empty(out.path()), "convert left output behind");

    let report = ckpt::verify(s).unwrap();
    let texts: Vec<String> = report.problems.iter().map(ToString::to_string).collect();
    let (head, tail) = expected(f);
    assert_eq!(texts.iter().filter(|p| p.starts_with(&head) && p.ends_with(&tail)).count(), 1, "{texts:?}");
    assert!(!report.is_valid());
}

#[test]
fn a_flipped_byte_in_a_torch_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("basic.pt");
    copy_tree(&fixtures().join("torch/basic.pt"), &src);
    let f = flip(&src, |_| true);
    all_refuse(&src, &f);
}

#[test]
fn a_flipped_byte_in_a_dcp_model_item_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("ck");
    copy_tree(&fixtures().join("dcp/fsdp2_w2_f32/checkpoint"), &src);
    let f = flip(&src, |_| true);
    assert!(f.rank.is_some());
    all_refuse(&src, &f);
    let ck = ckpt::Checkpoint::open(src.to_str().unwrap()).unwrap();
    let out = dir.path().join("out");
    assert_refused(&ckpt::reshard(&ck, &out, 3, &ckpt::WriteOptions::default()).unwrap_err(), &f);
    assert!(!out.exists() || empty(&out), "reshard left output behind");
}

#[test]
fn a_flipped_byte_in_a_dcp_optimizer_moment_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("ck");
    copy_tree(&fixtures().join("accelerate/fsdp2_w2"), &src);
    let optim = src.join("optimizer_0");
    let mut f = flip(&optim, |n| n.ends_with("exp_avg_sq"));
    // The message names the item by its DCP key, which accelerate nests under `optimizer`.
    f.named = format!("optimizer.{}", f.tensor);
    all_refuse(&optim, &f);
    // The save_state folder's merge reads the model and its optimizer.
    let ck = ckpt::Checkpoint::open(src.to_str().unwrap()).unwrap();
    let out = dir.path().join("merged");
    let opts = ckpt::MergeOptions { optimizer: true, ..Default::default() };
    assert_refused(&ckpt::merge(&ck, &out, &opts, &ckpt::WriteOptions::default()).unwrap_err(), &f);
}

#[test]
fn a_flipped_byte_in_a_deepspeed_partition_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("ck");
    copy_tree(&fixtures().join("deepspeed/z2_fp32_ws2"), &src);
    let ck = ckpt::Checkpoint::open(src.to_str().unwrap()).unwrap();
    // ZeRO weights are slices of flat partitions: damage the first tensor's first stored byte.
    let (fi, off) = ck.tensors().iter().find_map(|t| t.location().map(|l| (l, t))).map(|(l, _)| l).unwrap();
    let path = ck.files()[fi].path.clone();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[off as usize] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let ck = ckpt::Checkpoint::open(src.to_str().unwrap()).unwrap();
    let out = dir.path().join("m.safetensors");
    let err = ckpt::merge(&ck, &out, &ckpt::MergeOptions::default(), &ckpt::WriteOptions::default()).unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with(&format!("{} (rank ", path.display())), "{text}");
    assert!(text.contains("fails its CRC32 check"), "{text}");
    assert!(!out.exists());
    let report = ckpt::verify(src.to_str().unwrap()).unwrap();
    assert!(report.problems.iter().any(|p| p.to_string().contains("fails its CRC32 check")));
}

#[test]
fn a_flipped_byte_in_a_pickle_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("basic.pt");
    copy_tree(&fixtures().join("torch/basic.pt"), &src);
    let bytes = std::fs::read(&src).unwrap();
    let mut damaged = bytes.clone();
    // torch writes `data.pkl` first; its payload follows the local header, whose name starts
    // at byte 30. The byte after the PROTO opcode is the protocol number: 2 becomes 3.
    let name_len = u16::from_le_bytes([bytes[26], bytes[27]]) as usize;
    let extra_len = u16::from_le_bytes([bytes[28], bytes[29]]) as usize;
    assert!(bytes[30..30 + name_len].ends_with(b"data.pkl"), "data.pkl is the first record");
    let payload = 30 + name_len + extra_len;
    damaged[payload + 1] ^= 0x01;
    std::fs::write(&src, &damaged).unwrap();
    let err = ckpt::Checkpoint::open(src.to_str().unwrap()).unwrap_err();
    let text = err.to_string();
    let record = String::from_utf8_lossy(&bytes[30..30 + name_len]).into_owned();
    assert!(text.starts_with(&format!("{}: record `{record}` fails its CRC32 check", src.display())), "{text}");
}
