//! `hf://` against a Hub on 127.0.0.1: tests/hub/server.py serving the repositories
//! tests/hub/make_repos.py writes with the real tools, and huggingface_hub itself reading and
//! writing the same cache. Needs the venv (`$STATEKIT_VENV`, default /opt/statekit-venv); a
//! machine without it fails here rather than skipping.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;

use common::{ckpt, stderr, stdout};

const ORG: &str = "statekit-test";
const TOKEN: &str = "hf_statekit_hub_rs_token";
const SHARDS: [&str; 5] = [
    "model-00001-of-00005.safetensors",
    "model-00002-of-00005.safetensors",
    "model-00003-of-00005.safetensors",
    "model-00004-of-00005.safetensors",
    "model-00005-of-00005.safetensors",
];

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python() -> PathBuf {
    let venv = std::env::var_os("STATEKIT_VENV").map_or_else(|| PathBuf::from("/opt/statekit-venv"), PathBuf::from);
    let py = venv.join("bin/python");
    assert!(py.exists(), "{} not found: these tests need the venv (set STATEKIT_VENV)", py.display());
    py
}

/// The fixture repositories. make_repos.py writes the same bytes every time and keeps a
/// repository that is there whole, so one folder serves every run; no test writes into it.
fn repos() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hub-repos");
        let out = Command::new(python()).arg(repo_root().join("tests/hub/make_repos.py")).arg(&root).output().unwrap();
        assert!(out.status.success(), "make_repos.py: {}", String::from_utf8_lossy(&out.stderr));
        root
    })
}

/// A fresh server over the fixture repositories, killed when dropped; each test has its own,
/// so faults and logs do not mix.
struct Hub {
    child: Child,
    url: String,
}

impl Hub {
    fn start() -> Hub {
        Hub::start_at(repos())
    }

    /// A server over the repositories under `root` (a copy, for a test that writes).
    fn start_at(root: &Path) -> Hub {
        Hub::start_with(root, &[])
    }

    /// A server with server.py's `flags` too.
    fn start_with(root: &Path, flags: &[&str]) -> Hub {
        let mut child = Command::new(python())
            .arg(repo_root().join("tests/hub/server.py"))
            .args(["--root".as_ref(), root.as_os_str(), "--port".as_ref(), "0".as_ref()])
            .args(["--token", TOKEN])
            .args(flags)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().strip_prefix("PORT ").unwrap_or_else(|| panic!("server.py printed {line:?}"));
        Hub { child, url: format!("http://127.0.0.1:{port}") }
    }

