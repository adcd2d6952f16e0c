//! The Hub over HTTP: what `hf-hub` 0.4's sync client lacks, written with the same `ureq`.
//!
//! `hf-hub` gives us the endpoint (`HF_ENDPOINT`), the token file under `HF_HOME`, the cache's
//! folder names, the file URLs and the listing request. Its `ApiRepo::download` is not used:
//! it resumes from a `.part` file and locks `<blob>.lock` beside the blob, where
//! huggingface_hub keeps `<blob>.incomplete` and `.locks/<repo folder>/<etag>.lock`; it checks
//! neither the size nor the SHA-256 of what it wrote; it has no timeout; and it links each file
//! into `snapshots/` as it lands, so a failed job leaves half a snapshot. What this module adds:
//!
//! - the listing of a revision with sizes and LFS digests (`GET /api/models/{repo}/revision/{rev}?blobs=true`,
//!   through `hf-hub`'s own request), which also pins the revision to its commit;
//! - a file's metadata as huggingface_hub reads it: `HEAD /{repo}/resolve/{commit}/{file}`
//!   without following a redirect off the Hub, `X-Linked-Etag`/`X-Linked-Size` for LFS files
//!   (the blob's name is the SHA-256), else `ETag`/`Content-Length` (a git blob id);
//! - range reads (`Range: bytes=a-b`, answered `206` with `Content-Range: bytes a-b/LEN`), for
//!   the headers of safetensors files that are not downloaded;
//! - downloads into `blobs/<etag>`: under an exclusive `flock` on
//!   `.locks/models--ORG--NAME/<etag>.lock` (huggingface_hub's `filelock` takes the same
//!   lock, so neither downloads a blob the other is fetching), into `<etag>.incomplete`, which
//!   an interrupted run leaves and the next one continues with `Range: bytes=N-`; the size is
//!   checked, and for an LFS file the SHA-256 against the ETag, before the rename to the blob;
//!   a mismatch removes the bytes. Only once every file of a job is in `blobs/` are the
//!   `snapshots/<commit>/<file> → ../../blobs/<etag>` links made and `refs/<rev>` written,
//!   each by a rename, so `snapshots/` never holds a partial job;
//! - the commit API for `ckpt push` (see [`Hub::push`]).
//!
//! Every request has the timeouts huggingface_hub uses (`HF_HUB_ETAG_TIMEOUT` for metadata,
//! `HF_HUB_DOWNLOAD_TIMEOUT` for data, 10 s each by default) and every failure names its URL.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hf_hub::api::sync::{Api, ApiBuilder};
use hf_hub::{Cache, Repo, RepoType};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{Error, HubCorruption, IoContext, Result};

mod push;
pub(crate) use push::Upload;

/// huggingface_hub's default for both timeouts, in seconds.
const DEFAULT_TIMEOUT: u64 = 10;
/// How many files are fetched at once (huggingface_hub's `snapshot_download` uses 8 workers).
const WORKERS: usize = 8;
/// The largest JSON answer read (a listing of a repository of many files, an index).
pub(crate) const MAX_JSON: u64 = 256 << 20;
/// What huggingface_hub writes into `CACHEDIR.TAG` at the cache's root.
const CACHEDIR_TAG: &str = "Signature: 8a477f597d28d172789f06886806bc55\n# This file is a cache directory tag created by huggingface_hub.\n# For information about cache directory tags, see:\n#\thttps://bford.info/cachedir/\n";

/// Reports download progress: `(bytes just fetched, bytes the whole job fetches)`. Called from
/// several threads.
pub(crate) type Progress = dyn Fn(u64, u64) + Send + Sync;

/// A value of an environment variable, empty counted as unset.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// huggingface_hub's truthy values (`1`, `ON`, `YES`, `TRUE`), for `HF_HUB_OFFLINE`.
pub(crate) fn env_true(name: &str) -> bool {
    env(name).is_some_and(|v| ["1", "ON", "YES", "TRUE"].contains(&v.trim().to_ascii_uppercase().as_str()))
}

fn timeout(name: &str) -> Duration {
    Duration::from_secs(env(name).and_then(|v| v.trim().parse().ok()).unwrap_or(DEFAULT_TIMEOUT))
}

