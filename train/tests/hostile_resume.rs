//! `--resume` from checkpoints that their own metadata shows to be wrong, or that plant special
//! files and links: each refused in one line that names the file, the value and the rank,
//! pinned here. The inputs are made at test time from one real checkpoint (2 ranks, 6 steps),
//! each test editing its own copy. Runs that could hang (a FIFO) have a deadline.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_statekit-train");

/// The tiny model of `resume.rs`.
const SMALL: &[&str] =
    &["--layers", "1", "--dim", "32", "--heads", "2", "--block-size", "16", "--batch-size", "4", "--warmup", "4"];

/// Every run's checkpoint folder, relative to its working folder (so messages are pinned whole).
const BASE: &[&str] = &["--steps", "6", "--save-every", "6", "--ckpt-dir", "ck"];

const STEP: &str = "ck/step-0000006";
const JSON: &str = "ck/step-0000006/statekit_state.json";

struct Run {
    stderr: String,
    ok: bool,
    took: Duration,
}

/// `mpirun -np 2` of the trainer in `cwd`, killed (and the test failed) past `deadline`.
fn run(cwd: &Path, args: &[&str], deadline: Duration) -> Run {
    use std::os::unix::process::CommandExt;
    let err_path = cwd.join(format!("stderr-{}.txt", std::process::id()));
    let start = Instant::now();
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", BIN])
        .args(SMALL)
        .args(args)
        .current_dir(cwd)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .process_group(0)
        .spawn()
        .expect("mpirun");
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if start.elapsed() > deadline {
            let _ = Command::new("kill").args(["-9", "--", &format!("-{}", child.id())]).status();
            let _ = child.wait();
            panic!("the run hung past {deadline:?}: {}", std::fs::read_to_string(&err_path).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&err_path).expect("stderr");
    Run { stderr, ok: status.success(), took: start.elapsed() }
}

/// A folder holding a committed 6-step checkpoint at `ck/` (and the synthetic corpus), made
/// once per test binary.
fn base() -> &'static Path {
    static BASE_DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    BASE_DIR
        .get_or_init(|| {
            let tmp = tempfile::tempdir().expect("tempdir");
            let r = run(tmp.path(), BASE, Duration::from_secs(300));
            assert!(r.ok, "{}", r.stderr);
            assert_eq!(std::fs::read_link(tmp.path().join("ck/latest")).expect("latest"), Path::new("step-0000006"));
            tmp
        })
        .path()
}

/// A copy of the base folder for one test to edit.
fn copy() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    let ok = Command::new("cp").arg("-a").arg(format!("{}/.", base().display())).arg(tmp.path()).status();
    assert!(ok.expect("cp").success());
    tmp
}

/// Resumes in `dir` and returns the one refusal line, checking that the run failed.
fn refusal(dir: &Path, extra: &[&str]) -> String {
    refusal_of(&resume(dir, extra))
}

fn resume(dir: &Path, extra: &[&str]) -> Run {
    run(dir, &[BASE, &["--resume"], extra].concat(), Duration::from_secs(120))
}

fn refusal_of(r: &Run) -> String {
    assert!(!r.ok, "resumed: {}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().filter(|l| l.starts_with("statekit-train: refusing to resume: ")).collect();
    assert_eq!(lines.len(), 1, "{}", r.stderr);
    lines[0].trim_start_matches("statekit-train: refusing to resume: ").to_string()
}

fn edit_json(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(JSON);
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).expect("json")).expect("parse");
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec_pretty(&v).expect("json")).expect("write");
}

fn relink(dir: &Path, target: impl AsRef<Path>) {
    let latest = dir.join("ck/latest");
    std::fs::remove_file(&latest).expect("rm latest");
    std::os::unix::fs::symlink(target, latest).expect("ln");
}

