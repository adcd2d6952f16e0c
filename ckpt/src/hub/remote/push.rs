//! `ckpt push`: one commit through the Hub's commit API. The files the branch already has with
//! the same bytes are skipped (the preupload answer and the LFS batch say which); small files go
//! inline (base64) in the NDJSON commit, large ones are uploaded through the LFS batch API
//! first and named in the commit by their SHA-256.

use std::fs::File;
use std::path::PathBuf;

use serde::Deserialize;

use super::{git_blob_id, parallel, read_capped, Hub, MAX_JSON};
use crate::error::{Error, IoContext, Result};

/// A file of a folder to push: its path in the repository, where it is, its size and SHA-256.
#[derive(Clone, Debug)]
pub(crate) struct Upload {
    pub path: String,
    pub local: PathBuf,
    pub size: u64,
    pub sha256: String,
}

/// What [`Hub::push`] did.
#[derive(Clone, Debug)]
pub(crate) struct Pushed {
    /// The new commit, `None` when every file was on the Hub already (no commit is made).
    pub commit: Option<String>,
    /// Its URL, as the Hub gives it.
    pub url: Option<String>,
    pub uploaded: Vec<String>,
    pub skipped: Vec<String>,
}

#[derive(Deserialize)]
struct Preupload {
    files: Vec<PreuploadFile>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PreuploadFile {
    path: String,
    upload_mode: String,
    #[serde(default)]
    oid: Option<String>,
    #[serde(default)]
    should_ignore: bool,
}

#[derive(Deserialize)]
struct Batch {
    objects: Vec<BatchObject>,
}

#[derive(Deserialize)]
struct BatchObject {
    oid: String,
    #[serde(default)]
    actions: Option<BatchActions>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct BatchActions {
    upload: Option<BatchAction>,
}

#[derive(Deserialize)]
struct BatchAction {
    href: String,
    #[serde(default)]
    header: std::collections::BTreeMap<String, String>,
}

impl Hub {
    /// A JSON request to the Hub's API with the token, its answer parsed.
    fn api_json<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        content_type: &str,
        body: &[u8],
        repo: &str,
        revision: &str,
        what: &str,
    ) -> Result<T> {
        let request = self.authorized(self.agent.post(url)).set("Content-Type", content_type);
        let response =
            request.send_bytes(body).map_err(|e| self.failed_as(e, url, repo, revision, Some(what), true))?;
        let text = read_capped(response, MAX_JSON, url)?;
        serde_json::from_slice(&text).map_err(|e| Error::HubRequest {
            url: url.into(),
            reason: format!("the answer is not the Hub's JSON: {e}"),
        })
    }

    /// Pushes `files` to `revision` of `repo` as one commit, through the Hub's commit API, as
    /// huggingface_hub's `upload_folder` does: `preupload` says which files go by LFS and what
    /// the revision holds (a file with the same SHA-256, or git blob id, is skipped); LFS
    /// files are uploaded by the `basic` transfer the batch endpoint hands out (an object the
    /// Hub holds already gets no upload action); the commit carries regular files inline
    /// (base64) and names the LFS ones by SHA-256. A repository that does not exist is created.
    pub(crate) fn push(&self, repo: &str, revision: &str, files: &[Upload], message: &str) -> Result<Pushed> {
        let rev = revision.replace('/', "%2F");
        let preupload_url = format!("{}/api/models/{repo}/preupload/{rev}", self.endpoint);
        let ask = serde_json::json!({ "files": files.iter().map(|f| {
            let sample = std::fs::read(&f.local).map(|b| b.into_iter().take(512).collect::<Vec<u8>>()).unwrap_or_default();
            serde_json::json!({ "path": f.path, "size": f.size, "sample": base64_encode(&sample) })
        }).collect::<Vec<_>>() });
        let body = ask.to_string().into_bytes();
        let modes: Preupload =
            match self.api_json(&preupload_url, "application/json", &body, repo, revision, "the upload") {
                Err(Error::HubNotFound { file: None, .. }) if revision == "main" => {
                    self.create_repo(repo)?;
                    self.api_json(&preupload_url, "application/json", &body, repo, revision, "the upload")?
                }
                other => other?,
            };
        let mut lfs = Vec::new();
        let mut regular = Vec::new();
        let mut skipped = Vec::new();
        for f in files {
            let Some(mode) = modes.files.iter().find(|m| m.path == f.path) else {
                return Err(Error::HubRequest {
                    url: preupload_url,
                    reason: format!("the answer says nothing of `{}`", f.path),
                });
            };
            let is_lfs = mode.upload_mode == "lfs";
            let ours = if is_lfs {
                f.sha256.clone()
            } else {
                git_blob_id(&mut File::open(&f.local).at(&f.local)?, f.size).at(&f.local)?
            };
            if mode.should_ignore || mode.oid.as_deref() == Some(ours.as_str()) {
                skipped.push(f.path.clone());
            } else if is_lfs {
                lfs.push(f);
            } else {
                regular.push(f);
            }
        }
        if lfs.is_empty() && regular.is_empty() {
            return Ok(Pushed { commit: None, url: None, uploaded: Vec::new(), skipped });
        }
        self.upload_lfs(repo, revision, &lfs)?;
        let mut ndjson =
            serde_json::json!({ "key": "header", "value": { "summary": message, "description": "" } }).to_string();
        for f in &regular {
            let bytes = std::fs::read(&f.local).at(&f.local)?;
            let line = serde_json::json!({ "key": "file", "value": { "content": base64_encode(&bytes), "path": f.path, "encoding": "base64" } });
            ndjson.push('\n');
            ndjson.push_str(&line.to_string());
        }
        for f in &lfs {
            let line = serde_json::json!({ "key": "lfsFile", "value": { "path": f.path, "algo": "sha256", "oid": f.sha256, "size": f.size } });
            ndjson.push('\n');
            ndjson.push_str(&line.to_string());
        }
        let commit_url = format!("{}/api/models/{repo}/commit/{rev}", self.endpoint);
        let done: serde_json::Value =
            self.api_json(&commit_url, "application/x-ndjson", ndjson.as_bytes(), repo, revision, "the commit")?;
        let commit = done.get("commitOid").and_then(|c| c.as_str()).map(str::to_string);
        let url = done.get("commitUrl").and_then(|c| c.as_str()).map(str::to_string);
        let uploaded = regular.iter().chain(&lfs).map(|f| f.path.clone()).collect();
        Ok(Pushed { commit, url, uploaded, skipped })
    }