/// One file of a revision's listing.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct Sibling {
    pub rfilename: String,
}

/// A revision of a repository: its commit and its files.
#[derive(Clone, Debug)]
pub(crate) struct Listing {
    pub commit: String,
    pub files: Vec<String>,
}

#[derive(Deserialize)]
struct Info {
    sha: String,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

/// What the Hub says of one file of a commit (its `HEAD`).
#[derive(Clone, Debug)]
pub(crate) struct FileMeta {
    /// The blob's name: the SHA-256 for an LFS file, the git blob id otherwise.
    pub etag: String,
    pub size: u64,
    /// Whether `etag` is the file's SHA-256, which the download is checked against.
    pub lfs: bool,
}

/// The answer of a request that may fail only because the Hub cannot be reached.
#[derive(Debug)]
pub(crate) enum Reached<T> {
    Yes(T),
    /// No connection at all: the caller may fall back to the cache, as huggingface_hub does.
    No(Error),
}

/// A file to download: its name in the repository and what its `HEAD` said.
#[derive(Clone, Debug)]
pub(crate) struct Fetch {
    pub file: String,
    pub meta: FileMeta,
}

/// The Hub of `HF_ENDPOINT`, with the caller's token.
#[derive(Debug)]
pub(crate) struct Hub {
    api: Api,
    endpoint: String,
    /// Follows redirects; drops `Authorization` on one to another host.
    agent: ureq::Agent,
    /// Follows none: `HEAD` reads the metadata off the Hub's own answer.
    plain: ureq::Agent,
    /// The token and where it came from (for messages; the token is never printed).
    token: Option<(String, String)>,
    etag_timeout: Duration,
    data_timeout: Duration,
}

impl Hub {
    /// The Hub the environment names: `HF_ENDPOINT` (default `https://huggingface.co`),
    /// `HF_TOKEN`, else the token file (`HF_TOKEN_PATH`, else `$HF_HOME/token`).
    pub(crate) fn from_env() -> Result<Hub> {
        let endpoint =
            env("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".into()).trim_end_matches('/').to_string();
        let token = match env("HF_TOKEN") {
            Some(t) => Some((t.trim().to_string(), "`HF_TOKEN`".to_string())),
            None => match env("HF_TOKEN_PATH") {
                Some(p) => std::fs::read_to_string(&p)
                    .ok()
                    .map(|t| t.trim().to_string())
                    .filter(|t| !t.is_empty())
                    .map(|t| (t, format!("the token file {p}"))),
                None => {
                    let cache = Cache::from_env();
                    cache.token().map(|t| (t, format!("the token file {}", cache.token_path().display())))
                }
            },
        };
        let api = ApiBuilder::from_env()
            .with_endpoint(endpoint.clone())
            .with_token(token.as_ref().map(|(t, _)| t.clone()))
            .with_progress(false)
            .build()
            .map_err(|e| Error::HubRequest { url: endpoint.clone(), reason: e.to_string() })?;
        let etag_timeout = timeout("HF_HUB_ETAG_TIMEOUT");
        let data_timeout = timeout("HF_HUB_DOWNLOAD_TIMEOUT");
        let builder = || {
            ureq::AgentBuilder::new()
                .try_proxy_from_env(true)
                .timeout_connect(etag_timeout)
                .timeout_read(data_timeout)
                .timeout_write(data_timeout)
                .user_agent(concat!("statekit-ckpt/", env!("CARGO_PKG_VERSION")))
        };
        let agent = builder().redirect_auth_headers(ureq::RedirectAuthHeaders::SameHost).build();
        let plain = builder().redirects(0).build();
        Ok(Hub { api, endpoint, agent, plain, token, etag_timeout, data_timeout })
    }

    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// `/{repo}/resolve/{rev}/{file}`, the file's path escaped.
    pub(crate) fn url(&self, repo: &str, revision: &str, file: &str) -> String {
        let repo = Repo::with_revision(repo.to_string(), RepoType::Model, revision.to_string());
        self.api.repo(repo).url(&escape_path(file))
    }