/// The first parameter's name (the optimizer's order), from the checkpoint's JSON.
fn first_param(dir: &Path) -> String {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(JSON)).expect("json")).expect("parse");
    v["params"][0]["name"].as_str().expect("name").to_string()
}

#[test]
fn a_json_step_that_is_not_the_folders_is_refused() {
    let tmp = copy();
    edit_json(tmp.path(), |v| v["step"] = 5.into());
    assert_eq!(refusal(tmp.path(), &[]), format!("{JSON}: rank 0: `step` is 5, but the folder is `step-0000006`"));
}

#[test]
fn a_step_of_2_pow_64_minus_1_is_refused() {
    let tmp = copy();
    edit_json(tmp.path(), |v| v["step"] = u64::MAX.into());
    assert_eq!(
        refusal(tmp.path(), &[]),
        format!(
            "{JSON}: rank 0: `step` is 18446744073709551615, past 16777216, the last step the optimizer's `f32` \
             `step` tensors hold exactly"
        )
    );
}

#[test]
fn an_optimizer_of_another_step_is_refused() {
    // Folder and JSON say 5; the optimizer's `step` tensors still say 6.
    let tmp = copy();
    let dir = tmp.path();
    let p = first_param(dir);
    edit_json(dir, |v| v["step"] = 5.into());
    std::fs::rename(dir.join(STEP), dir.join("ck/step-0000005")).expect("mv");
    relink(dir, "step-0000005");
    assert_eq!(
        refusal(dir, &[]),
        format!("ck/step-0000005/optimizer_0: rank 0: `state.{p}.step` is 6, but `statekit_state.json` says step 5")
    );
}

#[test]
fn a_checkpoint_past_the_runs_steps_is_refused() {
    let tmp = copy();
    assert_eq!(
        refusal(tmp.path(), &["--steps", "4"]),
        format!("{JSON}: rank 0: the checkpoint is at step 6, past `--steps` 4")
    );
}

#[test]
fn out_of_range_sizes_in_the_json_are_refused() {
    let tmp = copy();
    edit_json(tmp.path(), |v| v["world_size"] = 0.into());
    assert_eq!(refusal(tmp.path(), &[]), format!("{JSON}: rank 0: `world_size` is 0, outside 1..=1048576"));
    edit_json(tmp.path(), |v| {
        v["world_size"] = 2.into();
        v["batch_size"] = 0.into();
    });
    assert_eq!(refusal(tmp.path(), &[]), format!("{JSON}: rank 0: `batch_size` is 0, outside 1..=4294967295"));
}

#[test]
fn a_fifo_in_place_of_the_json_is_refused_without_hanging() {
    let tmp = copy();
    let path = tmp.path().join(JSON);
    std::fs::remove_file(&path).expect("rm");
    assert!(Command::new("mkfifo").arg(&path).status().expect("mkfifo").success());
    assert_eq!(
        refusal(tmp.path(), &[]),
        format!("{JSON}: is a FIFO, not a regular file; refusing to read it (rank 0)")
    );
}

#[test]
fn a_json_linked_to_dev_zero_is_refused_at_once() {
    let tmp = copy();
    let path = tmp.path().join(JSON);
    std::fs::remove_file(&path).expect("rm");
    std::os::unix::fs::symlink("/dev/zero", &path).expect("ln");
    let r = resume(tmp.path(), &[]);
    // Refused by its kind, before a byte is read: as fast as any refusal (start-up included).
    assert!(r.took < Duration::from_secs(60), "{:?}", r.took);
    assert_eq!(refusal_of(&r), format!("{JSON}: is a device, not a regular file; refusing to read it (rank 0)"));
}

