//! The `ckpt` binary end to end: exit codes, what goes to stdout and stderr, and `--help`.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;

#[test]
fn help_matches_the_snapshot() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    let snapshot = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/help.txt");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&snapshot, stdout(&out)).unwrap();
    }
    assert_eq!(stdout(&out), std::fs::read_to_string(&snapshot).unwrap());
}

#[test]
fn inspect_json_follows_the_documented_schema() {
    let path = fixtures().join("safetensors/model_sharded");
    let out = run(&["inspect", "--json", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stderr(&out), "");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["schema"], "statekit.inspect/2");
    assert_eq!(doc["format"], "hf-sharded-safetensors");
    assert_eq!(doc["files"].as_array().unwrap().len(), 5);
    let tensors = doc["tensors"].as_array().unwrap();
    assert_eq!(doc["totals"]["tensors"].as_u64().unwrap() as usize, tensors.len());
    let sum: u64 = tensors.iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(doc["totals"]["bytes"].as_u64().unwrap(), sum);
    assert_eq!(doc["index_metadata"]["total_size"].as_u64().unwrap(), sum);
    for t in tensors {
        for field in ["name", "dtype", "shape", "file", "offset", "bytes"] {
            assert!(!t[field].is_null(), "tensor field {field}");
        }
    }
}

#[test]
fn inspect_text_lists_every_tensor() {
    let path = fixtures().join("safetensors/all_dtypes.safetensors");
    let out = run(&["inspect", path.to_str().unwrap()]);
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(text.starts_with("format:  safetensors\n"), "{text}");
    assert!(text.contains("tensors: 25\n"));
    assert!(text.contains("\nNAME "));
    assert!(text.lines().any(|l| l.starts_with("t.f8_e4m3 ") && l.contains("F8_E4M3")));
}