    fn authorized(&self, request: ureq::Request) -> ureq::Request {
        match &self.token {
            Some((t, _)) => request.set("Authorization", &format!("Bearer {t}")),
            None => request,
        }
    }

    /// The error for a failed request about `file` of `repo` (`None`: the repository).
    fn failed(&self, e: ureq::Error, url: &str, repo: &str, revision: &str, file: Option<&str>) -> Error {
        self.failed_as(e, url, repo, revision, file, false)
    }

    /// [`Hub::failed`], for a read or (`writing`) a write.
    fn failed_as(
        &self,
        e: ureq::Error,
        url: &str,
        repo: &str,
        revision: &str,
        file: Option<&str>,
        writing: bool,
    ) -> Error {
        match e {
            ureq::Error::Status(status, response) => {
                let code = response.header("X-Error-Code").unwrap_or_default().to_string();
                match status {
                    401 | 403 if code != "RepoNotFound" => Error::HubAuth {
                        repo: repo.into(),
                        file: file.unwrap_or("its file list").into(),
                        status,
                        token_source: self.token.as_ref().map(|(_, from)| from.clone()),
                        write: writing,
                    },
                    401 | 404 => Error::HubNotFound {
                        repo: repo.into(),
                        revision: revision.into(),
                        file: file.filter(|_| code != "RepoNotFound" && code != "RevisionNotFound").map(Into::into),
                        endpoint: self.endpoint.clone(),
                    },
                    _ => {
                        let message = response.header("X-Error-Message").map(|m| format!(": {m}")).unwrap_or_default();
                        Error::HubRequest { url: url.into(), reason: format!("the Hub answered {status}{message}") }
                    }
                }
            }
            ureq::Error::Transport(t) => Error::HubRequest { url: url.into(), reason: transport_reason(&t) },
        }
    }

    /// The commit `revision` names and its files, through `hf-hub`'s listing request.
    pub(crate) fn listing(&self, repo: &str, revision: &str) -> Result<Reached<Listing>> {
        let hub_repo = Repo::with_revision(repo.to_string(), RepoType::Model, revision.to_string());
        let request = self.api.repo(hub_repo).info_request().query("blobs", "true").timeout(self.etag_timeout);
        let url = request.url().to_string();
        let response = match request.call() {
            Ok(r) => r,
            Err(ureq::Error::Transport(t)) if unreachable(&t) => {
                return Ok(Reached::No(Error::HubRequest { url, reason: transport_reason(&t) }))
            }
            Err(e) => return Err(self.failed(e, &url, repo, revision, None)),
        };
        let bad = |reason: String| Error::HubRequest { url: url.clone(), reason };
        let text = read_capped(response, MAX_JSON, &url)?;
        let info: Info =
            serde_json::from_slice(&text).map_err(|e| bad(format!("the listing is not the Hub's JSON: {e}")))?;
        if !is_commit(&info.sha) {
            return Err(bad(format!("the listing names commit `{}`, not a 40-digit hex hash", info.sha)));
        }
        let mut files = Vec::with_capacity(info.siblings.len());
        for s in info.siblings {
            // Names become paths in the cache: none may leave the snapshot folder.
            if !is_safe_relative(&s.rfilename) {
                return Err(bad(format!(
                    "the listing names `{}`, which is not a relative path inside the repository",
                    s.rfilename
                )));
            }
            files.push(s.rfilename);
        }
        Ok(Reached::Yes(Listing { commit: info.sha, files }))
    }

    /// The whole of a small file (an index), at most [`MAX_JSON`] bytes, kept in memory.
    pub(crate) fn get_small(&self, repo: &str, commit: &str, file: &str) -> Result<Vec<u8>> {
        let url = self.url(repo, commit, file);
        let response =
            self.authorized(self.agent.get(&url)).call().map_err(|e| self.failed(e, &url, repo, commit, Some(file)))?;
        read_capped(response, MAX_JSON, &url)
    }

