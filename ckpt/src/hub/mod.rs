//! `hf://ORG/NAME[@REV][/PATH]` addresses: resolved in the local Hugging Face cache, read on
//! the Hub by range requests, or downloaded into the cache.
//!
//! The cache is the folder huggingface_hub downloads into: `HF_HUB_CACHE`, else `$HF_HOME/hub`,
//! else `~/.cache/huggingface/hub`. A repo lives in `models--ORG--NAME/`, with `refs/<rev>`
//! holding a commit hash, `blobs/<etag>` holding the files' bytes and `snapshots/<commit>/`
//! holding the files as relative symlinks into `blobs/`. We read and write it exactly as
//! huggingface_hub does, so each finds what the other downloaded.
//!
//! How an address is found, in huggingface_hub's order:
//! 1. `HF_HUB_OFFLINE=1`: the cache only (`refs/<rev>`, or a commit's snapshot folder);
//! 2. a revision that is a commit whose files are all in the cache: no request at all;
//! 3. otherwise the Hub names the revision's commit and files (one listing request); files
//!    already in that commit's snapshot are used from there. When the Hub cannot be reached at
//!    all, the cache answers as in 1.
//!
//! Then what is missing depends on what the caller reads ([`Need`]): for the catalog alone (a
//! safetensors file or a sharded index with its shards), each header is read by two range
//! requests and nothing is written; for tensor bytes, the files the checkpoint consists of (the
//! index and its shards, one file, or every file under a folder) are downloaded ([`remote`]).

mod remote;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hf_hub::{Cache, Repo, RepoType};

use crate::error::{Error, HubUrlProblem, Result};
use crate::formats::hf_index::{self, Index};
use crate::formats::safetensors as st;
use crate::read::catalog::Scan;

pub(crate) use remote::Progress;
use remote::{Hub, Listing, Reached};

/// Reports the bytes an `hf://` download fetches: called with `(bytes just fetched, bytes the
/// whole download fetches)`, from several threads. One report covers every file of the job.
#[derive(Clone)]
pub struct DownloadProgress(pub Arc<dyn Fn(u64, u64) + Send + Sync>);

impl std::fmt::Debug for DownloadProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DownloadProgress")
    }
}

/// What the caller reads of an `hf://` source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Need {
    /// The catalog only: headers may be read remotely, nothing downloaded.
    Headers,
    /// Tensor bytes: the files are downloaded into the cache.
    Bytes,
}

/// Where a source is: a local path (a cache snapshot for `hf://`), or a catalog read remotely.
#[derive(Debug)]
pub(crate) enum Located {
    Path(PathBuf),
    Remote(Box<Scan>),
}

/// A parsed `hf://` address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HubAddress {
    pub repo: String,
    pub revision: String,
    pub path: Option<String>,
}

impl HubAddress {
    /// Parses `hf://ORG/NAME[@REV][/PATH]`; `None` when `s` is not an `hf://` address at all.
    pub(crate) fn parse(s: &str) -> Option<Result<HubAddress>> {
        let rest = s.strip_prefix("hf://")?;
        let bad = |problem| Error::BadHubUrl { input: s.to_string(), problem };
        let mut parts = rest.splitn(3, '/');
        let org = parts.next().unwrap_or_default();
        let name_rev = parts.next().unwrap_or_default();
        let path = parts.next().filter(|p| !p.is_empty()).map(str::to_string);
        let (name, revision) = match name_rev.split_once('@') {
            Some((n, r)) => (n, r.to_string()),
            None => (name_rev, "main".to_string()),
        };
        if org.is_empty() || name.is_empty() {
            return Some(Err(bad(HubUrlProblem::Shape)));
        }
        if revision.is_empty() {
            return Some(Err(bad(HubUrlProblem::EmptyRevision)));
        }
        if revision == "." || revision == ".." {
            return Some(Err(bad(HubUrlProblem::DotRevision)));
        }
        if path.as_deref().is_some_and(|p| p.split('/').any(|c| c == "..")) {
            return Some(Err(bad(HubUrlProblem::DotDotPath)));
        }
        Some(Ok(HubAddress { repo: format!("{org}/{name}"), revision, path }))
    }

