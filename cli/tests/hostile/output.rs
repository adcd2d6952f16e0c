//! The output side under attack: one test per class of the hardening issue, each pinning the
//! refusal. Small hostile files come from `fixtures/gen/hostile_outputs.py`; large, sparse and
//! special files (FIFOs, planted links, gigabyte indexes) are made here at run time. Commands
//! that read hostile input run under a 1 GiB address-space limit, so a memory regression fails
//! instead of swapping.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;

/// Runs `ckpt args` under `ulimit -v` (1 GiB) with a wall-clock limit, so neither an
/// allocation blow-up nor a hang can pass.
fn bounded(args: &[&str]) -> Output {
    let exe = env!("CARGO_BIN_EXE_ckpt");
    let child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 1048576; exec \"$0\" \"$@\"")
        .arg(exe)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Output is drained while the child runs (a full pipe must not stall it).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output().unwrap()));
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(out) => out,
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("`ckpt {}` did not finish within 60 s", args.join(" "));
        }
    }
}

/// A copy of a fixture folder (or file) in a fresh temporary folder.
fn copy_fixture(rel: &str, dir: &Path) -> PathBuf {
    let src = fixtures().join(rel);
    let dst = dir.join(src.file_name().unwrap());
    let status = Command::new("cp").arg("-r").arg(&src).arg(&dst).status().unwrap();
    assert!(status.success());
    dst
}