    /// The LFS objects the Hub lacks, each by the `basic` transfer's `PUT` to its action's URL.
    fn upload_lfs(&self, repo: &str, revision: &str, files: &[&Upload]) -> Result<()> {
        if files.is_empty() {
            return Ok(());
        }
        let url = format!("{}/{repo}.git/info/lfs/objects/batch", self.endpoint);
        let ask = serde_json::json!({
            "operation": "upload",
            "transfers": ["basic"],
            "objects": files.iter().map(|f| serde_json::json!({ "oid": f.sha256, "size": f.size })).collect::<Vec<_>>(),
            "hash_algo": "sha256",
        });
        let request = self
            .authorized(self.agent.post(&url))
            .set("Accept", "application/vnd.git-lfs+json")
            .set("Content-Type", "application/vnd.git-lfs+json");
        let response = request
            .send_bytes(ask.to_string().as_bytes())
            .map_err(|e| self.failed_as(e, &url, repo, revision, Some("the LFS upload"), true))?;
        let batch: Batch = serde_json::from_slice(&read_capped(response, MAX_JSON, &url)?).map_err(|e| {
            Error::HubRequest { url: url.clone(), reason: format!("the answer is not the LFS batch JSON: {e}") }
        })?;
        let uploads: Vec<(&Upload, BatchAction)> = batch
            .objects
            .into_iter()
            .filter_map(|o| {
                if let Some(e) = &o.error {
                    return Some(Err(Error::HubRequest { url: url.clone(), reason: format!("object {}: {e}", o.oid) }));
                }
                let action = o.actions.and_then(|a| a.upload)?;
                let file = files.iter().find(|f| f.sha256 == o.oid)?;
                Some(Ok((*file, action)))
            })
            .collect::<Result<_>>()?;
        let done = parallel(&uploads, |(f, action)| {
            // The action's URL is signed: it carries its own headers, never our token.
            let mut put = self.agent.put(&action.href);
            for (k, v) in &action.header {
                put = put.set(k, v);
            }
            let body = File::open(&f.local).at(&f.local)?;
            put.set("Content-Length", &f.size.to_string())
                .send(body)
                .map(|_| ())
                .map_err(|e| self.failed_as(e, &action.href, repo, revision, Some(&f.path), true))
        });
        done.into_iter().collect::<Result<Vec<()>>>().map(|_| ())
    }

    /// Creates the model repository `repo` (`POST /api/repos/create`).
    fn create_repo(&self, repo: &str) -> Result<()> {
        let (org, name) = repo.split_once('/').unwrap_or(("", repo));
        let url = format!("{}/api/repos/create", self.endpoint);
        let body = serde_json::json!({ "name": name, "organization": org, "type": "model" }).to_string();
        let _: serde_json::Value =
            self.api_json(&url, "application/json", body.as_bytes(), repo, "main", "creating the repository")?;
        Ok(())
    }
}

fn base64_encode(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}