    /// Bytes `[start, start + len)` of `file` by one range request, and the file's length (from
    /// `Content-Range`). Fewer bytes come back when the file ends first.
    pub(crate) fn range(&self, repo: &str, commit: &str, file: &str, start: u64, len: u64) -> Result<(Vec<u8>, u64)> {
        let url = self.url(repo, commit, file);
        let bad = |reason: String| Error::HubRequest { url: url.clone(), reason };
        let last = start + len.max(1) - 1;
        let request = self.authorized(self.agent.get(&url)).set("Range", &format!("bytes={start}-{last}"));
        let response = match request.call() {
            Ok(r) => r,
            // Past the end (an empty file): `Content-Range: bytes */LEN`.
            Err(ureq::Error::Status(416, r)) => {
                let total = r.header("Content-Range").and_then(|c| c.rsplit('/').next()).and_then(|n| n.parse().ok());
                return Ok((Vec::new(), total.ok_or_else(|| bad("416 without the file's length".into()))?));
            }
            Err(e) => return Err(self.failed(e, &url, repo, commit, Some(file))),
        };
        let (skip, total) = match response.status() {
            206 => {
                let (first, total) = response
                    .header("Content-Range")
                    .and_then(parse_content_range)
                    .ok_or_else(|| bad("206 without a `Content-Range: bytes a-b/LEN`".into()))?;
                if first != start {
                    return Err(bad(format!("asked for bytes from {start}, the answer starts at {first}")));
                }
                (0, total)
            }
            // The server ignored the range: skip to `start`, read what was asked, drop the rest.
            200 => {
                let total = response.header("Content-Length").and_then(|n| n.parse().ok());
                (start, total.ok_or_else(|| bad("200 without a `Content-Length`".into()))?)
            }
            other => return Err(bad(format!("the Hub answered {other} to a range request"))),
        };
        let mut reader = response.into_reader();
        std::io::copy(&mut (&mut reader).take(skip), &mut std::io::sink()).map_err(|e| bad(io_reason(&e, self)))?;
        let mut out = Vec::with_capacity(len.min(1 << 20) as usize);
        reader.take(len).read_to_end(&mut out).map_err(|e| bad(io_reason(&e, self)))?;
        Ok((out, total))
    }

    /// What the Hub says of `file` at `commit`, read as huggingface_hub reads it: a `HEAD`
    /// that follows redirects on the Hub but stops at one that leaves it (a CDN), whose answer
    /// carries `X-Linked-Etag` and `X-Linked-Size` for LFS files.
    pub(crate) fn head(&self, repo: &str, commit: &str, file: &str) -> Result<FileMeta> {
        let mut url = self.url(repo, commit, file);
        let first = url.clone();
        for _ in 0..5 {
            let request = self.authorized(self.plain.head(&url)).set("Accept-Encoding", "identity");
            let response = request
                .timeout(self.etag_timeout)
                .call()
                .map_err(|e| self.failed(e, &first, repo, commit, Some(file)))?;
            let bad = |reason: String| Error::HubRequest { url: url.clone(), reason };
            let linked = response.header("X-Linked-Etag").map(normalize_etag);
            let redirect = (300..400).contains(&response.status());
            let location = response.header("Location").map(str::to_string);
            let (etag, size) = match (linked, redirect) {
                (Some(etag), _) => (Some(etag), response.header("X-Linked-Size").and_then(|n| n.parse().ok())),
                (None, true) => {
                    let next = location.ok_or_else(|| bad("a redirect without `Location`".into()))?;
                    let next = join_url(&url, &next);
                    if !same_host(&url, &next) {
                        return Err(bad(format!("a redirect to {next} without `X-Linked-Etag`")));
                    }
                    url = next;
                    continue;
                }
                (None, false) => (
                    response.header("ETag").map(normalize_etag),
                    response.header("Content-Length").and_then(|n| n.parse().ok()),
                ),
            };
            let etag = etag.ok_or_else(|| bad("no `ETag` in the answer".into()))?;
            // The ETag names a file in the cache: nothing but a plain hash-like name.
            if etag.is_empty() || etag.len() > 128 || !etag.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
                return Err(bad(format!("the ETag `{etag}` is not a name a blob may have")));
            }
            let size = size.ok_or_else(|| bad("no size (`X-Linked-Size` or `Content-Length`) in the answer".into()))?;
            let lfs = etag.len() == 64 && etag.bytes().all(|b| b.is_ascii_hexdigit());
            return Ok(FileMeta { etag, size, lfs });
        }
        Err(Error::HubRequest { url: first, reason: "more than 5 redirects".into() })
    }