    /// `src` parsed, its revision replaced by `revision` (`--revision`, which may hold a `/`,
    /// as `refs/pr/1` does, where `@REV` cannot); an `@REV` that says otherwise is refused.
    pub(crate) fn parse_with(src: &str, revision: Option<&str>) -> Option<Result<HubAddress>> {
        let parsed = HubAddress::parse(src)?;
        let Some(rev) = revision else { return Some(parsed) };
        let bad = |problem| Error::BadHubUrl { input: src.to_string(), problem };
        Some(parsed.and_then(|mut addr| {
            let named = src.trim_start_matches("hf://").split('/').nth(1).is_some_and(|n| n.contains('@'));
            if named && addr.revision != rev {
                return Err(bad(HubUrlProblem::RevisionsDiffer { named: addr.revision, option: rev.to_string() }));
            }
            if !remote::is_safe_relative(rev) {
                return Err(bad(HubUrlProblem::BadRevision { revision: rev.to_string() }));
            }
            addr.revision = rev.to_string();
            Ok(addr)
        }))
    }
}

/// The cache folder, from the same variables huggingface_hub reads.
pub(crate) fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HF_HUB_CACHE").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    Cache::from_env().path().clone()
}

/// Finds `src`: a plain path as it is; an `hf://` address in the cache, on the Hub, or
/// downloaded into the cache, as [`Need`] asks (see the module's documentation).
pub(crate) fn locate(src: &str, revision: Option<&str>, need: Need, progress: Option<&Progress>) -> Result<Located> {
    let Some(addr) = HubAddress::parse_with(src, revision) else {
        if revision.is_some() {
            let misuse = crate::Misuse::RevisionForPath { source: src.to_string() };
            return Err(Error::Misuse { path: PathBuf::from(src), misuse });
        }
        return Ok(Located::Path(PathBuf::from(src)));
    };
    let addr = addr?;
    let cache = cache_dir();
    if remote::env_true("HF_HUB_OFFLINE") {
        return resolve_in(&addr, &cache).map(Located::Path);
    }
    // huggingface_hub's shortcut: a commit already in the cache needs no request.
    if remote::is_commit(&addr.revision) {
        if let Ok(path) = resolve_in(&addr, &cache) {
            if complete(&path) {
                return Ok(Located::Path(path));
            }
        }
    }
    let hub = Hub::from_env()?;
    let listing = match hub.listing(&addr.repo, &addr.revision)? {
        Reached::Yes(listing) => listing,
        // As huggingface_hub does when the Hub cannot be reached: what the cache holds.
        Reached::No(e) => return resolve_in(&addr, &cache).map(Located::Path).map_err(|_| e),
    };
    let pick = pick(&addr, &listing, hub.endpoint())?;
    let repo_dir = cache.join(Repo::model(addr.repo.clone()).folder_name());
    let snapshot = repo_dir.join("snapshots").join(&listing.commit);
    let root = snapshot.join(pick.root());
    if pick.cached(&snapshot) {
        // Best effort, as huggingface_hub: a read-only cache still serves what it holds.
        let _ = remote::write_ref(&repo_dir, &addr.revision, &listing.commit);
        return Ok(Located::Path(root));
    }
    let at = Remote { hub: &hub, repo: &addr.repo, commit: &listing.commit, listing: &listing };
    match (need, &pick) {
        (Need::Headers, Pick::File(f)) if f.ends_with(".safetensors") => {
            let (file, header) = at.header(f)?;
            Ok(Located::Remote(Box::new(st::catalog_of(file, header)?)))
        }
        (Need::Headers, Pick::Index(f)) if f.ends_with(".safetensors.index.json") => {
            at.sharded(f, &snapshot).map(|scan| Located::Remote(Box::new(scan)))
        }
        _ => {
            let mut fetched = Vec::new();
            let files = match &pick {
                Pick::Index(f) => {
                    // The index first, into `blobs/` only, for the names of its shards.
                    let index = hub.fetch(&cache, &addr.repo, &listing.commit, std::slice::from_ref(f), None)?;
                    let blob = index.first().map(|i| remote::blob_path(&repo_dir, &i.meta.etag)).unwrap_or_default();
                    let parsed = Index::read(&blob).map_err(|e| rename_path(e, &blob, &snapshot.join(f)))?;
                    fetched.extend(index);
                    let dir = folder_of(f);
                    parsed
                        .shard_names()
                        .into_iter()
                        .map(|n| format!("{dir}{n}"))
                        .filter(|n| listing.files.contains(n))
                        .collect()
                }
                Pick::File(f) => vec![f.clone()],
                Pick::Folder(_, files) => files.clone(),
            };
            fetched.extend(hub.fetch(&cache, &addr.repo, &listing.commit, &files, progress)?);
            remote::commit_snapshot(&cache, &addr.repo, &addr.revision, &listing.commit, &fetched)?;
            Ok(Located::Path(root))
        }
    }
}

