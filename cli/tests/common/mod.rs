//! Helpers shared by the CLI tests: run the real binary, make checkpoints with the
//! `safetensors` crate (an independent writer).
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::{Dtype, TensorView};

pub fn ckpt() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ckpt"))
}

pub fn run(args: &[&str]) -> Output {
    ckpt().args(args).output().unwrap()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// Writes `count` F32 tensors of `floats` elements each, filled from `seed`, with
/// `{"format": "pt"}` metadata, the way `safetensors.torch.save_file` would.
pub fn write_checkpoint(path: &Path, count: usize, floats: usize, seed: u32) -> Vec<u8> {
    let datas: Vec<Vec<u8>> = (0..count)
        .map(|i| {
            (0..floats as u32).flat_map(|j| (j.wrapping_mul(2654435761) ^ seed ^ i as u32).to_le_bytes()).collect()
        })
        .collect();
    let views: Vec<(String, TensorView)> = datas
        .iter()
        .enumerate()
        .map(|(i, d)| (format!("layers.{i}.weight"), TensorView::new(Dtype::F32, vec![floats], d).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, Some(HashMap::from([("format".into(), "pt".into())])), path).unwrap();
    std::fs::read(path).unwrap()
}

/// The bytes a checkpoint folder or file merges to, or `None` when `verify` rejects it.
pub fn accepted_content(path: &Path, scratch: &Path) -> Option<Vec<u8>> {
    let v = run(&["verify", path.to_str().unwrap()]);
    if v.status.code() != Some(0) {
        return None;
    }
    let merged = scratch.join("check.safetensors");
    let _ = std::fs::remove_file(&merged);
    let m = run(&["merge", path.to_str().unwrap(), merged.to_str().unwrap()]);
    assert!(m.status.success(), "verify accepted {} but merge failed: {}", path.display(), stderr(&m));
    Some(std::fs::read(&merged).unwrap())
}

/// The pids of the `ckpt` ranks whose command lines name `marker`.
pub fn ranks_of(marker: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if comm.trim() == "ckpt" && String::from_utf8_lossy(&cmdline).contains(marker) {
            pids.push(pid);
        }
    }
    pids
}