    /// Downloads `files` of `commit` into `blobs/` of the repository's folder in `cache`, in
    /// parallel, each checked; files whose blob is there already are not fetched again. Nothing
    /// is linked into `snapshots/` yet: see [`commit_snapshot`].
    pub(crate) fn fetch(
        &self,
        cache: &Path,
        repo: &str,
        commit: &str,
        files: &[String],
        progress: Option<&Progress>,
    ) -> Result<Vec<Fetch>> {
        let folder = Repo::model(repo.to_string()).folder_name();
        let repo_dir = cache.join(&folder);
        let metas = parallel(files, |file| self.head(repo, commit, file));
        let mut fetches = Vec::with_capacity(files.len());
        for (file, meta) in files.iter().zip(metas) {
            fetches.push(Fetch { file: file.clone(), meta: meta? });
        }
        let blob = |f: &Fetch| blob_path(&repo_dir, &f.meta.etag);
        let total: u64 = fetches.iter().filter(|f| !blob(f).exists()).map(|f| f.meta.size).sum();
        if total > 0 {
            std::fs::create_dir_all(repo_dir.join("blobs")).at(repo_dir.join("blobs"))?;
            write_cachedir_tag(cache);
        }
        let report = |n: u64| {
            if let Some(p) = progress {
                p(n, total)
            }
        };
        report(0);
        let lock_dir = cache.join(".locks").join(&folder);
        let done = parallel(&fetches, |f| {
            if blob(f).exists() {
                return Ok(());
            }
            self.fetch_blob(repo, commit, f, &blob(f), &lock_dir.join(format!("{}.lock", f.meta.etag)), &report)
        });
        done.into_iter().collect::<Result<Vec<()>>>()?;
        Ok(fetches)
    }

    /// Fetches one blob under its lock, resuming from `<blob>.incomplete`, checked before it is
    /// renamed into place.
    fn fetch_blob(
        &self,
        repo: &str,
        commit: &str,
        f: &Fetch,
        blob: &Path,
        lock: &Path,
        report: &(dyn Fn(u64) + Sync),
    ) -> Result<()> {
        if let Some(dir) = lock.parent() {
            std::fs::create_dir_all(dir).at(dir)?;
        }
        let held = File::options().create(true).truncate(false).write(true).open(lock).at(lock)?;
        // Blocks while another process (ours or huggingface_hub's) downloads the same blob.
        held.lock().at(lock)?;
        if blob.exists() {
            return Ok(());
        }
        let mut part_name = blob.as_os_str().to_owned();
        part_name.push(".incomplete");
        let part = PathBuf::from(part_name);
        let mut out = File::options().create(true).truncate(false).read(true).write(true).open(&part).at(&part)?;
        let mut have = out.metadata().at(&part)?.len();
        if have > f.meta.size {
            out.set_len(0).at(&part)?;
            have = 0;
        }
        // What an earlier run left counts towards the digest and the bar.
        let mut digest = Sha256::new();
        out.seek(SeekFrom::Start(0)).at(&part)?;
        std::io::copy(&mut (&mut out).take(have), &mut HashWriter(&mut digest)).at(&part)?;
        out.seek(SeekFrom::Start(have)).at(&part)?;
        report(have);
        if have < f.meta.size {
            have = self.fetch_into(repo, commit, f, &part, &mut out, have, &mut digest, report)?;
        }
        out.sync_all().at(&part)?;
        let corrupt = |problem| {
            let _ = std::fs::remove_file(&part);
            Error::HubCorrupt { repo: repo.into(), file: f.file.clone(), problem }
        };
        if have != f.meta.size {
            return Err(corrupt(HubCorruption::Size { got: have, announced: f.meta.size }));
        }
        if f.meta.lfs {
            let found = hex(&digest.finalize());
            if found != f.meta.etag {
                return Err(corrupt(HubCorruption::Sha256 { found, etag: f.meta.etag.clone() }));
            }
        } else if f.meta.etag.len() == 40 {
            // A file kept in git: its ETag is the git blob id, SHA-1 of `blob <len>\0` + bytes.
            let found = git_blob_id(&mut out, have).at(&part)?;
            if found != f.meta.etag {
                return Err(corrupt(HubCorruption::GitBlob { found, etag: f.meta.etag.clone() }));
            }
        }
        std::fs::rename(&part, blob).at(blob)?;
        durable::sync_dir(blob.parent().unwrap_or(Path::new("."))).map_err(crate::read::io::fs_error)
    }