/// Every file under `dir` with its bytes, to show nothing changed.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_dir() {
                todo.push(p);
            } else if meta.is_file() {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

// 1. An operation never damages its source.

#[test]
fn merge_refuses_to_write_over_the_files_that_make_a_folder_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = copy_fixture("deepspeed/z2_fp32_ws2", tmp.path());
    let dcp = copy_fixture("dcp/fsdp2_w2_f32/checkpoint", tmp.path());
    for (src, member) in [(&ds, ds.join("latest")), (&dcp, dcp.join(".metadata"))] {
        let before = snapshot(src);
        let out = bounded(&["merge", s(src), s(&member)]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert_eq!(
            stderr(&out),
            format!("error: `{}` is the source, refusing to overwrite it\n", member.display()),
            "the refusal names the source file"
        );
        assert_eq!(snapshot(src), before, "{}: the source is untouched", src.display());
    }
    // A sharded folder converted into itself would sweep its own index and shards.
    let sharded = copy_fixture("safetensors/model_sharded", tmp.path());
    let before = snapshot(&sharded);
    let out = bounded(&["convert", s(&sharded), s(&sharded), "--max-shard-size", "4KB"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).ends_with("is the source, refusing to overwrite it\n"), "{}", stderr(&out));
    assert_eq!(snapshot(&sharded), before);
}

#[test]
fn a_refused_reshard_leaves_nothing_behind_and_can_be_run_again() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("deepspeed/z2_fp32_ws2");
    let out_dir = tmp.path().join("universal");
    std::fs::create_dir(&out_dir).unwrap();
    // A planted link where the commit marker goes: refused before anything is written.
    symlink(tmp.path().join("victim"), out_dir.join("latest_universal")).unwrap();
    for _ in 0..2 {
        let out = bounded(&["reshard", s(&src), s(&out_dir), "--world-size", "3"]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert_eq!(
            stderr(&out),
            format!(
                "error: resharding {}: `{}` is a symlink that was not named as the output, refusing to replace it\n",
                src.display(),
                out_dir.join("latest_universal").display()
            )
        );
        let left: Vec<_> = std::fs::read_dir(&out_dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("latest_universal")], "nothing else was left");
        assert!(!tmp.path().join("victim").exists(), "nothing was written through the link");
    }
    std::fs::remove_file(out_dir.join("latest_universal")).unwrap();
    let out = bounded(&["reshard", s(&src), s(&out_dir), "--world-size", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

// 2. Never follow a planted path.

#[test]
fn a_planted_symlink_in_the_output_folder_is_never_written_through() {
    let tmp = tempfile::tempdir().unwrap();
    let victim = tmp.path().join("victim.txt");
    std::fs::write(&victim, b"precious").unwrap();
    let out_dir = tmp.path().join("shards");
    std::fs::create_dir(&out_dir).unwrap();
    symlink(&victim, out_dir.join("SHA256SUMS")).unwrap();
    let src = fixtures().join("safetensors/model_single/model.safetensors");
    let out = bounded(&["split", s(&src), s(&out_dir), "--max-shard-size", "4KB", "--checksums"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(
        stderr(&out),
        format!(
            "error: splitting {}: `{}` is a symlink that was not named as the output, refusing to replace it\n",
            src.display(),
            out_dir.join("SHA256SUMS").display()
        )
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    // Temporaries never had a predictable name to plant: no `.NAME.tmp.PID` is ever used.
    let names: Vec<String> =
        std::fs::read_dir(&out_dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, vec!["SHA256SUMS".to_string()], "nothing left behind");
}

#[test]
fn a_symlink_the_user_named_as_the_output_is_replaced_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let victim = tmp.path().join("victim.txt");
    std::fs::write(&victim, b"precious").unwrap();
    let named = tmp.path().join("merged.safetensors");
    symlink(&victim, &named).unwrap();
    let src = fixtures().join("safetensors/model_sharded");
    let out = bounded(&["merge", s(&src), s(&named)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!std::fs::symlink_metadata(&named).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
}

#[test]
fn a_fifo_in_place_of_a_shard_or_latest_is_refused_by_name_without_blocking() {
    let tmp = tempfile::tempdir().unwrap();
    let sharded = copy_fixture("safetensors/model_sharded", tmp.path());
    let shard = sharded.join("model-00002-of-00005.safetensors");
    std::fs::remove_file(&shard).unwrap();
    assert!(Command::new("mkfifo").arg(&shard).status().unwrap().success());
    let out = bounded(&["inspect", s(&sharded)]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        format!("error: {}: is a FIFO, not a regular file; refusing to read it\n", shard.display())
    );

    let ds = copy_fixture("deepspeed/z2_fp32_ws2", tmp.path());
    std::fs::remove_file(ds.join("latest")).unwrap();
    assert!(Command::new("mkfifo").arg(ds.join("latest")).status().unwrap().success());
    let out = bounded(&["merge", s(&ds), s(&tmp.path().join("m.safetensors"))]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        format!("error: {}: is a FIFO, not a regular file; refusing to read it\n", ds.join("latest").display())
    );
}

// 3. Resources are bounded by the input, and refused past a limit.

/// Replaces `path` with a sparse file of `len` bytes (no disk, but a size that a read-it-whole
/// reader would try to hold).
fn sparse(path: &Path, len: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(len).unwrap();
}

#[test]
fn gigabyte_indexes_metadata_and_latest_are_refused_before_they_are_read() {
    let tmp = tempfile::tempdir().unwrap();
    let sharded = copy_fixture("safetensors/model_sharded", tmp.path());
    let index = sharded.join("model.safetensors.index.json");
    sparse(&index, 1 << 30);
    let out = bounded(&["inspect", s(&sharded)]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        format!(
            "error: {}: record `the whole file` is 1073741824 bytes, over the 268435456-byte limit\n",
            index.display()
        )
    );

    let dcp = copy_fixture("dcp/fsdp2_w2_f32/checkpoint", tmp.path());
    sparse(&dcp.join(".metadata"), 3 << 30);
    let out = bounded(&["inspect", s(&dcp)]);
    assert_eq!(out.status.code(), Some(2));
    // The cap is what the folder's data files can need, not a fixed gigabyte.
    assert!(
        stderr(&out).contains("`.metadata` is 3221225472 bytes, over the 16777216 bytes allowed"),
        "{}",
        stderr(&out)
    );

    let ds = copy_fixture("deepspeed/z2_fp32_ws2", tmp.path());
    sparse(&ds.join("latest"), 1 << 30);
    let out = bounded(&["inspect", s(&ds)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("is 1073741824 bytes, over the 4096-byte limit"), "{}", stderr(&out));
}

#[test]
fn a_broadcast_view_is_refused_with_its_name_and_both_sizes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("hostile/output/expanded_view.pt");
    let dst = tmp.path().join("x.safetensors");
    let out = bounded(&["convert", s(&src), s(&dst)]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        format!(
            "error: {}: tensor `x` is a broadcast view: writing it takes 1073741824 bytes from a 4-byte storage; \
             hint: `--allow-expanded` writes it anyway\n",
            src.display()
        )
    );
    assert!(!dst.exists());
    // Reading it costs nothing: the catalog describes the view without walking it.
    let out = bounded(&["inspect", s(&src)]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn world_sizes_past_the_limit_are_usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dcp = fixtures().join("dcp/fsdp2_w2_f32/checkpoint");
    let model = fixtures().join("safetensors/model_single/model.safetensors");
    let out_dir = tmp.path().join("out");
    let runs: [&[&str]; 3] = [
        &["reshard", s(&dcp), s(&out_dir), "--world-size", "10000000000000"],
        &["convert", s(&model), s(&out_dir), "--to", "dcp", "--world-size", "1000000000"],
        &["data", "plan", "--len", "10", "--batch-size", "2", "--world-size", "100000000000"],
    ];
    for args in runs {
        let out = bounded(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let value = args.last().unwrap();
        assert!(
            stderr(&out).starts_with(&format!("error: invalid value '{value}' for '--world-size")),
            "{}",
            stderr(&out)
        );
        assert!(stderr(&out).contains("is not in 1..=1048576"), "{}", stderr(&out));
    }
    assert!(!out_dir.exists());
}

#[test]
fn a_loader_state_claiming_a_huge_world_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state.json");
    let mut sampler =
        dataload::ShardedSampler::builder().dataset_len(100).batch_size(4).world_size(2).rank(0).build().unwrap();
    sampler.next_batch().unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&sampler.state_dict().to_json().unwrap()).unwrap();
    doc["world_size"] = serde_json::json!(1_000_000_000_000u64);
    std::fs::write(&state, serde_json::to_vec(&doc).unwrap()).unwrap();
    let out = bounded(&["data", "state", s(&state)]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("world size 1000000000000 is more than the 1048576 ranks any run has"),
        "{}",
        stderr(&out)
    );
}

// 4. One verdict, clean messages.

#[test]
fn names_with_control_characters_are_escaped_in_every_message() {
    let src = fixtures().join("hostile/output/control_chars_name.safetensors");
    let out = bounded(&["verify", s(&src)]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert_eq!(text.lines().count(), 2, "no forged line: {text}");
    assert!(text.contains(r"tensor `w\nok: forged\0\u{1b}[2J`"), "{text}");
    let out = bounded(&["inspect", s(&src)]);
    assert_eq!(stderr(&out).lines().count(), 1);
    assert!(stderr(&out).contains(r"w\nok: forged\0\u{1b}[2J"), "{}", stderr(&out));
}

#[test]
fn verify_reports_exactly_what_merge_refuses() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cases: Vec<PathBuf> = Vec::new();
    for kind in ["safetensors", "dcp", "deepspeed"] {
        for e in std::fs::read_dir(fixtures().join("hostile").join(kind)).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if !name.ends_with(".md") && !name.ends_with(".json") && !name.starts_with('.') {
                cases.push(p);
            }
        }
    }
    assert!(cases.len() > 20, "the hostile folders hold the cases: {}", cases.len());
    for (i, case) in cases.iter().enumerate() {
        let verify = bounded(&["verify", s(case)]);
        let merged = tmp.path().join(format!("{i}.safetensors"));
        let merge = bounded(&["merge", s(case), s(&merged)]);
        let refused = !merge.status.success();
        let invalid = verify.status.code() != Some(0);
        assert_eq!(
            invalid,
            refused,
            "{}: verify says {:?}, merge says {:?}",
            case.display(),
            stdout(&verify),
            stderr(&merge)
        );
    }
}

#[test]
fn a_huge_index_costs_time_linear_in_its_size() {
    // 200,000 `weight_map` entries over missing shards, and 200,000 metadata keys: reporting
    // and folding them must not be quadratic (the bound of `bounded` is the hang guard).
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("huge");
    std::fs::create_dir(&dir).unwrap();
    let n = 200_000;
    let weight_map: serde_json::Map<String, serde_json::Value> =
        (0..n).map(|i| (format!("t{i}"), serde_json::json!(format!("model-{i:06}.safetensors")))).collect();
    let metadata: serde_json::Map<String, serde_json::Value> =
        (0..n).map(|i| (format!("k{i}"), serde_json::json!(i))).collect();
    let index = serde_json::json!({ "metadata": metadata, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    let out = bounded(&["verify", s(&dir)]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().filter(|l| l.contains("which does not exist")).count(), n);
    let out = bounded(&["inspect", s(&dir)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("tensor `t0` is mapped to `model-000000.safetensors`, which does not exist"));
}

#[test]
fn shards_without_their_index_are_not_a_checkpoint() {
    // What a write killed between its renames and its index leaves: the index is the commit
    // marker, so a lone `model-00001-of-00005.safetensors` must not pass for a whole checkpoint.
    let tmp = tempfile::tempdir().unwrap();
    let shard = "model-00001-of-00005.safetensors";
    std::fs::copy(fixtures().join("safetensors/model_sharded").join(shard), tmp.path().join(shard)).unwrap();
    let out = bounded(&["verify", s(tmp.path())]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("1 `.safetensors` file(s) (`model-00001-of-00005.safetensors`) fit no checkpoint layout"),
        "{}",
        stderr(&out)
    );
    // Named as a file, a shard is still readable on its own.
    let out = bounded(&["verify", s(&tmp.path().join(shard))]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

// A file output changes nothing but its own folder's entries.

/// The entries of `dir` (names only, sorted) and its inode.
fn entries_and_inode(dir: &Path) -> (Vec<String>, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    (names, std::fs::metadata(dir).unwrap().ino())
}

#[test]
fn a_file_output_is_renamed_into_its_own_folder_which_keeps_its_inode() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src.safetensors");
    let new = write_checkpoint(&src, 3, 64, 7);
    // The folder holds only the previous output: once swapped whole, now replaced by one rename.
    let o3 = tmp.path().join("o3");
    std::fs::create_dir(&o3).unwrap();
    let out = o3.join("merged.safetensors");
    write_checkpoint(&out, 2, 16, 1);
    let (above, _) = entries_and_inode(tmp.path());
    let (_, ino) = entries_and_inode(&o3);
    for op in ["merge", "convert"] {
        let done = run(&[op, s(&src), s(&out)]);
        assert!(done.status.success(), "{op}: {}", stderr(&done));
        assert_eq!(std::fs::read(&out).unwrap(), new, "{op}");
        assert_eq!(
            entries_and_inode(&o3),
            (vec!["merged.safetensors".to_string()], ino),
            "{op}: same folder, one file"
        );
        assert_eq!(entries_and_inode(tmp.path()).0, above, "{op}: nothing created or left beside the folder");
    }
}

#[test]
fn merge_with_the_optimizer_writes_both_files_inside_the_named_folder_only() {
    let tmp = tempfile::tempdir().unwrap();
    let o3 = tmp.path().join("o3");
    std::fs::create_dir(&o3).unwrap();
    let out = o3.join("model.safetensors");
    let src = fixtures().join("accelerate/bin");
    for round in 0..2 {
        let (_, ino) = entries_and_inode(&o3);
        let done = run(&["merge", "--optimizer", s(&src), s(&out)]);
        assert!(done.status.success(), "round {round}: {}", stderr(&done));
        let want = vec!["model.safetensors".to_string(), "optimizer.safetensors".to_string()];
        assert_eq!(entries_and_inode(&o3), (want, ino), "round {round}");
        assert_eq!(entries_and_inode(tmp.path()).0, ["o3"], "round {round}: nothing beside the folder");
    }
}

#[test]
fn a_file_output_makes_its_missing_folders_in_place_and_nothing_beside_them() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src.safetensors");
    let new = write_checkpoint(&src, 2, 32, 3);
    let out = tmp.path().join("new/deeper/m.safetensors");
    let done = run(&["merge", s(&src), s(&out)]);
    assert!(done.status.success(), "{}", stderr(&done));
    assert_eq!(std::fs::read(&out).unwrap(), new);
    assert_eq!(entries_and_inode(tmp.path()).0, ["new", "src.safetensors"]);
    assert_eq!(entries_and_inode(&tmp.path().join("new/deeper")).0, ["m.safetensors"]);
}

/// Every hostile input of the earlier rounds, merged and converted into a file whose folder
/// holds only a previous output (the case that was once swapped whole): whether the command
/// succeeds or is refused, the folder keeps its inode, nothing appears or is left beside it,
/// and a refusal leaves the previous output as it was.
#[test]
fn no_hostile_input_makes_a_file_output_touch_anything_beside_its_folder() {
    let mut inputs: Vec<PathBuf> = Vec::new();
    for corpus in std::fs::read_dir(fixtures().join("hostile")).unwrap() {
        let corpus = corpus.unwrap().path();
        // Data files, not checkpoints: the loaders' own hostile tests cover them.
        if ["dataload", "package"].iter().any(|d| corpus.ends_with(d)) {
            continue;
        }
        inputs.extend(std::fs::read_dir(&corpus).unwrap().map(|e| e.unwrap().path()));
    }
    inputs.sort();
    assert!(inputs.len() >= 70, "the corpora are there: {}", inputs.len());
    // Each input in a folder of its own, four at a time: a few hundred runs of the binary.
    let refused = std::sync::atomic::AtomicUsize::new(0);
    let runs = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for part in inputs.chunks(inputs.len().div_ceil(4)) {
            let (refused, runs) = (&refused, &runs);
            scope.spawn(move || {
                for input in part {
                    let n = nothing_beside_a_file_output(input);
                    refused.fetch_add(n.0, std::sync::atomic::Ordering::Relaxed);
                    runs.fetch_add(n.1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    let (refused, runs) = (refused.into_inner(), runs.into_inner());
    assert!(2 * refused > runs, "most hostile inputs are refused: {refused} of {runs}");
}

/// The check above for one input; returns how many of its runs were refused, of how many.
fn nothing_beside_a_file_output(input: &Path) -> (usize, usize) {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("o3");
    std::fs::create_dir(&out_dir).unwrap();
    let out = out_dir.join("merged.safetensors");
    let previous = write_checkpoint(&out, 1, 8, 9);
    let (_, ino) = entries_and_inode(&out_dir);
    // `--optimizer` writes a second file beside the first, from the formats that have one.
    let with_optimizer =
        ["accelerate", "deepspeed", "broadcast_buffer"].iter().any(|c| input.parent().unwrap().ends_with(c));
    let ops: &[&[&str]] = match with_optimizer {
        true => &[&["merge"], &["merge", "--optimizer"], &["convert"]],
        false => &[&["merge"], &["convert"]],
    };
    let mut refused = 0;
    for op in ops {
        let what = format!("{} {}", op.join(" "), input.display());
        let done = bounded(&[op, &[s(input), s(&out)][..]].concat());
        let (names, now) = entries_and_inode(&out_dir);
        assert_eq!(now, ino, "{what}: the output's folder was replaced");
        assert_eq!(entries_and_inode(tmp.path()).0, ["o3"], "{what}: something beside the folder");
        let ours = ["merged.safetensors", "optimizer.safetensors"];
        assert!(names.iter().all(|n| ours.contains(&n.as_str())), "{what}: left {names:?}");
        if done.status.success() {
            // Back to the previous output, so that every refusal is checked against it.
            std::fs::write(&out, &previous).unwrap();
            let _ = std::fs::remove_file(out_dir.join("optimizer.safetensors"));
        } else {
            refused += 1;
            assert_eq!(std::fs::read(&out).unwrap(), previous, "{what}: a refusal changed the output");
        }
    }
    (refused, ops.len())
}
