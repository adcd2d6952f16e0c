//! The second round of hostile inputs (issue 22, section 5), made at test time: each is refused
//! by name, or read, within a memory bound measured as the peak RSS (`VmHWM`) of a child process
//! running the one case, not by the budget's own count.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::copy_tree;

const CHILD: &str = "STATEKIT_ROUND2_CHILD";

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// Runs the test `name` of this binary again in a child process and returns its peak RSS in
/// bytes; in the child (where `CHILD` is set) returns `None` and the caller does the work.
fn peak_rss_of(name: &str) -> Option<u64> {
    if std::env::var_os(CHILD).is_some() {
        return None;
    }
    // The harness names a test by its path inside the binary (`peak_memory::NAME`).
    let path = format!("{}::{name}", module_path!().split_once("::").map_or("", |(_, module)| module));
    let out = Command::new(std::env::current_exe().unwrap())
        .args([path.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name} in a child: {text}");
    // The harness may print the test's name on the same line.
    let kb: u64 = text
        .split_once("peak-rss-kb: ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{name}: no peak RSS reported: {text}"))
        .parse()
        .unwrap();
    Some(kb << 10)
}

/// In the child: reports its peak RSS for [`peak_rss_of`].
fn report_peak_rss() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).unwrap().trim().trim_end_matches(" kB").trim();
    println!("peak-rss-kb: {kb}");
}

#[test]
fn dcp_sparse_metadata_refused_before_it_is_read() {
    const LIMIT: u64 = 64 << 20;
    if let Some(peak) = peak_rss_of("dcp_sparse_metadata_refused_before_it_is_read") {
        assert!(peak < LIMIT, "peak RSS {peak} bytes, over {LIMIT}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    copy_tree(&fixtures().join("dcp/fsdp2_w8_f32_bare/checkpoint"), &dir);
    // A real metadata, then a gigabyte of holes.
    std::fs::OpenOptions::new().write(true).open(dir.join(".metadata")).unwrap().set_len(1 << 30).unwrap();
    let src = dir.to_str().unwrap();
    let expected = format!(
        "{}: DCP metadata: `.metadata` is 1073741824 bytes, over the 16777216 bytes allowed: the folder's 8 other \
         files (73164 bytes) hold at most 142 items of 512 bytes or more, at 1024 bytes of metadata each \
         (16777216 bytes at least)",
        dir.join(".metadata").display()
    );
    let err = ckpt::Checkpoint::open(src).unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert!(err.is_invalid_data());
    let report = ckpt::verify(src).unwrap();
    assert_eq!(report.problems.iter().map(ToString::to_string).collect::<Vec<_>>(), vec![expected.clone()]);
    report_peak_rss();
}

#[test]
fn deepspeed_broadcast_buffer_is_one_view_not_a_range_per_element() {
    // `fixtures/gen/hostile_broadcast_buffer.py`: the buffer `scale` is 2^30 fp32 elements of stride 0
    // over a 20-byte storage. It used to become one range per element (a 12 GB table).
    const LIMIT: u64 = 256 << 20;
    if let Some(peak) = peak_rss_of("deepspeed_broadcast_buffer_is_one_view_not_a_range_per_element") {
        assert!(peak < LIMIT, "peak RSS {peak} bytes, over {LIMIT}");
        return;
    }
    let dir = fixtures().join("hostile/broadcast_buffer/deepspeed_broadcast_buffer");
    let src = dir.to_str().unwrap();
    let ck = ckpt::Checkpoint::open(src).unwrap();
    let scale = ck.tensors().iter().find(|t| t.name == "scale").unwrap();
    assert_eq!(scale.shape, vec![1 << 30]);

    let report = ckpt::verify(src).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(
        report.warnings,
        vec!["tensor `scale` is a broadcast view: writing it takes 4294967296 bytes from a 20-byte storage, which \
              split, merge and convert refuse without `allow_expanded`"
            .to_string()]
    );

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("merged.safetensors");
    let err = ckpt::merge(&ck, &out, &ckpt::MergeOptions::default(), &ckpt::WriteOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}: tensor `scale` is a broadcast view: writing it takes 4294967296 bytes from a 20-byte storage",
            dir.join("global_step2/mp_rank_00_model_states.pt").display()
        )
    );
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "no output left behind");
    report_peak_rss();
}

/// A valid safetensors file of `n` one-element F32 tensors named `t.<i>` (the names in an order
/// the writer's sort changes, so no two copies merge); returns the header's length.
fn many_tensors(path: &Path, n: usize) -> u64 {
    use std::io::Write;
    let mut json = String::from("{");
    for i in 0..n {
        let sep = if i == 0 { "" } else { "," };
        json.push_str(&format!(
            "{sep}\"t.{i}\":{{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[{},{}]}}",
            4 * i,
            4 * i + 4
        ));
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(json.as_bytes()).unwrap();
    f.write_all(&vec![0u8; 4 * n]).unwrap();
    f.flush().unwrap();
    json.len() as u64
}

const MANY: usize = 200_000;

#[test]
fn safetensors_merge_of_many_tensors_stays_proportional_to_the_header() {
    // The header of 200 000 tensors is 13.8 MB. Opening the file takes about 4 times that (the
    // catalog), the merge about 2 more (the new header, each tensor's offset and copy); it took
    // 16 more when the header was built as a JSON tree.
    const HEADER: u64 = 13_833_344;
    let name = "safetensors_merge_of_many_tensors_stays_proportional_to_the_header";
    if let Some(peak) = peak_rss_of(name) {
        assert!(peak < 10 * HEADER, "peak RSS {peak} bytes, over 10 times the {HEADER}-byte header");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("many.safetensors");
    assert_eq!(many_tensors(&src, MANY), HEADER);
    let ck = ckpt::Checkpoint::open(src.to_str().unwrap()).unwrap();
    assert_eq!(ck.tensors().len(), MANY);
    let out = tmp.path().join("merged.safetensors");
    ckpt::merge(&ck, &out, &ckpt::MergeOptions::default(), &ckpt::WriteOptions::default()).unwrap();
    drop(ck);
    report_peak_rss();
    // Past the measure: the same entries, sorted by name.
    assert_eq!(std::fs::metadata(&out).unwrap().len(), std::fs::metadata(&src).unwrap().len());
    let merged = ckpt::Checkpoint::open(out.to_str().unwrap()).unwrap();
    assert_eq!(merged.tensors().len(), MANY);
    assert_eq!(merged.tensors()[0].name, "t.0");
    assert_eq!(merged.tensors()[1].name, "t.1");
    assert_eq!(merged.tensors()[2].name, "t.10");
}