    /// Streams the rest of the file from byte `have` into `out`; returns the bytes it now
    /// holds. A broken connection leaves them in `part` for the next run.
    #[allow(clippy::too_many_arguments)]
    fn fetch_into(
        &self,
        repo: &str,
        commit: &str,
        f: &Fetch,
        part: &Path,
        out: &mut File,
        mut have: u64,
        digest: &mut Sha256,
        report: &(dyn Fn(u64) + Sync),
    ) -> Result<u64> {
        let url = self.url(repo, commit, &f.file);
        let mut request = self.authorized(self.agent.get(&url)).set("Accept-Encoding", "identity");
        if have > 0 {
            request = request.set("Range", &format!("bytes={have}-"));
        }
        let response = request.call().map_err(|e| self.failed(e, &url, repo, commit, Some(&f.file)))?;
        match response.status() {
            206 => {
                let first = response.header("Content-Range").and_then(parse_content_range).map(|(a, _)| a);
                if first != Some(have) {
                    return Err(Error::HubRequest {
                        url,
                        reason: format!("asked to resume at byte {have}, the answer starts elsewhere"),
                    });
                }
            }
            // The whole file: start over.
            200 if have > 0 => {
                out.set_len(0).at(part)?;
                out.seek(SeekFrom::Start(0)).at(part)?;
                *digest = Sha256::new();
                have = 0;
            }
            _ => {}
        }
        let mut reader = response.into_reader().take(f.meta.size - have);
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let _ = out.sync_data();
                    let reason = format!(
                        "{} after {have} of {} bytes of `{}`; they are kept in {} and the next run resumes from there",
                        io_reason(&e, self),
                        f.meta.size,
                        f.file,
                        part.display()
                    );
                    return Err(Error::HubRequest { url, reason });
                }
            };
            let chunk = buf.get(..n).unwrap_or_default();
            out.write_all(chunk).at(part)?;
            digest.update(chunk);
            have += n as u64;
            report(n as u64);
        }
        if have < f.meta.size {
            // An answer without a length that ended early: kept, like a broken connection.
            let _ = out.sync_data();
            let reason = format!(
                "the answer ended after {have} of {} bytes of `{}`; they are kept in {} and the next run resumes from there",
                f.meta.size,
                f.file,
                part.display()
            );
            return Err(Error::HubRequest { url, reason });
        }
        Ok(have)
    }
}

/// The SHA-256 of a file, streamed.
pub(crate) fn sha256_of(path: &Path) -> Result<String> {
    let mut digest = Sha256::new();
    let mut file = File::open(path).at(path)?;
    std::io::copy(&mut file, &mut HashWriter(&mut digest)).at(path)?;
    Ok(hex(&digest.finalize()))
}

/// Links each fetched file into `snapshots/<commit>/` and points `refs/<revision>` at the
/// commit: done once every blob of a job is in place, so a failed job links nothing.
pub(crate) fn commit_snapshot(cache: &Path, repo: &str, revision: &str, commit: &str, fetches: &[Fetch]) -> Result<()> {
    let repo_dir = cache.join(Repo::model(repo.to_string()).folder_name());
    for f in fetches {
        link(&repo_dir, commit, &f.file, &f.meta.etag)?;
    }
    write_ref(&repo_dir, revision, commit)
}

/// Where the blob named `etag` is kept.
pub(crate) fn blob_path(repo_dir: &Path, etag: &str) -> PathBuf {
    repo_dir.join("blobs").join(etag)
}