    fn request(&self, method: &str, path: &str, body: &str) -> String {
        // The venv's Python as the HTTP client: the tests need no client crate of their own.
        let script = "import sys, urllib.request as u\n\
             r = u.Request(sys.argv[1], data=sys.argv[3].encode() or None, method=sys.argv[2])\n\
             sys.stdout.write(u.urlopen(r, timeout=30).read().decode())";
        let out =
            Command::new(python()).args(["-c", script, &format!("{}{path}", self.url), method, body]).output().unwrap();
        assert!(out.status.success(), "{method} {path}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    fn fault(&self, json: &str) {
        self.request("POST", "/_control", json);
    }

    fn log(&self) -> Vec<serde_json::Value> {
        self.request("GET", "/_log", "").lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ckpt` against `hub`, with its own cache and HF_HOME under `dir` and no HF_* variable from
/// outside.
fn client(hub: &Hub, dir: &Path) -> Command {
    let mut cmd = ckpt();
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("HF_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("HF_ENDPOINT", &hub.url).env("HF_HUB_CACHE", dir.join("cache")).env("HF_HOME", dir.join("home"));
    cmd
}

fn run(mut cmd: Command, args: &[&str]) -> Output {
    cmd.args(args).output().unwrap()
}

fn ok(out: Output) -> Output {
    assert!(out.status.success(), "exit {:?}: {}", out.status.code(), stderr(&out));
    out
}

/// Runs Python code with `env` (HF_* from outside removed), its stdout.
fn py(code: &str, env: &[(&str, &Path)]) -> String {
    let mut cmd = Command::new(python());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("HF_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.args(["-c", code]).envs(env.iter().map(|(k, v)| (*k, *v))).output().unwrap();
    assert!(out.status.success(), "python: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Every file and link under `dir`: relative path → link target, or the file's bytes.
fn tree(dir: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.file_type().is_symlink() {
                out.insert(rel, format!("-> {}", std::fs::read_link(&p).unwrap().display()));
            } else if meta.is_dir() {
                walk(root, &p, out);
            } else {
                let mut bytes = Vec::new();
                std::fs::File::open(&p).unwrap().read_to_end(&mut bytes).unwrap();
                out.insert(rel, format!("{} bytes, sha {:x}", bytes.len(), crc(&bytes)));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// A cheap digest for comparing trees (FNV-1a).
fn crc(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100000001b3))
}

/// The inspect document with every path reduced to its file name: what a remote and a local
/// inspect of the same files must share.
fn without_paths(mut doc: serde_json::Value) -> serde_json::Value {
    fn strip(v: &mut serde_json::Value) {
        let name = |s: &str| s.rsplit('/').next().unwrap_or_default().to_string();
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m.iter_mut() {
                    match (k.as_str(), x.as_str()) {
                        ("path" | "file", Some(s)) => *x = name(s).into(),
                        _ => strip(x),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut doc);
    doc
}

#[test]
fn remote_inspect_reads_only_headers_and_prints_what_local_inspect_prints() {
    let hub = Hub::start();
    let dir = tempfile::tempdir().unwrap();
    let local = repos().join(ORG).join("sharded5");
    let remote = ok(run(client(&hub, dir.path()), &["inspect", "hf://statekit-test/sharded5"]));
    let here = ok(run(ckpt(), &["inspect", local.to_str().unwrap()]));
    // The same table; only the `path:` line differs (an address pinned to the commit there).
    let body = |o: &Output| stdout(o).lines().filter(|l| !l.starts_with("path:")).collect::<Vec<_>>().join("\n");
    assert_eq!(body(&remote), body(&here));
    let commit = hub.request("GET", "/api/models/statekit-test/sharded5/revision/main", "");
    let commit = serde_json::from_str::<serde_json::Value>(&commit).unwrap()["sha"].as_str().unwrap().to_string();
    assert!(stdout(&remote)
        .contains(&format!("path:    hf://statekit-test/sharded5@{commit}/model.safetensors.index.json")));

    let json = |o: Output| without_paths(serde_json::from_slice(&o.stdout).unwrap());
    let remote_json = json(ok(run(client(&hub, dir.path()), &["inspect", "--json", "hf://statekit-test/sharded5"])));
    assert_eq!(remote_json, json(ok(run(ckpt(), &["inspect", "--json", local.to_str().unwrap()]))));

    // Headers only: every shard byte came by a range request, at most 64 KiB per shard in each
    // of the two inspects above (one request each: the header fits in it), and nothing was
    // written to the cache.
    let mut per_blob: BTreeMap<String, u64> = BTreeMap::new();
    for entry in hub.log() {
        let path = entry["path"].as_str().unwrap();
        if path.ends_with(".safetensors") || path.starts_with("/_lfs/") {
            assert!(entry["range"].is_string(), "a shard read without a range: {entry}");
            *per_blob.entry(path.rsplit('/').next().unwrap().into()).or_default() += entry["bytes"].as_u64().unwrap();
        }
    }
    assert_eq!(per_blob.len(), 2 * SHARDS.len(), "five resolve paths and five LFS blobs: {per_blob:?}");
    assert!(per_blob.values().all(|&b| b <= 2 * (64 << 10)), "{per_blob:?}");
    assert!(!dir.path().join("cache").exists());

    // `verify --headers-only` reads the same way and finds nothing wrong.
    ok(run(client(&hub, dir.path()), &["verify", "--headers-only", "hf://statekit-test/sharded5"]));
    assert!(!dir.path().join("cache").exists());
}

#[test]
fn merge_downloads_a_cache_huggingface_hub_reads_offline_and_reads_one_it_wrote() {
    let hub = Hub::start();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let out = dir.path().join("merged.safetensors");
    ok(run(client(&hub, dir.path()), &["merge", "hf://statekit-test/sharded5", out.to_str().unwrap()]));
    let expected = dir.path().join("local.safetensors");
    ok(run(ckpt(), &["merge", repos().join(ORG).join("sharded5").to_str().unwrap(), expected.to_str().unwrap()]));
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&expected).unwrap());

    // huggingface_hub, offline, finds every file ckpt downloaded...
    let files = format!("['model.safetensors.index.json', {}]", SHARDS.map(|s| format!("'{s}'")).join(", "));
    let theirs_offline = py(
        &format!(
            "from huggingface_hub import snapshot_download\n\
             print(snapshot_download('statekit-test/sharded5', allow_patterns={files}))"
        ),
        &[("HF_HUB_OFFLINE", "1".as_ref()), ("HF_HUB_CACHE", &cache), ("HF_ENDPOINT", hub.url.as_ref())],
    );
    assert!(theirs_offline.trim().starts_with(cache.to_str().unwrap()), "{theirs_offline}");

    // ...where it would have put them itself: the same paths, link targets and blob bytes.
    let other = dir.path().join("theirs");
    py(
        &format!(
            "from huggingface_hub import hf_hub_download\n\
             for f in {files}: hf_hub_download('statekit-test/sharded5', f)"
        ),
        &[("HF_HUB_CACHE", &other), ("HF_ENDPOINT", hub.url.as_ref()), ("HF_HOME", &dir.path().join("home"))],
    );
    let repo = "models--statekit-test--sharded5";
    assert_eq!(tree(&cache.join(repo)), tree(&other.join(repo)));

    // And ckpt, offline, merges from what huggingface_hub wrote.
    let again = dir.path().join("again.safetensors");
    let mut offline = client(&hub, dir.path());
    offline.env("HF_HUB_OFFLINE", "1").env("HF_HUB_CACHE", &other);
    ok(run(offline, &["merge", "hf://statekit-test/sharded5", again.to_str().unwrap()]));
    assert_eq!(std::fs::read(&again).unwrap(), std::fs::read(&expected).unwrap());
}

/// Files under `dir` whose name ends with `suffix`.
fn files_ending(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    tree(dir).keys().filter(|k| k.ends_with(suffix)).map(|k| dir.join(k)).collect()
}

#[test]
fn a_dropped_download_resumes_from_its_incomplete_file() {
    let hub = Hub::start();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let out = dir.path().join("tiny.safetensors");
    hub.fault(r#"{"drop_after": 1000}"#);
    let failed = run(client(&hub, dir.path()), &["merge", "hf://statekit-test/tiny", out.to_str().unwrap()]);
    assert_eq!(failed.status.code(), Some(2));
    let err = stderr(&failed);
    assert!(err.contains("closed early after 1000 of") && err.contains("`model.safetensors`"), "{err}");
    let parts = files_ending(&cache, ".incomplete");
    assert_eq!(parts.len(), 1);
    assert_eq!(std::fs::metadata(&parts[0]).unwrap().len(), 1000);
    assert!(!cache.join("models--statekit-test--tiny/snapshots").exists());

    ok(run(client(&hub, dir.path()), &["merge", "hf://statekit-test/tiny", out.to_str().unwrap()]));
    let resumed = hub.log().into_iter().filter(|e| e["range"] == "bytes=1000-" && e["status"] == 206).count();
    assert_eq!(resumed, 1, "the second run asks for the rest only");
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(repos().join(ORG).join("tiny/model.safetensors")).unwrap());
    assert!(files_ending(&cache, ".incomplete").is_empty());
}

#[test]
fn a_corrupted_download_is_refused_and_nothing_is_committed() {
    let hub = Hub::start();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    hub.fault(r#"{"corrupt": true}"#);
    let out = dir.path().join("tiny.safetensors");
    let failed = run(client(&hub, dir.path()), &["merge", "hf://statekit-test/tiny", out.to_str().unwrap()]);
    assert_eq!(failed.status.code(), Some(2));
    let err = stderr(&failed);
    assert!(err.contains("`model.safetensors` of `statekit-test/tiny`: its SHA-256 is"), "{err}");
    assert!(err.ends_with("as the Hub's ETag says; the download was discarded\n"), "{err}");
    let blobs = cache.join("models--statekit-test--tiny/blobs");
    assert_eq!(std::fs::read_dir(&blobs).unwrap().count(), 0, "no blob, no .incomplete");
    assert!(!cache.join("models--statekit-test--tiny/snapshots").exists());
    assert!(!out.exists());
}

#[test]
fn a_gated_repository_names_the_variable_to_set_and_never_the_token() {
    let hub = Hub::start();
    let dir = tempfile::tempdir().unwrap();
    let none = run(client(&hub, dir.path()), &["inspect", "hf://statekit-test/gated"]);
    assert_eq!(none.status.code(), Some(2));
    assert_eq!(
        stderr(&none),
        "error: `statekit-test/gated`: the Hub answered 401 for `model.safetensors`; the repository is gated or \
         private: set `HF_TOKEN` (or save a token in `$HF_HOME/token`) to a token that may read it\n"
    );
    let mut wrong = client(&hub, dir.path());
    wrong.env("HF_TOKEN", "hf_not_the_right_one");
    let wrong = run(wrong, &["inspect", "hf://statekit-test/gated"]);
    assert_eq!(wrong.status.code(), Some(2));
    assert!(stderr(&wrong).contains("answered 403 for `model.safetensors`; the token from `HF_TOKEN` may not read it"));
    assert!(!stderr(&wrong).contains("hf_not_the_right_one"));
    // The token file under HF_HOME is read as huggingface_hub reads it.
    std::fs::create_dir_all(dir.path().join("home")).unwrap();
    std::fs::write(dir.path().join("home/token"), TOKEN).unwrap();
    let out = ok(run(client(&hub, dir.path()), &["inspect", "hf://statekit-test/gated"]));
    assert!(stdout(&out).starts_with("format:  safetensors\n"));
}

#[test]
fn a_hostile_remote_header_is_refused_as_a_local_one_is() {
    let hub = Hub::start();
    let dir = tempfile::tempdir().unwrap();
    let remote = run(client(&hub, dir.path()), &["inspect", "hf://statekit-test/hostile"]);
    let local = run(ckpt(), &["inspect", repos().join(ORG).join("hostile").to_str().unwrap()]);
    assert_eq!((remote.status.code(), local.status.code()), (Some(2), Some(2)));
    // The message after the file's name: `…/model-00002-of-00002.safetensors: REASON`.
    let reason = |o: &Output| stderr(o).rsplit_once(".safetensors: ").map(|(_, r)| r.to_string()).unwrap();
    assert!(reason(&local).starts_with("header length"), "{}", stderr(&local));
    assert_eq!(reason(&remote), reason(&local));
    assert!(stderr(&remote).starts_with("error: hf://statekit-test/hostile@"));
}

#[test]
fn missing_repositories_files_and_offline_misses_are_named() {
    let hub = Hub::start();
    let dir = tempfile::tempdir().unwrap();
    let repo = run(client(&hub, dir.path()), &["inspect", "hf://statekit-test/absent"]);
    assert_eq!(repo.status.code(), Some(2));
    assert!(stderr(&repo)
        .starts_with(&format!("error: `statekit-test/absent` (revision `main`) was not found on {}", hub.url)));
    let file = run(client(&hub, dir.path()), &["inspect", "hf://statekit-test/tiny/absent.safetensors"]);
    assert_eq!(
        stderr(&file),
        format!("error: `statekit-test/tiny` (revision `main`) has no `absent.safetensors` on {}\n", hub.url)
    );
    let asked = hub.log().len();
    let mut offline = client(&hub, dir.path());
    offline.env("HF_HUB_OFFLINE", "1");
    let miss = run(offline, &["inspect", "hf://statekit-test/tiny"]);
    assert!(stderr(&miss)
        .contains("has no `model.safetensors.index.json` or `model.safetensors` in the local Hugging Face cache"));
    assert_eq!(hub.log().len(), asked, "offline asks nothing");

    // A Hub that cannot be reached, and nothing cached: the message says where it looked.
    let mut nowhere = client(&hub, dir.path());
    nowhere.env("HF_ENDPOINT", "http://127.0.0.1:1");
    let unreachable = run(nowhere, &["inspect", "hf://statekit-test/tiny"]);
    assert_eq!(unreachable.status.code(), Some(2));
    let err = stderr(&unreachable);
    assert!(err.starts_with("error: http://127.0.0.1:1/api/models/statekit-test/tiny/revision/main"), "{err}");
    assert!(err.ends_with("(`HF_ENDPOINT` names the Hub; with `HF_HUB_OFFLINE=1` only the cache is read)\n"), "{err}");
}

#[test]
fn a_stalled_download_times_out_naming_the_file() {
    let hub = Hub::start();
    let dir = tempfile::tempdir().unwrap();
    hub.fault(r#"{"delay": 3}"#);
    let mut cmd = client(&hub, dir.path());
    cmd.env("HF_HUB_DOWNLOAD_TIMEOUT", "1");
    let out = dir.path().join("tiny.safetensors");
    let failed = run(cmd, &["merge", "hf://statekit-test/tiny", out.to_str().unwrap()]);
    assert_eq!(failed.status.code(), Some(2));
    let err = stderr(&failed);
    assert!(err.contains("no data for 1 s (`HF_HUB_DOWNLOAD_TIMEOUT`") && err.contains("`model.safetensors`"), "{err}");
}

#[test]
fn push_commits_a_split_once_and_skips_what_the_hub_holds() {
    let dir = tempfile::tempdir().unwrap();
    // A root of its own: the push writes into it.
    let root = dir.path().join("root");
    std::fs::create_dir_all(root.join(ORG)).unwrap();
    let hub = Hub::start_at(&root);
    let split = dir.path().join("split");
    let src = repos().join(ORG).join("sharded5");
    ok(run(ckpt(), &["split", src.to_str().unwrap(), split.to_str().unwrap(), "--max-shard-size", "1MB"]));

    let anonymous = run(client(&hub, dir.path()), &["push", split.to_str().unwrap(), "hf://statekit-test/pushed"]);
    assert_eq!(anonymous.status.code(), Some(2));
    assert!(stderr(&anonymous).contains("pushing takes a token: set `HF_TOKEN`"), "{}", stderr(&anonymous));

    let mut push = client(&hub, dir.path());
    push.env("HF_TOKEN", TOKEN);
    let pushed = ok(run(push, &["push", split.to_str().unwrap(), "hf://statekit-test/pushed", "--message", "a split"]));
    assert!(stdout(&pushed).starts_with(&format!("{}/statekit-test/pushed/commit/", hub.url)), "{}", stdout(&pushed));
    assert_eq!(stderr(&pushed), "pushed 5 file(s) to statekit-test/pushed@main (0 already there)\n");
    for e in std::fs::read_dir(&split).unwrap() {
        let p = e.unwrap().path();
        let theirs = root.join(ORG).join("pushed").join(p.file_name().unwrap());
        assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(theirs).unwrap(), "{}", p.display());
    }
    // The shards went by LFS (a PUT each), the index inline in the commit.
    let puts = hub.log().iter().filter(|e| e["method"] == "PUT").count();
    assert_eq!(puts, 4);

    // Again: the Hub holds every file, so nothing is uploaded and no commit is made.
    let asked = hub.log().len();
    let mut again = client(&hub, dir.path());
    again.env("HF_TOKEN", TOKEN);
    let again = ok(run(again, &["push", split.to_str().unwrap(), "hf://statekit-test/pushed"]));
    assert_eq!(stderr(&again), "nothing to push: statekit-test/pushed@main holds all 5 file(s) already\n");
    assert!(hub.log()[asked..].iter().all(|e| e["path"].as_str().unwrap().ends_with("/preupload/main")));

    // And what was pushed reads back as the split does.
    let json = |o: Output| without_paths(serde_json::from_slice(&o.stdout).unwrap());
    let remote = json(ok(run(client(&hub, dir.path()), &["inspect", "--json", "hf://statekit-test/pushed"])));
    assert_eq!(remote, json(ok(run(ckpt(), &["inspect", "--json", split.to_str().unwrap()]))));
}

#[test]
fn revisions_come_from_the_address_or_the_option_and_a_cached_commit_needs_no_request() {
    let hub = Hub::start();
    let dir = tempfile::tempdir().unwrap();
    let by_tag = ok(run(client(&hub, dir.path()), &["inspect", "--json", "hf://statekit-test/tiny@v1"]));
    let by_option =
        ok(run(client(&hub, dir.path()), &["inspect", "--json", "--revision", "v1", "hf://statekit-test/tiny"]));
    assert_eq!(stdout(&by_tag), stdout(&by_option));
    let both = run(client(&hub, dir.path()), &["inspect", "--revision", "v2", "hf://statekit-test/tiny@v1"]);
    assert_eq!(
        stderr(&both),
        "error: invalid hub address `hf://statekit-test/tiny@v1`: names revision `v1` and the revision option `v2`\n"
    );

    // A download by tag leaves `refs/v1`, as huggingface_hub does...
    let out = dir.path().join("tiny.safetensors");
    ok(run(client(&hub, dir.path()), &["merge", "hf://statekit-test/tiny@v1", out.to_str().unwrap()]));
    let commit = std::fs::read_to_string(dir.path().join("cache/models--statekit-test--tiny/refs/v1")).unwrap();
    let listing = hub.request("GET", "/api/models/statekit-test/tiny/revision/v1", "");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&listing).unwrap()["sha"], commit.as_str());
    // ...and that commit, asked for by its hash, is read from the cache without a request.
    let asked = hub.log().len();
    let again = dir.path().join("again.safetensors");
    ok(run(
        client(&hub, dir.path()),
        &["merge", &format!("hf://statekit-test/tiny@{commit}"), again.to_str().unwrap()],
    ));
    assert_eq!(hub.log().len(), asked);
    assert_eq!(std::fs::read(&again).unwrap(), std::fs::read(&out).unwrap());
}