/// What [`push`] did.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Pushed {
    /// The repository (`ORG/NAME`).
    pub repo: String,
    /// The branch.
    pub revision: String,
    /// The new commit; `None` when the branch held every file already, and nothing was committed.
    pub commit: Option<String>,
    /// The commit's URL, as the Hub gives it.
    pub url: Option<String>,
    /// The files uploaded, by their path in the repository.
    pub uploaded: Vec<String>,
    /// The files the branch already held with the same bytes (same SHA-256, or git blob id).
    pub skipped: Vec<String>,
}

/// Pushes the files under `local` (a folder `ckpt` wrote: a converted model, a split) to the
/// Hub repository `dst` (`hf://ORG/NAME[@BRANCH][/PATH]`; `revision` overrides the branch,
/// `PATH` is the folder in the repository) as one commit with `message`. Large files go by
/// LFS; files the branch already holds with the same bytes are skipped; a repository that does
/// not exist is created. Hidden files (a name starting with `.`) stay behind. Takes a token
/// with write access (`HF_TOKEN`, or the token file).
pub fn push(local: &Path, dst: &str, revision: Option<&str>, message: Option<&str>) -> Result<Pushed> {
    let addr = HubAddress::parse_with(dst, revision)
        .unwrap_or_else(|| Err(Error::BadHubUrl { input: dst.into(), problem: HubUrlProblem::NotAPushTarget }))?;
    let revision = addr.revision.clone();
    if remote::env_true("HF_HUB_OFFLINE") {
        return Err(Error::PushOffline { dst: dst.to_string() });
    }
    let prefix = addr.path.as_deref().map(|p| format!("{}/", p.trim_end_matches('/'))).unwrap_or_default();
    let mut found = Vec::new();
    walk(local, local, &mut found)?;
    if found.is_empty() {
        return Err(Error::NothingToPush { path: local.to_path_buf() });
    }
    let files = found
        .into_iter()
        .map(|(rel, path)| {
            let size = std::fs::metadata(&path).map_err(|e| Error::Io { path: path.clone(), source: e })?.len();
            let sha256 = remote::sha256_of(&path)?;
            Ok(remote::Upload { path: format!("{prefix}{rel}"), local: path, size, sha256 })
        })
        .collect::<Result<Vec<_>>>()?;
    let message = message.map_or_else(|| format!("Upload {} with ckpt", addr.repo), str::to_string);
    let done = Hub::from_env()?.push(&addr.repo, &revision, &files, &message)?;
    Ok(Pushed {
        repo: addr.repo,
        revision,
        commit: done.commit,
        url: done.url,
        uploaded: done.uploaded,
        skipped: done.skipped,
    })
}

/// The regular files under `dir`, hidden ones left out, with their `/`-separated paths
/// relative to `root`, sorted.
fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let mut entries: Vec<_> =
        std::fs::read_dir(dir).map_err(io(dir))?.collect::<std::io::Result<_>>().map_err(io(dir))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let path = e.path();
        let meta = std::fs::metadata(&path).map_err(io(&path))?;
        if meta.is_dir() {
            walk(root, &path, out)?;
        } else if meta.is_file() {
            let rel = path.strip_prefix(root).unwrap_or(&path);
            let rel: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
            out.push((rel.join("/"), path));
        }
    }
    Ok(())
}

/// `"sub/"` for `"sub/model.safetensors.index.json"`, `""` at the top.
fn folder_of(file: &str) -> String {
    file.rsplit_once('/').map(|(d, _)| format!("{d}/")).unwrap_or_default()
}

/// An error about the blob `from` as one about the snapshot's file `to`, the name users know.
fn rename_path(e: Error, from: &Path, to: &Path) -> Error {
    match e {
        Error::BadIndex { path, problem } if path == from => Error::BadIndex { path: to.to_path_buf(), problem },
        Error::UnsafeShardPath { index, tensor, file } if index == from => {
            Error::UnsafeShardPath { index: to.to_path_buf(), tensor, file }
        }
        other => other,
    }
}

