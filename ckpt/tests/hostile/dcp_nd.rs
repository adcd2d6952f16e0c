//! Hostile checkpoints sharded on any dims (`fixtures/hostile/dcp_nd/`, written by
//! `fixtures/gen/hostile_dcp_nd.py` from real torch 2.13 fixtures): boxes that overlap, leave a
//! gap, lie outside the tensor or have the wrong number of dims, in DCP folders and in DCP's
//! Hugging Face storage. Every test pins our exact refusal through the catalog reader, `verify`
//! (reported as a problem) and `reshard` (no output left behind).
#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::PathBuf;

fn hostile(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hostile/dcp_nd").join(name)
}

/// `file` is relative to the case's folder (empty: the folder itself); `message` follows it.
fn refused(name: &str, format: &str, file: &str, message: &str) {
    let dir = hostile(name);
    let at = if file.is_empty() { dir.clone() } else { dir.join(file) };
    common::refused_everywhere(&dir, format, &format!("{}{message}", at.display()));
}

#[test]
fn overlapping_boxes_2d() {
    // torch's `dcp_to_torch_save` loads this one silently, elements overwritten.
    refused(
        "overlapping_boxes_2d",
        "dcp",
        "__3_0.distcp",
        " (rank 3): tensor `mesh2d.s0s1_f64`: box at offsets [2, 2] with sizes [2, 1] overlaps the box at offsets [0, 2] with sizes [3, 1]",
    );
}

#[test]
fn gap_2d() {
    // torch's `dcp_to_torch_save` loads this one silently, elements left uninitialized.
    refused(
        "gap_2d",
        "dcp",
        "",
        ": tensor `mesh2d.s1s2_f16`: the boxes leave elements of size [3, 5, 7] uncovered, from offsets [0, 3, 4]",
    );
}

#[test]
fn box_outside() {
    refused(
        "box_outside",
        "dcp",
        "__3_0.distcp",
        " (rank 3): tensor `mesh1d.s1_f32`: box at offsets [0, 7] with sizes [3, 1] lies outside size [3, 7]",
    );
}

#[test]
fn box_dims() {
    refused(
        "box_dims",
        "dcp",
        "__1_0.distcp",
        " (rank 1): tensor `mesh1d.s1_f32`: box at offsets [0, 2, 0] with sizes [3, 2] has 3 dims, the tensor [3, 7] has 2",
    );
}

const SHARD: &str = "shard-00002-model-00001-of-00003.safetensors";

#[test]
fn hf_no_sharding_info() {
    refused(
        "hf_no_sharding_info",
        "dcp-safetensors",
        SHARD,
        ": DCP metadata: the shard file has no `DCP_SHARDING_INFO` entry in its `__metadata__`",
    );
}

#[test]
fn hf_offsets_dims() {
    refused(
        "hf_offsets_dims",
        "dcp-safetensors",
        SHARD,
        " (rank 1): tensor `embed.weight`: `saved_offsets` [10, 0, 0] has 3 dims, its shape [10, 6] has 2",
    );
}

#[test]
fn hf_overlap() {
    refused(
        "hf_overlap",
        "dcp-safetensors",
        SHARD,
        " (rank 1): tensor `embed.weight`: box at offsets [0, 0] with sizes [10, 6] overlaps the box at offsets [0, 0] with sizes [10, 6]",
    );
}

#[test]
fn hf_unlisted() {
    refused(
        "hf_unlisted",
        "dcp-safetensors",
        SHARD,
        " (rank 1): tensor `ghost.weight`: `DCP_SHARDING_INFO` lists it but the file holds no such tensor",
    );
}

#[test]
fn hf_dtype_mismatch() {
    refused(
        "hf_dtype_mismatch",
        "dcp-safetensors",
        SHARD,
        " (rank 1): tensor `embed.weight`: its box is `F64` where another shard's is `F32`",
    );
}