#[test]
fn two_processes_download_a_blob_once() {
    let hub = Hub::start();
    let dir = tempfile::tempdir().unwrap();
    // Slow data, so that the two downloads overlap: the second waits on the first's lock.
    hub.fault(r#"{"delay": 0.5}"#);
    let spawn = |name: &str| {
        let mut cmd = client(&hub, dir.path());
        cmd.args(["merge", "hf://statekit-test/tiny", dir.path().join(name).to_str().unwrap()]);
        cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let (a, b) = (spawn("a.safetensors"), spawn("b.safetensors"));
    for child in [a, b] {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let fetched =
        hub.log().iter().filter(|e| e["path"].as_str().unwrap().starts_with("/_lfs/") && e["status"] == 200).count();
    assert_eq!(fetched, 1, "one download of the blob: {:?}", hub.log());
    assert_eq!(
        std::fs::read(dir.path().join("a.safetensors")).unwrap(),
        std::fs::read(dir.path().join("b.safetensors")).unwrap()
    );
}

#[test]
fn files_served_through_a_relative_redirect_land_under_the_same_blob_names() {
    // `--resolve-cache`: regular files answer 307 to another path of the Hub, whose answer
    // alone carries the ETag, as huggingface.co serves public repositories today.
    let redirecting = Hub::start_with(repos(), &["--resolve-cache"]);
    let plain = Hub::start();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for (hub, dir) in [(&redirecting, &a), (&plain, &b)] {
        let out = dir.path().join("merged.safetensors");
        ok(run(client(hub, dir.path()), &["merge", "hf://statekit-test/sharded5", out.to_str().unwrap()]));
    }
    let repo = "cache/models--statekit-test--sharded5";
    assert_eq!(tree(&a.path().join(repo)), tree(&b.path().join(repo)));
    assert!(redirecting.log().iter().any(|e| e["status"] == 307));
}