#[test]
fn a_latest_pointing_outside_the_checkpoint_folder_is_refused() {
    let tmp = copy();
    let dir = tmp.path();
    // A complete copy elsewhere, named as the trainer names it.
    std::fs::create_dir(dir.join("elsewhere")).expect("mkdir");
    assert!(Command::new("cp")
        .arg("-a")
        .arg(dir.join(STEP))
        .arg(dir.join("elsewhere"))
        .status()
        .expect("cp")
        .success());
    let target: PathBuf = dir.join("elsewhere/step-0000006");
    relink(dir, &target);
    assert_eq!(
        refusal(dir, &[]),
        format!("ck/latest: rank 0: names `{}`, not a `step-N` folder inside `ck`", target.display())
    );
}

#[test]
fn a_latest_naming_something_else_than_a_step_folder_is_refused() {
    let tmp = copy();
    let dir = tmp.path();
    assert!(Command::new("cp")
        .arg("-a")
        .arg(dir.join(STEP))
        .arg(dir.join("ck/snapshot"))
        .status()
        .expect("cp")
        .success());
    relink(dir, "snapshot");
    assert_eq!(refusal(dir, &[]), "ck/latest: rank 0: names `snapshot`, not a `step-N` folder inside `ck`");
}

/// The offset of a byte inside the first stored tensor of a DCP rank file: the second byte of
/// the data of the first zip record that is a storage (`archive/data/N`). Every item is a
/// `torch.save` archive whose records are stored, not compressed (their sizes are in data
/// descriptors, so the local header says 0: the second byte is inside any tensor of one
/// element or more).
fn first_tensor_byte(file: &Path) -> usize {
    let b = std::fs::read(file).expect("rank file");
    let mut at = 0;
    while let Some(i) = b[at..].windows(4).position(|w| w == b"PK\x03\x04") {
        let h = at + i;
        let u16_at = |o: usize| usize::from(u16::from_le_bytes([b[h + o], b[h + o + 1]]));
        let (name_len, extra_len) = (u16_at(26), u16_at(28));
        let name = String::from_utf8_lossy(&b[h + 30..h + 30 + name_len]);
        if name.rsplit_once("/data/").is_some_and(|(_, n)| n.bytes().all(|c| c.is_ascii_digit())) {
            return h + 30 + name_len + extra_len + 1;
        }
        at = h + 4;
    }
    panic!("no tensor record in {}", file.display());
}

fn flip(file: &Path, at: usize) {
    let mut b = std::fs::read(file).expect("read");
    b[at] ^= 0x40;
    std::fs::write(file, b).expect("write");
}

/// One byte flipped inside a tensor's data, in the model and in the optimizer folder: every
/// record of a rank file carries a CRC32, which `ckpt` checks on read, so the resume refuses,
/// naming the file (and its rank), the tensor, the record and the reading rank. The first stored
/// tensor of each file is the first parameter's: the model's, or its `exp_avg`. (The two CRCs
/// depend on the trained bits, so only they are left out of the pinned line.)
#[test]
fn a_flipped_byte_in_a_rank_file_is_refused() {
    for (sub, tensor) in [("pytorch_model_fsdp_0", "model.{p}"), ("optimizer_0", "optimizer.state.{p}.exp_avg")] {
        let tmp = copy();
        let dir = tmp.path();
        let tensor = tensor.replace("{p}", &first_param(dir));
        let file = format!("{STEP}/{sub}/__0_0.distcp");
        flip(&dir.join(&file), first_tensor_byte(&dir.join(&file)));
        let line = refusal(dir, &[]);
        let head = format!(
            "{file} (rank 0): tensor `{tensor}`: record `archive/data/0` of the item at byte 0 fails its CRC32 \
             check (the archive says "
        );
        let tail = "): the file was damaged after it was written (rank 0)";
        let crcs = line.strip_prefix(&head).and_then(|r| r.strip_suffix(tail));
        let hex = |s: &str| s.len() == 8 && s.bytes().all(|b| b.is_ascii_hexdigit());
        let ok = crcs.and_then(|c| c.split_once(", the bytes give ")).is_some_and(|(a, b)| hex(a) && hex(b) && a != b);
        assert!(ok, "{sub}: {line}");
    }
}