/// The git blob id of the first `len` bytes of `file`.
fn git_blob_id(file: &mut File, len: u64) -> std::io::Result<String> {
    use sha1::Digest as _;
    let mut sha = sha1::Sha1::new();
    sha.update(format!("blob {len}\0").as_bytes());
    file.seek(SeekFrom::Start(0))?;
    let mut buf = vec![0u8; 256 << 10];
    let mut left = len;
    while left > 0 {
        let want = left.min(buf.len() as u64) as usize;
        let n = file.read(buf.get_mut(..want).unwrap_or_default())?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        sha.update(buf.get(..n).unwrap_or_default());
        left -= n as u64;
    }
    Ok(hex(&sha.finalize()))
}

/// Whether the transport error means the Hub could not be reached at all (no answer).
fn unreachable(t: &ureq::Transport) -> bool {
    matches!(t.kind(), ureq::ErrorKind::Dns | ureq::ErrorKind::ConnectionFailed | ureq::ErrorKind::ProxyConnect)
}

/// What went wrong on the way, without the URL (the error names it once).
fn transport_reason(t: &ureq::Transport) -> String {
    let mut detail = t.kind().to_string();
    for part in
        [t.message().map(str::to_string), std::error::Error::source(t).map(|s| s.to_string())].into_iter().flatten()
    {
        detail.push_str(": ");
        detail.push_str(&part);
    }
    if detail.contains("timed out") || detail.contains("WouldBlock") {
        return "no answer in time (`HF_HUB_ETAG_TIMEOUT`, `HF_HUB_DOWNLOAD_TIMEOUT` set the limits in seconds)".into();
    }
    if unreachable(t) {
        detail.push_str(" (`HF_ENDPOINT` names the Hub; with `HF_HUB_OFFLINE=1` only the cache is read)");
    }
    detail
}

fn io_reason(e: &std::io::Error, hub: &Hub) -> String {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => format!(
            "no data for {} s (`HF_HUB_DOWNLOAD_TIMEOUT` sets the limit in seconds)",
            hub.data_timeout.as_secs()
        ),
        std::io::ErrorKind::UnexpectedEof => "the connection closed early".into(),
        _ => e.to_string(),
    }
}

/// Reads a whole answer, refusing one over `max` bytes.
fn read_capped(response: ureq::Response, max: u64, url: &str) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    response
        .into_reader()
        .take(max + 1)
        .read_to_end(&mut out)
        .map_err(|e| Error::HubRequest { url: url.into(), reason: e.to_string() })?;
    if out.len() as u64 > max {
        return Err(Error::HubRequest { url: url.into(), reason: format!("the answer is over {max} bytes") });
    }
    Ok(out)
}

/// `bytes a-b/LEN` as `(a, LEN)`.
fn parse_content_range(v: &str) -> Option<(u64, u64)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (span, total) = rest.split_once('/')?;
    let (first, _) = span.split_once('-')?;
    Some((first.trim().parse().ok()?, total.trim().parse().ok()?))
}

/// huggingface_hub's `_normalize_etag`: `W/"x"` and `"x"` are `x`.
fn normalize_etag(v: &str) -> String {
    v.trim().trim_start_matches("W/").trim_matches('"').to_string()
}

