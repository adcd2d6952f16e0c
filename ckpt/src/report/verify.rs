//! Verification: everything a reader would trip on, reported at once.
//!
//! Checks each file's header (size, JSON, dtypes, offsets with no gap, overlap or trailing
//! bytes), the index against the shards (every `weight_map` entry present in the named shard,
//! no tensor unlisted or held by two shards), and the `SHA256SUMS` manifest where there is one.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::read::catalog::Format;
use crate::read::{locate, scan, Source};
use crate::write::manifest;
use crate::OpenOptions;

/// The result of [`verify`]. Valid when `problems` is empty.
#[derive(Debug)]
pub struct Report {
    /// What was checked, after `hf://` resolution and detection.
    pub path: PathBuf,
    /// Its format, when detection could tell.
    pub format: Option<Format>,
    /// Source files read.
    pub files: usize,
    /// Tensors catalogued.
    pub tensors: usize,
    /// Everything an operation would refuse, each naming its file.
    pub problems: Vec<Error>,
    /// Things worth knowing that do not make the checkpoint invalid.
    pub warnings: Vec<String>,
    /// Files whose checksum matched the manifest.
    pub checksums_ok: usize,
}

impl Report {
    /// True when there is no problem.
    pub fn is_valid(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Verifies the checkpoint at `src`. `Err` only for errors that stop verification from
/// starting (no such path, not a checkpoint, I/O failure); every defect of the checkpoint
/// itself is a problem in the report.
pub fn verify(src: &str) -> Result<Report> {
    verify_with(src, &OpenOptions::default())
}

/// [`verify`] with options (a DeepSpeed tag, globals a torch file may name).
pub fn verify_with(src: &str, options: &OpenOptions) -> Result<Report> {
    let mut report = Report {
        path: PathBuf::from(src),
        format: None,
        files: 0,
        tensors: 0,
        problems: Vec::new(),
        warnings: Vec::new(),
        checksums_ok: 0,
    };
    // Detection alone tells the format even when the file itself turns out to be defective.
    let scanned = match locate(src, options)? {
        Source::Local(format, root) => {
            report.format = Some(format);
            report.path = root.clone();
            match scan(format, root, options) {
                Ok(s) => s,
                Err(e) if e.is_invalid_data() => {
                    report.problems.push(e);
                    return Ok(report);
                }
                Err(e) => return Err(e),
            }
        }
        Source::Remote(scanned) => {
            report.format = Some(scanned.checkpoint.format());
            report.path = scanned.checkpoint.root().to_path_buf();
            *scanned
        }
    };
    let ck = scanned.checkpoint;
    report.files = ck.files().len();
    report.tensors = ck.tensors().len();
    report.problems = scanned.problems;
    if let Err(e) = ck.file_metadata() {
        report.problems.push(e);
    }
    // Every stored byte a zip record vouches for is read once against its CRC32.
    // With `headers_only`, nothing past the headers is read: no CRC32, no checksum manifest.
    if !options.headers_only {
        report.problems.extend(crate::read::io::Sources::of(ck.files())?.check_all()?);
    }
    if let Some(declared) = ck.index_metadata().and_then(|m| m.get("total_size")).and_then(serde_json::Value::as_u64) {
        let actual = ck.total_bytes();
        if declared != actual {
            report.warnings.push(format!(
                "index `total_size` is {declared} but the tensors hold {actual} bytes (huggingface_hub counts shared storages once; older tools counted differently)"
            ));
        }
    }
    if let Some(state) = ck.save_state() {
        // A data position that cannot be read makes the resume fail: a problem, not a warning.
        report.problems.extend(state.unreadable_positions(None));
        for c in state.schedulers.iter().chain(&state.scaler).chain(&state.custom) {
            if let Some(global) = &c.refused {
                report.warnings.push(format!(
                    "{}: its pickle names `{}`, outside what this kind of file may hold; its values are not read",
                    c.path.display(),
                    crate::escape_controls(global)
                ));
            }
        }
    }
    for t in ck.tensors() {
        if let Some((output, storage)) = t.expansion() {
            report.warnings.push(format!(
                "tensor `{}` is a broadcast view: writing it takes {output} bytes from a {storage}-byte storage, \
                 which split, merge and convert refuse without `allow_expanded`",
                crate::escape_controls(&t.name)
            ));
        }
    }
    // The manifest sits beside the file or the index, or in the folder a checkpoint opened as a
    // folder is (a DCP folder's, where the writer puts it beside the rank files).
    let manifest_path = match ck.root().is_dir() {
        true => Some(ck.root().join(manifest::MANIFEST_NAME)),
        false => ck.root().parent().map(|d| d.join(manifest::MANIFEST_NAME)),
    };
    if let Some(mp) = manifest_path.filter(|p| p.is_file() && !options.headers_only) {
        let names: Vec<String> =
            ck.files().iter().filter_map(|f| f.path.file_name().map(|n| n.to_string_lossy().into_owned())).collect();
        check_manifest(&mp, &names, &mut report)?;
    }
    Ok(report)
}

/// Checks the manifest's entries for the checkpoint's files. Entries for other files in the
/// folder are not ours to judge.
fn check_manifest(path: &Path, ours: &[String], report: &mut Report) -> Result<()> {
    let bytes = crate::read::io::read_capped(path, manifest::MAX_MANIFEST_LEN)?;
    let text = String::from_utf8_lossy(&bytes);
    let entries = match manifest::parse(&text, path) {
        Ok(e) => e,
        Err(e) => {
            report.problems.push(e);
            return Ok(());
        }
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    for (name, expected) in entries.iter().filter(|(n, _)| ours.contains(n)) {
        let found = manifest::sha256_file(&dir.join(name))?;
        if &found == expected {
            report.checksums_ok += 1;
        } else {
            report.problems.push(Error::ChecksumMismatch {
                path: path.to_path_buf(),
                file: name.clone(),
                expected: expected.clone(),
                found,
            });
        }
    }
    Ok(())
}
