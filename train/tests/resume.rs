//! The training core end to end, under `mpirun`: runs killed with `kill -9` at random moments
//! (also in the middle of checkpoint writes) resume to the bits of an uninterrupted run; a
//! run resumed on another number of ranks sees every sample of the interrupted epoch once;
//! damaged or foreign checkpoints are refused in one line naming the file and the rank.
//!
//! Each kill point is drawn from a seed printed by the test (`STATEKIT_KILL_SEED` replays it).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_statekit-train");

/// A tiny model and run: a few seconds per run on two cores.
const SMALL: &[&str] =
    &["--layers", "1", "--dim", "32", "--heads", "2", "--block-size", "16", "--batch-size", "4", "--warmup", "4"];

fn mpirun(np: u64) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string(), BIN]);
    c
}

struct Run {
    stdout: String,
    stderr: String,
    ok: bool,
}

fn run(np: u64, cwd: &Path, args: &[&str]) -> Run {
    let out = mpirun(np).current_dir(cwd).args(SMALL).args(args).output().expect("mpirun");
    Run {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        ok: out.status.success(),
    }
}

/// step → (loss, lr, tokens) of rank 0's JSON lines.
fn losses(stdout: &str) -> BTreeMap<u64, (f64, f64, u64)> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            (
                v["step"].as_u64().expect("step"),
                (
                    v["loss"].as_f64().expect("loss"),
                    v["lr"].as_f64().expect("lr"),
                    v["tokens"].as_u64().expect("tokens"),
                ),
            )
        })
        .collect()
}

/// The data files of the committed model and optimizer: what must be bit-identical.
fn state_files(ckpt: &Path) -> BTreeMap<String, Vec<u8>> {
    let latest = ckpt.join("latest");
    let mut out = BTreeMap::new();
    for sub in ["pytorch_model_fsdp_0", "optimizer_0"] {
        for e in std::fs::read_dir(latest.join(sub)).expect("read checkpoint") {
            let e = e.expect("entry");
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".distcp") {
                out.insert(format!("{sub}/{name}"), std::fs::read(e.path()).expect("read"));
            }
        }
    }
    out
}

struct Rng(u64);

impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

fn seed() -> u64 {
    std::env::var("STATEKIT_KILL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64)
    })
}

/// Starts a run in its own process group and kills the whole group with SIGKILL once rank 0
/// has logged `after_lines` steps plus a random few milliseconds. Returns its stdout.
fn run_and_kill(np: u64, cwd: &Path, args: &[&str], after_lines: usize, extra_ms: u64) -> String {
    use std::os::unix::process::CommandExt;
    let out_path = cwd.join(format!("killed-{}.out", Instant::now().elapsed().as_nanos()));
    let out = std::fs::File::create(&out_path).expect("stdout file");
    let mut child = mpirun(np)
        .current_dir(cwd)
        .args(SMALL)
        .args(args)
        .stdout(out)
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn");
    let pgid = child.id();
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(&out_path).unwrap_or_default();
        if text.lines().count() >= after_lines || start.elapsed() > Duration::from_secs(60) {
            break;
        }
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(extra_ms));
    let _ = Command::new("kill").args(["-9", "--", &format!("-{pgid}")]).status();
    let _ = child.wait();
    let mut s = String::new();
    std::fs::File::open(&out_path).and_then(|mut f| f.read_to_string(&mut s)).expect("read stdout");
    s
}