/// A 40-digit lowercase hex commit hash, as huggingface_hub's `REGEX_COMMIT_HASH` matches.
pub(crate) fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A path inside a repository that stays inside it once joined to a folder.
pub(crate) fn is_safe_relative(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('/')
        && !p.contains(['\\', '\0'])
        && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

/// Percent-escapes a path for a URL, keeping its `/`.
fn escape_path(p: &str) -> String {
    let mut out = String::with_capacity(p.len());
    for b in p.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `location` (absolute, or a path on the same host) against `base`.
fn join_url(base: &str, location: &str) -> String {
    if location.contains("://") {
        return location.to_string();
    }
    let origin_end = base.find("://").map(|i| i + 3).and_then(|i| base[i..].find('/').map(|j| i + j));
    match origin_end {
        Some(end) if location.starts_with('/') => format!("{}{location}", &base[..end]),
        Some(_) => format!("{}/{location}", base.rsplit_once('/').map_or(base, |(a, _)| a)),
        None => format!("{base}/{location}"),
    }
}

fn same_host(a: &str, b: &str) -> bool {
    let host = |u: &str| u.split("://").nth(1).and_then(|r| r.split('/').next()).map(str::to_ascii_lowercase);
    host(a) == host(b)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Feeds what is written into a digest.
struct HashWriter<'a>(&'a mut Sha256);

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `CACHEDIR.TAG` at the cache's root, as huggingface_hub leaves it; best effort, as there.
fn write_cachedir_tag(cache: &Path) {
    let tag = cache.join("CACHEDIR.TAG");
    if !tag.exists() {
        let _ = durable::write_atomic(&tag, CACHEDIR_TAG.as_bytes());
    }
}

/// `snapshots/<commit>/<file>` → `../../blobs/<etag>` (one `..` more per folder in `file`),
/// made under a temporary name and renamed into place.
pub(crate) fn link(repo_dir: &Path, commit: &str, file: &str, etag: &str) -> Result<()> {
    let pointer = repo_dir.join("snapshots").join(commit).join(file);
    if pointer.exists() {
        return Ok(());
    }
    let dir = pointer.parent().unwrap_or(repo_dir);
    std::fs::create_dir_all(dir).at(dir)?;
    let depth = file.split('/').count() + 1;
    let target: PathBuf = std::iter::repeat_n("..", depth).collect::<PathBuf>().join("blobs").join(etag);
    let temp = durable::temp_name(&pointer, &durable::random_hex());
    std::os::unix::fs::symlink(&target, &temp).at(&temp)?;
    if let Err(e) = std::fs::rename(&temp, &pointer) {
        let _ = std::fs::remove_file(&temp);
        return Err(Error::Io { path: pointer, source: e });
    }
    Ok(())
}

/// `refs/<revision>` holding `commit`, unless the revision is the commit itself (huggingface_hub
/// writes none then); rewritten only when it changes.
pub(crate) fn write_ref(repo_dir: &Path, revision: &str, commit: &str) -> Result<()> {
    if revision == commit || !is_safe_relative(revision) {
        return Ok(());
    }
    let path = repo_dir.join("refs").join(revision);
    if std::fs::read_to_string(&path).is_ok_and(|c| c == commit) {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).at(dir)?;
    }
    durable::write_atomic(&path, commit.as_bytes()).map_err(crate::read::io::fs_error)
}

/// `f` over `items` on up to [`WORKERS`] threads, results in the items' order.
pub(crate) fn parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = items.len().clamp(1, WORKERS);
    let mut done: Vec<(usize, R)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        mine.push((i, f(item)));
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges_and_etags_parse_as_the_hub_writes_them() {
        assert_eq!(parse_content_range("bytes 8-1031/4096"), Some((8, 4096)));
        assert_eq!(parse_content_range("bytes */4096"), None);
        assert_eq!(normalize_etag("W/\"abc\""), "abc");
        assert_eq!(normalize_etag("\"abc\""), "abc");
    }

    #[test]
    fn only_paths_inside_the_repository_are_safe() {
        for ok in ["model.safetensors", "sub/model.safetensors"] {
            assert!(is_safe_relative(ok), "{ok}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "a\\b", "./a"] {
            assert!(!is_safe_relative(bad), "{bad}");
        }
        assert_eq!(escape_path("sub dir/a+b.json"), "sub%20dir/a%2Bb.json");
    }

    #[test]
    fn redirects_resolve_against_the_url_they_answer() {
        let base = "http://127.0.0.1:8080/org/name/resolve/main/model.safetensors";
        assert_eq!(join_url(base, "/_lfs/abc"), "http://127.0.0.1:8080/_lfs/abc");
        assert!(same_host(base, "http://127.0.0.1:8080/_lfs/abc"));
        assert!(!same_host(base, "https://cdn.example/abc"));
    }

    #[test]
    fn parallel_keeps_the_order() {
        let items: Vec<u32> = (0..50).collect();
        assert_eq!(parallel(&items, |x| x * 2), items.iter().map(|x| x * 2).collect::<Vec<_>>());
    }
}
