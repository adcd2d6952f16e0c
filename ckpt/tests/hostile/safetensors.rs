//! One test per malformed or malicious checkpoint in `fixtures/hostile/safetensors/` (written by
//! `fixtures/gen/hostile_safetensors.py`). Each pins the one-line error: it names the file and,
//! where there is one, the tensor. Nothing panics.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hostile/safetensors")
}

/// Opens the fixture and returns its error with the fixture folder replaced by `{dir}`.
fn open_err(name: &str) -> String {
    let path = dir().join(name);
    let err = ckpt::Checkpoint::open(path.to_str().unwrap()).expect_err("hostile input must be refused");
    let msg = err.to_string();
    assert!(!msg.contains('\n'), "error is one line: {msg}");
    assert!(err.is_invalid_data(), "{name} is a defective checkpoint, not a usage error");
    msg.replace(dir().to_str().unwrap(), "{dir}")
}

/// `verify` reports the same defect as a problem, rather than failing.
fn verify_problems(name: &str) -> Vec<String> {
    let report = ckpt::verify(dir().join(name).to_str().unwrap()).expect("verify runs");
    assert!(!report.is_valid());
    report.problems.iter().map(|p| p.to_string().replace(dir().to_str().unwrap(), "{dir}")).collect()
}

#[test]
fn truncated_file() {
    assert_eq!(
        open_err("truncated.safetensors"),
        "{dir}/truncated.safetensors: file is 140 bytes but its header describes 143 (truncated file or trailing bytes)"
    );
}

#[test]
fn trailing_bytes() {
    assert_eq!(
        open_err("trailing_bytes.safetensors"),
        "{dir}/trailing_bytes.safetensors: file is 145 bytes but its header describes 143 (truncated file or trailing bytes)"
    );
}

#[test]
fn file_shorter_than_the_length_prefix() {
    assert_eq!(
        open_err("too_small.safetensors"),
        "{dir}/too_small.safetensors: file is 3 bytes, too short for a safetensors header (8 bytes)"
    );
}

#[test]
fn header_length_beyond_the_file() {
    assert_eq!(
        open_err("header_beyond_file.safetensors"),
        "{dir}/header_beyond_file.safetensors: header length 4096 runs past the end of the 10-byte file"
    );
}

#[test]
fn header_length_over_the_cap_is_refused_before_allocating() {
    assert_eq!(
        open_err("header_too_large.safetensors"),
        "{dir}/header_too_large.safetensors: header length 100000001 is larger than the 100000000 bytes allowed"
    );
}

#[test]
fn overlapping_offsets() {
    assert_eq!(
        open_err("overlap.safetensors"),
        "{dir}/overlap.safetensors: tensor `b` starts at data offset 4, expected 8 (offsets overlap or leave a gap)"
    );
}

#[test]
fn gap_between_offsets() {
    assert_eq!(
        open_err("gap.safetensors"),
        "{dir}/gap.safetensors: tensor `b` starts at data offset 12, expected 8 (offsets overlap or leave a gap)"
    );
}

#[test]
fn unknown_dtype() {
    assert_eq!(
        open_err("unknown_dtype.safetensors"),
        "{dir}/unknown_dtype.safetensors: tensor `a` has unknown dtype `F128`"
    );
}

#[test]
fn bad_json_header() {
    assert_eq!(
        open_err("bad_json.safetensors"),
        "{dir}/bad_json.safetensors: header is not valid JSON: EOF while parsing a value at line 1 column 22"
    );
}

#[test]
fn header_not_utf8() {
    assert_eq!(
        open_err("not_utf8.safetensors"),
        "{dir}/not_utf8.safetensors: header is not valid JSON: not UTF-8 (invalid utf-8 sequence of 1 bytes from index 2)"
    );
}

#[test]
fn size_not_matching_shape() {
    assert_eq!(
        open_err("size_mismatch.safetensors"),
        "{dir}/size_mismatch.safetensors: tensor `a`: shape [2, 2] of `F32` needs 16 bytes but its offsets span 12"
    );
}

#[test]
fn negative_dimension() {
    assert_eq!(
        open_err("negative_shape.safetensors"),
        "{dir}/negative_shape.safetensors: tensor `a`: invalid value: integer `-1`, expected u64"
    );
}

#[test]
fn shape_product_overflow() {
    assert_eq!(
        open_err("shape_overflow.safetensors"),
        "{dir}/shape_overflow.safetensors: tensor `a`: shape [4611686018427387904, 8] of `F32` overflows or is not a whole number of bytes"
    );
}