fn kill_and_resume(np: u64, mode: &str) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = "24";
    let common = ["--mode", mode, "--steps", steps, "--save-every", "2", "--keep-last", "2"];
    let full_dir = dir.join("full");
    let mut args: Vec<&str> = common.to_vec();
    let full_ck = full_dir.to_string_lossy().into_owned();
    args.extend(["--ckpt-dir", &full_ck]);
    let full = run(np, dir, &args);
    assert!(full.ok, "{}", full.stderr);
    let reference = losses(&full.stdout);
    assert_eq!(reference.len(), 24);
    assert!(reference[&24].0 < reference[&1].0, "the loss falls: {reference:?}");

    let s = seed();
    eprintln!("kill points from STATEKIT_KILL_SEED={s}");
    let mut rng = Rng(s);
    let ck = dir.join("killed").to_string_lossy().into_owned();
    let mut args: Vec<&str> = common.to_vec();
    args.extend(["--ckpt-dir", &ck]);
    // First run killed part-way, then resumed and killed again, then resumed to the end (a
    // kill may also land after the last commit; the last run then has nothing left to do).
    let mut logs = vec![run_and_kill(np, dir, &args, 3 + rng.next(8) as usize, rng.next(40))];
    let mut resumed_args = args.clone();
    resumed_args.push("--resume");
    if Path::new(&ck).join("latest").exists() {
        logs.push(run_and_kill(np, dir, &resumed_args, 2 + rng.next(8) as usize, rng.next(40)));
    }
    let last = if Path::new(&ck).join("latest").exists() { resumed_args.as_slice() } else { args.as_slice() };
    let end = run(np, dir, last);
    assert!(end.ok, "{}", end.stderr);
    logs.push(end.stdout);
    // Every step any run logged, before or after a resume point, equals the uninterrupted run's.
    let mut logged = 0;
    for log in &logs {
        for (step, v) in &losses(log) {
            assert_eq!(Some(v), reference.get(step), "step {step} differs ({mode}, {np} ranks)");
            logged += 1;
        }
    }
    // (A killed run's last lines may be lost with it, so only their values are checked.)
    assert!(logged > 0);
    assert_eq!(std::fs::read_link(Path::new(&ck).join("latest")).expect("latest"), PathBuf::from("step-0000024"));
    assert_eq!(state_files(&full_dir), state_files(Path::new(&ck)), "final state differs ({mode}, {np} ranks)");
    // `--keep-last 2`: two committed steps, or three when a kill fell between a commit and its
    // pruning and no commit followed.
    let steps: Vec<_> = std::fs::read_dir(&ck)
        .expect("ls")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert!((2..=3).contains(&steps.len()) && steps.contains(&"step-0000024".to_string()), "{steps:?}");
}

#[test]
fn kill_9_then_resume_is_bit_identical_ddp_2_ranks() {
    kill_and_resume(2, "ddp");
}

#[test]
fn kill_9_then_resume_is_bit_identical_sharded_2_ranks() {
    kill_and_resume(2, "sharded");
}

#[test]
fn kill_9_then_resume_is_bit_identical_ddp_4_ranks() {
    kill_and_resume(4, "ddp");
}

#[test]
fn kill_9_then_resume_is_bit_identical_sharded_4_ranks() {
    kill_and_resume(4, "sharded");
}

/// A corpus of exactly `windows` windows of 16 tokens.
fn corpus(dir: &Path, windows: usize) -> PathBuf {
    let p = dir.join("corpus.bin");
    let bytes: Vec<u8> = (0..windows * 16 + 1).flat_map(|i| ((i * 7 % 64) as u16).to_le_bytes()).collect();
    std::fs::write(&p, bytes).expect("corpus");
    p
}

/// Every sample index that the rank logs of `dir` show, per step.
fn seen(dir: &Path) -> Vec<u64> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("ls").flatten() {
        for line in std::fs::read_to_string(e.path()).expect("read").lines() {
            out.extend(line.split_whitespace().skip(1).map(|x| x.parse::<u64>().expect("index")));
        }
    }
    out.sort();
    out
}

