//! Hostile DCP folders (`fixtures/hostile/dcp/`, written by `fixtures/gen/hostile_dcp.py` from a
//! real torch 2.13 checkpoint): one per attack or defect. Every test pins our exact refusal
//! through the catalog reader, `verify` (reported as a problem, not an error) and `reshard` (no
//! output left behind), and checks that the payload of `forbidden_global` never ran.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::{Path, PathBuf};

const MARKER: &str = "statekit-pwned";

fn hostile(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hostile/dcp").join(name)
}

/// `file` is relative to the case's folder (empty: the folder itself); `message` follows it.
fn refused(name: &str, file: &str, message: &str) {
    let dir = hostile(name);
    let at = if file.is_empty() { dir.clone() } else { dir.join(file) };
    let out = common::refused_everywhere(&dir, "dcp", &format!("{}{message}", at.display()));
    for d in [Path::new("."), dir.as_path(), out.path()] {
        assert!(!d.join(MARKER).exists(), "{name}: the payload ran");
    }
}

#[test]
fn forbidden_global() {
    refused(
        "forbidden_global",
        ".metadata",
        ": refusing global `posix.system`: only the tensor-rebuilding globals of torch's weights-only loader are allowed",
    );
}

#[test]
fn chunk_beyond_file() {
    refused(
        "chunk_beyond_file",
        "__1_0.distcp",
        " (rank 1): tensor `model.embed.weight`: item at byte 0 of 20209 bytes runs past the end of the 16113-byte file",
    );
}

#[test]
fn overlapping_chunks() {
    // torch itself loads this one silently, rows 18 of the first chunk overwritten.
    refused(
        "overlapping_chunks",
        "__1_0.distcp",
        " (rank 1): tensor `embed.weight`: box at offsets [18, 0] with sizes [18, 16] overlaps the box at offsets [0, 0] with sizes [19, 16]",
    );
}

#[test]
fn gap_in_chunks() {
    // torch itself loads this one silently, rows 19..37 left uninitialized.
    refused(
        "gap_in_chunks",
        "",
        ": tensor `embed.weight`: the boxes leave elements of size [37, 16] uncovered, from offsets [19, 0]",
    );
}

#[test]
fn missing_distcp() {
    refused(
        "missing_distcp",
        ".metadata",
        ": tensor `model.embed.weight` is mapped to `__1_0.distcp`, which does not exist",
    );
}

#[test]
fn path_traversal() {
    refused(
        "path_traversal",
        ".metadata",
        ": DCP metadata: `model.embed.weight` is stored in `../../../../../../etc/passwd`, which is not a plain file name in the checkpoint's folder",
    );
}

/// A chunk whose metadata says one box (sizes `[24, 8]`, a column split) where its item holds
/// another (`[12, 16]`, a row split): boxes on any dims are read, but each must be what its item
/// holds.
#[test]
fn not_dim0() {
    refused(
        "not_dim0",
        "__0_0.distcp",
        " (rank 0): tensor `model.layers.0.weight`: the item at byte 2793 holds shape [12, 16] where the chunk at offsets [0, 0] has sizes [24, 8]",
    );
}