#[test]
fn metadata_values_must_be_strings() {
    assert_eq!(
        open_err("metadata_not_string.safetensors"),
        "{dir}/metadata_not_string.safetensors: `__metadata__` must map strings to strings: value of `epoch` is a number"
    );
}

#[test]
fn duplicate_name_in_one_header() {
    // The safetensors crate silently keeps the last entry; we refuse.
    assert_eq!(
        open_err("duplicate_name.safetensors"),
        "{dir}/duplicate_name.safetensors: tensor `a` appears twice in the header"
    );
}

#[test]
fn index_points_at_a_missing_file() {
    let want = "{dir}/missing_shard/model.safetensors.index.json: tensor `v` is mapped to `model-00002-of-00002.safetensors`, which does not exist";
    assert_eq!(open_err("missing_shard"), want);
    assert_eq!(verify_problems("missing_shard"), vec![want.to_string()]);
}

#[test]
fn same_tensor_in_two_shards() {
    let want = "tensor `w` is in both {dir}/duplicate_across_shards/model-00001-of-00002.safetensors and {dir}/duplicate_across_shards/model-00002-of-00002.safetensors";
    assert_eq!(open_err("duplicate_across_shards"), want);
    assert_eq!(verify_problems("duplicate_across_shards"), vec![want.to_string()]);
}

#[test]
fn shard_holds_a_tensor_the_index_does_not_list() {
    assert_eq!(
        open_err("unlisted_tensor"),
        "{dir}/unlisted_tensor/model.safetensors.index.json: shard {dir}/unlisted_tensor/model-00001-of-00002.safetensors holds tensor `extra`, which the `weight_map` does not list"
    );
}

#[test]
fn index_maps_tensors_to_the_wrong_shards() {
    let problems = verify_problems("wrong_shard");
    assert_eq!(
        problems,
        vec![
            "{dir}/wrong_shard/model.safetensors.index.json: tensor `w` is mapped to `model-00002-of-00002.safetensors`, which does not hold it",
            "{dir}/wrong_shard/model.safetensors.index.json: tensor `v` is mapped to `model-00001-of-00002.safetensors`, which does not hold it",
        ]
    );
}

#[test]
fn index_path_traversal_is_refused_before_opening() {
    assert_eq!(
        open_err("path_traversal"),
        "{dir}/path_traversal/model.safetensors.index.json: `weight_map` entry `w` points at `../truncated.safetensors`, which is not a plain file name in the index's folder"
    );
}

#[test]
fn index_not_json() {
    assert_eq!(
        open_err("index_not_json"),
        "{dir}/index_not_json/model.safetensors.index.json: index is invalid: not JSON: key must be a string at line 1 column 2"
    );
}

#[test]
fn every_fixture_has_a_test() {
    // A new hostile file without a test here would be an untested attack.
    let src = include_str!("safetensors.rs");
    for entry in std::fs::read_dir(dir()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(src.contains(&format!("\"{name}\"")), "no test for fixture {name}");
    }
}

/// A tensor named with a newline, a NUL and an escape sequence (`fixtures/hostile/output/`):
/// the error keeps the name as the file holds it, so a caller compares names, and
/// `escape_controls`, which every edge applies as it prints, makes the message one harmless line.
#[test]
fn an_error_keeps_a_hostile_name_as_it_is_and_escaping_it_is_the_printers_job() {
    let path = dir().join("../output/control_chars_name.safetensors");
    let name = "w\nok: forged\0\u{1b}[2J";
    let err = ckpt::Checkpoint::open(path.to_str().unwrap()).expect_err("a size that does not match its shape");
    let ckpt::Error::SizeMismatch { tensor, .. } = &err else { panic!("not a size mismatch: {err:?}") };
    assert_eq!(tensor, name);
    let raw = err.to_string();
    assert_eq!(
        raw,
        format!("{}: tensor `{name}`: shape [4] of `F32` needs 16 bytes but its offsets span 8", path.display())
    );
    let printed = ckpt::escape_controls(&raw);
    assert_eq!(printed, raw.replace(name, r"w\nok: forged\0\u{1b}[2J"));
    assert!(!printed.chars().any(char::is_control), "{printed}");

    // `verify` keeps its problems as errors; its JSON document, which the CLI prints and the
    // bindings return, is escaped as a printed message is.
    let report = ckpt::verify(path.to_str().unwrap()).expect("verify runs");
    assert_eq!(report.problems.iter().map(ToString::to_string).collect::<Vec<_>>(), [raw.as_str()]);
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["problems"], serde_json::json!([printed]));
}
