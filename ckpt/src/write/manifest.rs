//! Checksum manifests: a `SHA256SUMS` file in the format `sha256sum` writes and `sha256sum -c`
//! checks, one `<64 hex digits>  <file name>` line per file (`*` instead of the second space
//! marks binary mode and is accepted too).

use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::{Error, IoContext, ManifestProblem, Result};

pub(crate) const MANIFEST_NAME: &str = "SHA256SUMS";
/// The largest manifest we read (a million files' lines).
pub(crate) const MAX_MANIFEST_LEN: u64 = 128 << 20;

/// The SHA-256 of a file as lowercase hex, read in fixed-size blocks.
pub(crate) fn sha256_file(path: &Path) -> Result<String> {
    let mut f = crate::read::io::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).at(path)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `dir`'s manifest of `files` (each in `dir`), hashing them as they are on disk now:
/// for an operation that wrote them in separate plans, whose own manifests would each list
/// only their plan's files.
pub(crate) fn write_for(dir: &Path, files: &[std::path::PathBuf]) -> Result<()> {
    let entries =
        files.iter().map(|f| Ok((crate::write::file_name(f), sha256_file(f)?))).collect::<Result<Vec<_>>>()?;
    crate::write::write_atomic(&dir.join(MANIFEST_NAME), render(&entries).as_bytes(), &crate::write::Plan::default())
}

/// Renders entries `(file name, hex digest)` sorted by name.
pub(crate) fn render(entries: &[(String, String)]) -> String {
    let mut sorted: Vec<&(String, String)> = entries.iter().collect();
    sorted.sort();
    sorted.iter().map(|(name, sum)| format!("{sum}  {name}\n")).collect()
}

/// Parses a manifest into `(file name, hex digest)` pairs.
pub(crate) fn parse(text: &str, path: &Path) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |problem| Error::BadManifest { path: path.to_path_buf(), line: i + 1, problem };
        let (sum, rest) = line.split_at_checked(64).ok_or_else(|| bad(ManifestProblem::Shape))?;
        if !sum.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(ManifestProblem::NotHex));
        }
        let name = rest
            .strip_prefix("  ")
            .or_else(|| rest.strip_prefix(" *"))
            .ok_or_else(|| bad(ManifestProblem::Separator))?;
        if !crate::read::io::is_plain_file_name(name) {
            return Err(bad(ManifestProblem::NotPlainName));
        }
        out.push((name.to_string(), sum.to_ascii_lowercase()));
    }
    Ok(out)
}