fn elastic(from: u64, to: u64, stop_after: &str, steps: &str, mode: &str) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let data = corpus(dir, 40).to_string_lossy().into_owned();
    let samples = dir.join("samples").to_string_lossy().into_owned();
    // Batch size 2 per rank, no padding at the end of the epoch: the interrupted epoch is
    // `from` ranks' first steps then `to` ranks' remainder, exactly one epoch in all.
    let args = [
        "--data",
        &data,
        "--batch-size",
        "2",
        "--mode",
        mode,
        "--no-even-batches",
        "--steps",
        steps,
        "--save-every",
        "1",
        "--ckpt-dir",
        "ck",
        "--log-samples",
        &samples,
    ];
    let first = run(from, dir, &[&args[..], &["--stop-after", stop_after]].concat());
    assert!(first.ok, "{}", first.stderr);
    let second = run(to, dir, &[&args[..], &["--resume"]].concat());
    assert!(second.ok, "{}", second.stderr);
    assert!(second.stderr.contains(&format!("(saved by {from} ranks)")), "{}", second.stderr);
    assert_eq!(seen(Path::new(&samples)), (0..40).collect::<Vec<u64>>(), "{from} → {to} ranks");
    let (a, b) = (losses(&first.stdout), losses(&second.stdout));
    let before = a.values().last().expect("first run logged").0;
    let after = b.values().next().expect("second run logged").0;
    assert!(after.is_finite() && after < a[&1].0 + 0.5 && (after - before).abs() < 1.0, "{before} then {after}");
}

#[test]
fn resume_on_3_ranks_after_2_sees_every_sample_once() {
    // 2 ranks × 2 × 3 steps = 12 samples, then 3 ranks: 28 in 5 steps (the last uneven).
    elastic(2, 3, "3", "8", "sharded");
}

#[test]
fn resume_on_2_ranks_after_4_sees_every_sample_once() {
    // 4 ranks × 2 × 2 steps = 16 samples, then 2 ranks: 24 in 6 steps.
    elastic(4, 2, "2", "8", "ddp");
}

#[test]
fn damaged_or_foreign_checkpoints_are_refused_naming_file_and_rank() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let base = ["--steps", "4", "--save-every", "2", "--ckpt-dir", "ck"];
    assert!(run(2, dir, &base).ok);
    let one_line = |r: &Run, needle: &str| {
        assert!(!r.ok);
        let line = r.stderr.lines().find(|l| l.starts_with("statekit-train: refusing to resume:"));
        let line = line.unwrap_or_else(|| panic!("no refusal in {}", r.stderr));
        assert!(line.contains(needle) && line.contains("rank"), "{line}");
    };
    let resume = |extra: &[&str]| run(2, dir, &[&base[..], &["--resume", "--steps", "6"], extra].concat());
    // Another model's shapes.
    one_line(&resume(&["--dim", "16"]), "statekit_state.json: rank 0: the checkpoint is of another model");
    // A state from another dataset.
    let other = corpus(dir, 30).to_string_lossy().into_owned();
    one_line(&resume(&["--data", &other]), "statekit_state.json: rank 0: loader state");
    // A missing rank file.
    let latest = std::fs::canonicalize(dir.join("ck/latest")).expect("latest");
    std::fs::remove_file(latest.join("optimizer_0/__1_0.distcp")).expect("rm");
    one_line(&resume(&[]), "optimizer_0/.metadata");
    one_line(&resume(&[]), "__1_0.distcp");
}

#[test]
fn async_save_writes_the_same_bytes_as_sync_save() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let base = ["--steps", "8", "--save-every", "2", "--mode", "sharded"];
    let a = run(2, dir, &[&base[..], &["--ckpt-dir", "sync"]].concat());
    let b = run(2, dir, &[&base[..], &["--ckpt-dir", "async", "--async-save"]].concat());
    assert!(a.ok && b.ok, "{}{}", a.stderr, b.stderr);
    assert!(b.stderr.contains("queued (stall"), "{}", b.stderr);
    assert_eq!(losses(&a.stdout), losses(&b.stdout));
    assert_eq!(state_files(&dir.join("sync")), state_files(&dir.join("async")));
}

#[test]
fn dispatched_batches_train_like_per_rank_batches() {
    // accelerate's dispatcher hands rank p the p-th slice of the same global batch that per-rank
    // sharding gives it, so the runs agree step for step; here rank 0 reads and broadcasts.
    let tmp = tempfile::tempdir().expect("tempdir");
    let base = ["--steps", "5", "--mode", "sharded"];
    let a = run(2, tmp.path(), &base);
    let b = run(2, tmp.path(), &[&base[..], &["--dispatch-batches"]].concat());
    assert!(a.ok && b.ok, "{}{}", a.stderr, b.stderr);
    assert_eq!(losses(&a.stdout), losses(&b.stdout));
}

