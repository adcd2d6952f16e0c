//! `hf://ORG/NAME[@REV][/PATH]` addresses, resolved in the local Hugging Face cache.
//!
//! The cache is the folder huggingface_hub downloads into: `HF_HUB_CACHE`, else `$HF_HOME/hub`,
//! else `~/.cache/huggingface/hub`. A repo lives in `models--ORG--NAME/`, with `refs/<rev>`
//! holding a commit hash and `snapshots/<commit>/` holding the files (symlinks into `blobs/`).
//! We only read the cache and never go online, so this works the same with `HF_HUB_OFFLINE=1`.

use std::path::{Path, PathBuf};

use hf_hub::{Cache, Repo, RepoType};

use crate::error::{Error, Result};
use crate::formats::hf_index;

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
        let bad = |reason: &str| Error::BadHubUrl { input: s.to_string(), reason: reason.to_string() };
        let mut parts = rest.splitn(3, '/');
        let org = parts.next().unwrap_or_default();
        let name_rev = parts.next().unwrap_or_default();
        let path = parts.next().filter(|p| !p.is_empty()).map(str::to_string);
        let (name, revision) = match name_rev.split_once('@') {
            Some((n, r)) => (n, r.to_string()),
            None => (name_rev, "main".to_string()),
        };
        if org.is_empty() || name.is_empty() {
            return Some(Err(bad("expected `hf://ORG/NAME[@REV][/PATH]`")));
        }
        if revision.is_empty() {
            return Some(Err(bad("empty revision after `@`")));
        }
        if path.as_deref().is_some_and(|p| p.split('/').any(|c| c == "..")) {
            return Some(Err(bad("`..` is not allowed in the path")));
        }
        Some(Ok(HubAddress { repo: format!("{org}/{name}"), revision, path }))
    }
}

/// The cache folder, from the same variables huggingface_hub reads.
pub(crate) fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HF_HUB_CACHE").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    Cache::from_env().path().clone()
}

/// Turns `src` into a local path: `hf://` addresses through the cache, anything else as is.
pub(crate) fn resolve(src: &str) -> Result<PathBuf> {
    match HubAddress::parse(src) {
        None => Ok(PathBuf::from(src)),
        Some(addr) => resolve_in(&addr?, &cache_dir()),
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
    fn refuses_bad_addresses() {
        assert!(HubAddress::parse("model.safetensors").is_none());
        for bad in ["hf://org", "hf://org/@x", "hf://org/name@", "hf://org/name/../../etc/passwd"] {
            assert!(matches!(HubAddress::parse(bad), Some(Err(_))), "{bad}");
        }
    }
}