/// What of a repository a source is.
#[derive(Debug)]
enum Pick {
    /// An index (safetensors or torch): it and its shards.
    Index(String),
    /// One file.
    File(String),
    /// Every file under a folder (`""`: the repository), for layouts without an index.
    Folder(String, Vec<String>),
}

impl Pick {
    /// The path in a snapshot that detection is given.
    fn root(&self) -> &str {
        match self {
            Pick::Index(f) | Pick::File(f) => f,
            Pick::Folder(dir, _) => dir,
        }
    }

    /// Whether the snapshot holds every file of the pick.
    fn cached(&self, snapshot: &Path) -> bool {
        match self {
            Pick::Index(f) | Pick::File(f) => complete(&snapshot.join(f)),
            Pick::Folder(_, files) => files.iter().all(|f| snapshot.join(f).exists()),
        }
    }
}

/// Whether the cached `path` is all a checkpoint needs: a file, or an index with its shards.
fn complete(path: &Path) -> bool {
    if !path.exists() {
        return false;
    }
    if !path.to_string_lossy().ends_with(".index.json") {
        return true;
    }
    // An index that does not parse is complete as far as the cache goes: reading it says why.
    Index::read(path).map_or(true, |index| index.shard_names().iter().all(|n| index.dir().join(n).exists()))
}

/// Which files of the listing `addr` names: its path (a file, or a folder's checkpoint), or
/// the repository's checkpoint: the safetensors index, `model.safetensors`, then the torch ones.
fn pick(addr: &HubAddress, listing: &Listing, endpoint: &str) -> Result<Pick> {
    let has = |f: &str| listing.files.iter().any(|x| x == f);
    let prefix = match &addr.path {
        Some(p) if has(p) => {
            return Ok(if p.ends_with(".index.json") { Pick::Index(p.clone()) } else { Pick::File(p.clone()) })
        }
        Some(p) => format!("{}/", p.trim_end_matches('/')),
        None => String::new(),
    };
    let known = [
        (hf_index::INDEX_NAME, true),
        (hf_index::SINGLE_NAME, false),
        ("pytorch_model.bin.index.json", true),
        ("pytorch_model.bin", false),
    ];
    for (name, index) in known {
        let f = format!("{prefix}{name}");
        if has(&f) {
            return Ok(if index { Pick::Index(f) } else { Pick::File(f) });
        }
    }
    let under: Vec<String> = listing.files.iter().filter(|f| f.starts_with(&prefix)).cloned().collect();
    if under.is_empty() || addr.path.is_none() {
        let file =
            addr.path.clone().unwrap_or_else(|| format!("{}` or `{}", hf_index::INDEX_NAME, hf_index::SINGLE_NAME));
        return Err(Error::HubNotFound {
            repo: addr.repo.clone(),
            revision: addr.revision.clone(),
            file: Some(file),
            endpoint: endpoint.to_string(),
        });
    }
    Ok(Pick::Folder(prefix.trim_end_matches('/').to_string(), under))
}

/// A commit of a repository on the Hub, read by range requests.
struct Remote<'a> {
    hub: &'a Hub,
    repo: &'a str,
    commit: &'a str,
    listing: &'a Listing,
}

/// What the first range request of a remote safetensors file asks for (see `Remote::header`).
const FIRST_READ: u64 = 64 << 10;