#[test]
fn bf16_matmuls_with_gradient_accumulation_train() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let r = run(2, tmp.path(), &["--steps", "12", "--bf16", "--grad-accum", "2", "--mode", "sharded"]);
    assert!(r.ok, "{}", r.stderr);
    let l = losses(&r.stdout);
    assert_eq!(l.len(), 12);
    // Two micro-batches of 4 windows of 16 tokens on each of 2 ranks per step.
    assert_eq!(l[&1].2, 2 * 2 * 4 * 16);
    assert!(l.values().all(|v| v.0.is_finite()));
    assert!(l[&12].0 < l[&1].0, "{l:?}");
}

#[test]
fn sigterm_saves_then_exits_0_and_the_run_resumes_to_the_same_losses() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let base = ["--steps", "40", "--mode", "ddp", "--ckpt-dir", "ck", "--save-every", "100"];
    let reference = losses(&run(2, dir, &["--steps", "40", "--mode", "ddp"]).stdout);
    let out_path = dir.join("run1.out");
    let mut child = mpirun(2)
        .current_dir(dir)
        .args(SMALL)
        .args(base)
        .args(["--step-sleep-ms", "30"])
        .stdout(std::fs::File::create(&out_path).expect("stdout"))
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    while std::fs::read_to_string(&out_path).unwrap_or_default().lines().count() < 5 {
        assert!(start.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The signal goes to the ranks (mpirun's children), as a scheduler's would.
    let sent = Command::new("pkill").args(["-TERM", "-P", &child.id().to_string()]).status().expect("pkill");
    assert!(sent.success());
    let mut err = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut err).expect("read");
    assert!(child.wait().expect("wait").success(), "{err}");
    let first = losses(&std::fs::read_to_string(&out_path).expect("stdout"));
    let stopped = *first.keys().last().expect("steps");
    assert!(stopped < 40, "the signal stopped the run early");
    assert!(err.contains(&format!("signal received: saved at step {stopped}, stopping")), "{err}");
    let latest = std::fs::read_link(dir.join("ck/latest")).expect("latest");
    assert_eq!(latest, PathBuf::from(format!("step-{stopped:07}")));
    let rest = run(2, dir, &[&base[..], &["--resume"]].concat());
    assert!(rest.ok, "{}", rest.stderr);
    let second = losses(&rest.stdout);
    assert_eq!(second.keys().next(), Some(&(stopped + 1)));
    for (step, v) in first.iter().chain(&second) {
        assert_eq!(Some(v), reference.get(step), "step {step}");
    }
}

#[test]
fn a_kill_inside_a_checkpoint_write_leaves_the_previous_checkpoint() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let base = ["--steps", "12", "--mode", "sharded", "--ckpt-dir", "ck", "--save-every", "4"];
    let reference = run(2, dir, &["--steps", "12", "--mode", "sharded", "--ckpt-dir", "ref", "--save-every", "4"]);
    assert!(reference.ok, "{}", reference.stderr);
    let mut child = mpirun(2)
        .current_dir(dir)
        .args(SMALL)
        .args(base)
        .args(["--pause-in-save-ms", "3000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn");
    // The second save (step 8) is half written: its model folder is committed inside the
    // staging folder, the optimizer not yet, `latest` still names step 4.
    let start = Instant::now();
    let half = loop {
        assert!(start.elapsed() < Duration::from_secs(60), "no second save");
        let staging = std::fs::read_dir(dir.join("ck")).ok().into_iter().flatten().flatten().find(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with(".step-0000008.") && e.path().join("pytorch_model_fsdp_0").is_dir()
        });
        if let Some(s) = staging {
            break s.path();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = Command::new("kill").args(["-9", "--", &format!("-{}", child.id())]).status();
    let _ = child.wait();
    assert!(half.exists());
    assert_eq!(std::fs::read_link(dir.join("ck/latest")).expect("latest"), PathBuf::from("step-0000004"));
    assert!(!dir.join("ck/step-0000008").exists());
    let rest = run(2, dir, &[&base[..], &["--resume"]].concat());
    assert!(rest.ok, "{}", rest.stderr);
    assert!(rest.stderr.contains("at step 4"), "{}", rest.stderr);
    assert_eq!(state_files(&dir.join("ref")), state_files(&dir.join("ck")));
    // The resumed run's first commit swept the killed staging folder away.
    assert!(!half.exists());
}

/// `latest` names a step folder whose model and optimizer folders are whole and whose rank
/// files are all there (2 ranks).
fn assert_latest_complete(ck: &Path, when: &str) {
    let target = std::fs::read_link(ck.join("latest")).unwrap_or_else(|e| panic!("{when}: latest: {e}"));
    let name = target.to_string_lossy().into_owned();
    assert!(name.starts_with("step-") && !name.contains('/'), "{when}: latest names {name}");
    let step = ck.join(&name);
    assert!(step.join("statekit_state.json").is_file(), "{when}: {name} has no state file");
    for sub in ["pytorch_model_fsdp_0", "optimizer_0"] {
        assert!(step.join(sub).join(".metadata").is_file(), "{when}: {name}/{sub} has no .metadata");
        for r in 0..2 {
            assert!(step.join(sub).join(format!("__{r}_0.distcp")).is_file(), "{when}: {name}/{sub} lacks rank {r}");
        }
    }
}

/// A run that saves again the step it resumed from (the folder `latest` names), killed in the
/// middle of that save and then at random moments around it, leaves `latest` on a complete
/// checkpoint every time: the old folder is only ever swapped for the new one, never removed
/// first. The last run resumes and finishes to the bits of an uninterrupted run.
#[test]
fn a_kill_during_a_re_save_of_the_resumed_step_leaves_latest_complete() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let ck = dir.join("ck");
    let base = ["--steps", "8", "--mode", "sharded", "--ckpt-dir", "ck", "--save-every", "4"];
    let reference = run(2, dir, &["--steps", "8", "--mode", "sharded", "--ckpt-dir", "ref", "--save-every", "4"]);
    assert!(reference.ok, "{}", reference.stderr);
    // Stopped after step 5: step 4 is the last checkpoint.
    let first = run(2, dir, &[&base[..], &["--stop-after", "5"]].concat());
    assert!(first.ok, "{}", first.stderr);
    assert_eq!(std::fs::read_link(ck.join("latest")).expect("latest"), PathBuf::from("step-0000004"));
    let resave: Vec<&str> = [&base[..], &["--resume", "--save-on-resume"]].concat();

    // Killed inside the re-save of step 4: its model folder is written in the staging folder,
    // the committed step-0000004 still beside it.
    let mut child = mpirun(2)
        .current_dir(dir)
        .args(SMALL)
        .args(&resave)
        .args(["--pause-in-save-ms", "3000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < Duration::from_secs(60), "no re-save");
        let staging = std::fs::read_dir(&ck).ok().into_iter().flatten().flatten().any(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with(".step-0000004.") && e.path().join("pytorch_model_fsdp_0").is_dir()
        });
        if staging {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = Command::new("kill").args(["-9", "--", &format!("-{}", child.id())]).status();
    let _ = child.wait();
    assert_eq!(std::fs::read_link(ck.join("latest")).expect("latest"), PathBuf::from("step-0000004"));
    assert_latest_complete(&ck, "killed inside the re-save");

    // Killed at random moments: before, during or after the re-save's commit.
    let s = seed();
    eprintln!("kill points from STATEKIT_KILL_SEED={s}");
    let mut rng = Rng(s);
    for i in 0..3 {
        run_and_kill(2, dir, &resave, 0, 300 + rng.next(3000));
        assert_latest_complete(&ck, &format!("random kill {i}"));
    }
    let end = run(2, dir, &resave);
    assert!(end.ok, "{}", end.stderr);
    assert_eq!(std::fs::read_link(ck.join("latest")).expect("latest"), PathBuf::from("step-0000008"));
    assert_latest_complete(&ck, "the end");
    assert_eq!(state_files(&dir.join("ref")), state_files(&ck));
}