#[test]
fn verify_exit_codes() {
    let ok = run(&["verify", fixtures().join("safetensors/model_sharded").to_str().unwrap()]);
    assert_eq!(ok.status.code(), Some(0));
    assert!(stdout(&ok).starts_with("ok: "));

    let bad = run(&["verify", fixtures().join("hostile/safetensors/truncated.safetensors").to_str().unwrap()]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(stdout(&bad).contains("problem: "));
    assert!(stdout(&bad).contains("file is 140 bytes but its header describes 143"));

    let missing = run(&["verify", "/nonexistent/model.safetensors"]);
    assert_eq!(missing.status.code(), Some(2));
    assert_eq!(stderr(&missing), "error: /nonexistent/model.safetensors: No such file or directory (os error 2)\n");

    let usage = run(&["verify"]);
    assert_eq!(usage.status.code(), Some(2));
}

#[test]
fn verify_json_reports_problems() {
    let out = run(&["verify", "--json", fixtures().join("hostile/safetensors/missing_shard").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["schema"], "statekit.verify/1");
    assert_eq!(doc["valid"], false);
    assert_eq!(doc["problems"].as_array().unwrap().len(), 1);
}

#[test]
fn bad_input_is_one_line_on_stderr_with_exit_2() {
    let out = run(&["inspect", fixtures().join("hostile/safetensors/unknown_dtype.safetensors").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(stdout(&out), "");
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: ") && err.contains("tensor `a` has unknown dtype `F128`"), "{err}");
}

#[test]
fn sizes_are_parsed_like_huggingface_hub() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("safetensors/model_single/model.safetensors");
    let out =
        run(&["split", src.to_str().unwrap(), dir.path().join("o").to_str().unwrap(), "--max-shard-size", "5GiB"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        "error: invalid size `5GiB`: unit `IB` is not one of `KB`, `MB`, `GB`, `TB` (sizes are decimal: `5GB` is 5·10⁹ bytes)\n"
    );
}

#[test]
fn split_prints_the_files_it_wrote_and_merge_restores_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.safetensors");
    let original = write_checkpoint(&src, 6, 1000, 7);
    let shards = dir.path().join("shards");
    let out =
        run(&["split", src.to_str().unwrap(), shards.to_str().unwrap(), "--max-shard-size", "10KB", "--checksums"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stderr(&out), "", "no progress or notes when stderr is not a terminal");
    let listed: Vec<String> = stdout(&out).lines().map(String::from).collect();
    let mut expected: Vec<String> =
        (1..=3).map(|i| shards.join(format!("model-0000{i}-of-00003.safetensors")).display().to_string()).collect();
    expected.push(shards.join("model.safetensors.index.json").display().to_string());
    assert_eq!(listed, expected);
    assert!(shards.join("SHA256SUMS").exists());

    let v = run(&["verify", shards.to_str().unwrap()]);
    assert!(stdout(&v).contains("3 checksum(s) matched"), "{}", stdout(&v));

    let merged = dir.path().join("merged.safetensors");
    let out = run(&["merge", shards.to_str().unwrap(), merged.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read(&merged).unwrap(), original);

    // A corrupted shard is caught by its checksum.
    let shard = shards.join("model-00002-of-00003.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let v = run(&["verify", shards.to_str().unwrap()]);
    assert_eq!(v.status.code(), Some(1));
    assert!(stdout(&v).contains("checksum mismatch for `model-00002-of-00003.safetensors`"), "{}", stdout(&v));
}

#[test]
fn mmap_and_kernel_copies_give_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.safetensors");
    write_checkpoint(&src, 5, 30_000, 3);
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    assert!(run(&["split", src.to_str().unwrap(), a.to_str().unwrap(), "--max-shard-size", "200KB"]).status.success());
    assert!(run(&[
        "--copy-method",
        "mmap",
        "split",
        src.to_str().unwrap(),
        b.to_str().unwrap(),
        "--max-shard-size",
        "200KB"
    ])
    .status
    .success());
    let names = |d: &std::path::Path| {
        let mut v: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
        v.sort();
        v
    };
    assert_eq!(names(&a), names(&b), "the same files");
    assert!(!names(&a).is_empty());
    for name in names(&a) {
        assert_eq!(std::fs::read(a.join(&name)).unwrap(), std::fs::read(b.join(&name)).unwrap(), "{name:?}");
    }
}

#[test]
fn refuses_to_overwrite_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("model.safetensors");
    let original = write_checkpoint(&src, 3, 100, 1);
    let out = run(&["split", src.to_str().unwrap(), dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("is the source, refusing to overwrite it"), "{}", stderr(&out));
    let out = run(&["merge", src.to_str().unwrap(), src.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(std::fs::read(&src).unwrap(), original);
}

#[test]
fn split_replaces_a_previous_checkpoint_in_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.safetensors");
    write_checkpoint(&big, 8, 1000, 1);
    let small = dir.path().join("small.safetensors");
    let small_bytes = write_checkpoint(&small, 2, 10, 2);
    let out = dir.path().join("out");
    assert!(run(&["split", big.to_str().unwrap(), out.to_str().unwrap(), "--max-shard-size", "5KB"]).status.success());
    assert!(run(&["split", small.to_str().unwrap(), out.to_str().unwrap()]).status.success());
    let mut names: Vec<String> =
        std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, vec!["model.safetensors"]);
    assert_eq!(std::fs::read(out.join("model.safetensors")).unwrap(), small_bytes);
}

/// Copies the files of `from` (and of its sub-folders) into `to`.
fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        match e.file_type().unwrap().is_dir() {
            true => copy_tree(&e.path(), &to.join(e.file_name())),
            false => drop(std::fs::copy(e.path(), to.join(e.file_name())).unwrap()),
        }
    }
}

/// `ckpt verify PATH`'s line, which counts the checksums it matched.
fn verified(path: &std::path::Path) -> String {
    let out = run(&["verify", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    stdout(&out)
}

#[test]
fn checksums_are_written_by_every_command_that_writes() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("safetensors/model_single/model.safetensors");
    let s = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    // convert: one file, and a folder of shards.
    let bin = dir.path().join("one/model.bin");
    std::fs::create_dir(dir.path().join("one")).unwrap();
    assert!(run(&["convert", &s(&src), &s(&bin), "--checksums"]).status.success());
    assert!(verified(&bin).contains("1 checksum(s) matched"), "{}", verified(&bin));
    let shards = dir.path().join("shards");
    let out = run(&["convert", &s(&src), &s(&shards), "--max-shard-size", "4KB", "--checksums"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(verified(&shards).contains("5 checksum(s) matched"), "{}", verified(&shards));
    // reshard: the manifest beside the rank files, which `verify` checks in a DCP folder.
    let dcp = dir.path().join("dcp");
    let out = run(&["reshard", &s(&fixtures().join("dcp/fsdp2_w2_f32/checkpoint")), &s(&dcp), "--world-size", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!dcp.join("SHA256SUMS").exists(), "none without the flag");
    let dcp3 = dir.path().join("dcp3");
    let src3 = fixtures().join("dcp/fsdp2_w2_f32/checkpoint");
    let out = run(&["reshard", &s(&src3), &s(&dcp3), "--world-size", "3", "--checksums"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let manifest = std::fs::read_to_string(dcp3.join("SHA256SUMS")).unwrap();
    let names: Vec<&str> = manifest.lines().map(|l| &l[66..]).collect();
    assert_eq!(names, ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]);
    assert!(verified(&dcp3).contains("3 checksum(s) matched"), "{}", verified(&dcp3));
    // merge: an accelerate folder's model and its optimizer, written by two plans into one
    // folder, are both in its manifest.
    let model = dir.path().join("merged/model.safetensors");
    let state = fixtures().join("accelerate/fsdp2_w2");
    let out = run(&["merge", &s(&state), &s(&model), "--optimizer", "--checksums"]);
    assert!(out.status.success(), "{}", stderr(&out));
    for file in [model.clone(), model.with_file_name("optimizer.safetensors")] {
        assert!(verified(&file).contains("1 checksum(s) matched"), "{}", verified(&file));
    }
}

#[test]
fn checksums_are_refused_for_an_output_spread_over_folders() {
    // A universal checkpoint keeps each parameter in a folder of its own: one `SHA256SUMS` of
    // plain names cannot list them, so the flag is refused rather than writing a wrong one.
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("universal");
    let src = fixtures().join("deepspeed/z2_fp32_ws2");
    let out = run(&["reshard", src.to_str().unwrap(), out_dir.to_str().unwrap(), "--world-size", "3", "--checksums"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        "error: `--checksums` writes one `SHA256SUMS` for the files of one folder, and this output has files in \
         `zero/embed.weight` too\n"
    );
    assert!(!out_dir.exists(), "nothing is written");
}

#[test]
fn every_command_that_reads_a_checkpoint_takes_the_open_options() {
    // A DeepSpeed folder whose `latest` names a tag that is not there: `--tag` picks the one
    // that is, for inspect, verify, merge and reshard alike.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("ds");
    copy_tree(&fixtures().join("deepspeed/z2_fp32_ws2"), &src);
    std::fs::write(src.join("latest"), "global_step9").unwrap();
    let src = src.to_str().unwrap();
    let merged = dir.path().join("m.safetensors");
    let universal = dir.path().join("u");
    let (m, u) = (merged.to_str().unwrap(), universal.to_str().unwrap());
    let commands: [&[&str]; 4] =
        [&["inspect", src], &["verify", src], &["merge", src, m], &["reshard", src, u, "--world-size", "3"]];
    for args in commands {
        let without = run(args);
        assert_eq!(without.status.code(), Some(2), "{args:?}");
        assert!(stderr(&without).contains("global_step9"), "{args:?}: {}", stderr(&without));
        let with = run(&[args, &["--tag", "global_step2"]].concat());
        assert!(with.status.success(), "{args:?}: {}", stderr(&with));
    }
    assert!(universal.join("global_step2_universal").is_dir());
    // Where a source does not have what the option is about, the library refuses it.
    let dcp = fixtures().join("dcp/fsdp2_w2_f32/checkpoint");
    let out = run(&["reshard", dcp.to_str().unwrap(), u, "--world-size", "2", "--tag", "global_step2"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.starts_with("error: `--tag` applies to DeepSpeed checkpoints only;") && err.ends_with(" is dcp\n"),
        "{err}"
    );
    let out = run(&["reshard", dcp.to_str().unwrap(), u, "--world-size", "2", "--as-stored"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("applies to Megatron `torch_dist` checkpoints only"), "{}", stderr(&out));
    assert!(!universal.join("__0_0.distcp").exists(), "nothing is written where an option is refused");
}

#[test]
fn max_shard_size_is_one_flag_parsed_one_way() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("safetensors/model_single/model.safetensors");
    let src = src.to_str().unwrap();
    let o = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    // Every command that shards its output reads the size the same way, and refuses a bad one
    // with the same message.
    let (split, convert) = (o("split"), o("convert"));
    for args in [["split", src, &split], ["convert", src, &convert]] {
        let out = run(&[&args[..], &["--max-shard-size", "4KB"]].concat());
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let bad = run(&[&args[..], &["--max-shard-size", "5GiB"]].concat());
        assert_eq!(bad.status.code(), Some(2));
        assert!(stderr(&bad).starts_with("error: invalid size `5GiB`: unit `IB`"), "{args:?}: {}", stderr(&bad));
    }
    assert_eq!(std::fs::read_dir(&split).unwrap().count(), std::fs::read_dir(&convert).unwrap().count());
    // DeepSpeed merges shard as `zero_to_fp32 --max_shard_size` does.
    let ds = fixtures().join("deepspeed/z2_fp32_ws2");
    let out = run(&["merge", ds.to_str().unwrap(), &o("ds"), "--max-shard-size", "1KB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(dir.path().join("ds/model.safetensors.index.json").exists());
    // `reshard` lays files out by rank, not by size: clap refuses the flag there.
    let dcp = fixtures().join("dcp/fsdp2_w2_f32/checkpoint");
    let out = run(&["reshard", dcp.to_str().unwrap(), &o("r"), "--world-size", "2", "--max-shard-size", "1KB"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("unexpected argument '--max-shard-size'"), "{}", stderr(&out));
}

#[test]
fn block_size_without_block_scaling_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("safetensors/model_single/model.safetensors");
    let dst = dir.path().join("o.safetensors");
    let out = run(&["convert", src.to_str().unwrap(), dst.to_str().unwrap(), "--block-size", "64"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("<--dequantize <DEQUANTIZE>|--quantize <QUANTIZE>>"), "{}", stderr(&out));
    assert!(!dst.exists());
}