impl Remote<'_> {
    /// How a remote file is named in a catalog and its errors: `hf://ORG/NAME@COMMIT/FILE`,
    /// an address that opens the same bytes again.
    fn path(&self, file: &str) -> PathBuf {
        PathBuf::from(format!("hf://{}@{}/{file}", self.repo, self.commit))
    }

    /// A safetensors file's header by range requests, and the file as a source. The first asks
    /// for [`FIRST_READ`] bytes: the 8-byte length and, for all but huge headers, the whole
    /// header, so a shard costs one request (huggingface_hub's `get_safetensors_metadata` reads
    /// 100 kB the same way); a longer header is read by a second. The local reader's cap and
    /// checks apply to what comes back.
    fn header(&self, file: &str) -> Result<(crate::read::catalog::SourceFile, st::Header)> {
        let path = self.path(file);
        let (first, len) = self.hub.range(self.repo, self.commit, file, 0, FIRST_READ)?;
        let header = st::read_header_with(len, &path, |offset, n| {
            match first.get(offset as usize..offset.saturating_add(n) as usize) {
                Some(held) => Ok(held.to_vec()),
                None => self.hub.range(self.repo, self.commit, file, offset, n).map(|(bytes, _)| bytes),
            }
        })?;
        Ok(st::source_of(&path, len, header))
    }

    /// A sharded checkpoint's catalog: the index (from the snapshot when cached there, else
    /// fetched into memory), then every shard's header, in parallel.
    fn sharded(&self, index_file: &str, snapshot: &Path) -> Result<Scan> {
        let cached = snapshot.join(index_file);
        let path = self.path(index_file);
        let text = match cached.exists() {
            true => crate::read::io::read_capped(&cached, hf_index::MAX_INDEX_LEN)?,
            false => self.hub.get_small(self.repo, self.commit, index_file)?,
        };
        let index = Index::parse(&text, &path)?;
        let dir = folder_of(index_file);
        let names: Vec<String> = index
            .shard_names()
            .into_iter()
            .map(str::to_string)
            .filter(|n| self.listing.files.contains(&format!("{dir}{n}")))
            .collect();
        let headers = remote::parallel(&names, |n| self.header(&format!("{dir}{n}")));
        let mut read: std::collections::HashMap<String, Result<_>> = names.into_iter().zip(headers).collect();
        hf_index::catalog_of(&index, |name| read.remove(name))
    }
}

/// Resolves an address in the cache at `cache`. Without a path, the repo's index is preferred,
/// then its `model.safetensors`.
pub(crate) fn resolve_in(addr: &HubAddress, cache: &Path) -> Result<PathBuf> {
    let hub = Cache::new(cache.to_path_buf());
    let repo = Repo::with_revision(addr.repo.clone(), RepoType::Model, addr.revision.clone());
    let folder = cache.join(repo.folder_name());
    let cached = hub.repo(repo);
    let candidates: Vec<&str> = match &addr.path {
        Some(p) => vec![p.as_str()],
        None => vec![hf_index::INDEX_NAME, hf_index::SINGLE_NAME],
    };
    for file in &candidates {
        // `refs/<rev>` names the commit; a revision that is itself a commit hash has no ref,
        // only a snapshot folder, which huggingface_hub also accepts.
        let found = cached.get(file).or_else(|| {
            let direct = folder.join("snapshots").join(&addr.revision).join(file);
            direct.exists().then_some(direct)
        });
        if let Some(path) = found {
            return Ok(path);
        }
    }
    Err(Error::NotInHubCache {
        repo: addr.repo.clone(),
        revision: addr.revision.clone(),
        file: candidates.join("` or `"),
        cache: cache.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::HubAddress;

    fn parse(s: &str) -> HubAddress {
        match HubAddress::parse(s) {
            Some(Ok(a)) => a,
            other => panic!("{s}: {other:?}"),
        }
    }

    #[test]
    fn parses_every_part() {
        let a = parse("hf://org/name@v1.0/sub/model.safetensors");
        assert_eq!((a.repo.as_str(), a.revision.as_str()), ("org/name", "v1.0"));
        assert_eq!(a.path.as_deref(), Some("sub/model.safetensors"));
        let b = parse("hf://org/name");
        assert_eq!((b.revision.as_str(), b.path), ("main", None));
    }

    #[test]
    fn the_revision_option_replaces_the_default_and_agrees_with_an_explicit_one() {
        let with = |s: &str, r: &str| HubAddress::parse_with(s, Some(r)).map(|a| a.map(|a| a.revision));
        assert_eq!(with("hf://org/name", "refs/pr/1").and_then(Result::ok).as_deref(), Some("refs/pr/1"));
        assert_eq!(with("hf://org/name@v1/sub", "v1").and_then(Result::ok).as_deref(), Some("v1"));
        assert!(matches!(with("hf://org/name@v1", "v2"), Some(Err(_))));
        assert!(matches!(with("hf://org/name", "../x"), Some(Err(_))));
    }

    #[test]
    fn refuses_bad_addresses() {
        assert!(HubAddress::parse("model.safetensors").is_none());
        for bad in ["hf://org", "hf://org/@x", "hf://org/name@", "hf://org/name@..", "hf://org/name/../../etc/passwd"] {
            assert!(matches!(HubAddress::parse(bad), Some(Err(_))), "{bad}");
        }
    }
}
