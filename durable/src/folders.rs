//! The folders a new file needs, made in place and taken back when the file never lands.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::write::sync_dir;

/// The folders [`NewFolders::make`] created because they were missing, outermost first. Dropped
/// before [`NewFolders::keep`], it removes them again, innermost first and each only while empty,
/// so a failed write leaves the tree as it found it and never takes a file someone else put there.
#[derive(Debug, Default)]
pub struct NewFolders {
    made: Vec<PathBuf>,
}

impl NewFolders {
    /// Makes `dir` and every missing folder above it, each made durable in its parent (a file
    /// renamed into a folder whose own entry was lost in a crash would be lost with it).
    pub fn make(dir: &Path) -> Result<NewFolders> {
        let mut missing = Vec::new();
        let mut at = Some(dir);
        while let Some(p) = at.filter(|p| !p.as_os_str().is_empty()) {
            if std::fs::symlink_metadata(p).is_ok() {
                break;
            }
            missing.push(p.to_path_buf());
            at = p.parent();
        }
        let mut out = NewFolders::default();
        for p in missing.into_iter().rev() {
            match std::fs::create_dir(&p) {
                Ok(()) => out.made.push(p.clone()),
                // Made meanwhile by someone else: theirs, never removed by us.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io(&p, e)),
            }
            sync_dir(p.parent().unwrap_or(Path::new("")))?;
        }
        Ok(out)
    }

    /// The folders this made, outermost first.
    pub fn made(&self) -> &[PathBuf] {
        &self.made
    }

    /// Keeps the folders: what they were made for is in place.
    pub fn keep(mut self) {
        self.made.clear();
    }
}

impl Drop for NewFolders {
    fn drop(&mut self) {
        for p in self.made.iter().rev() {
            let _ = std::fs::remove_dir(p);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn missing_folders_are_made_and_taken_back_unless_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let deep = tmp.path().join("a/b/c");
        let made = NewFolders::make(&deep).unwrap();
        assert_eq!(made.made(), [tmp.path().join("a"), tmp.path().join("a/b"), deep.clone()]);
        drop(made);
        assert!(!tmp.path().join("a").exists(), "nothing left after a failed write");

        NewFolders::make(&deep).unwrap().keep();
        assert!(deep.is_dir());
        assert!(NewFolders::make(&deep).unwrap().made().is_empty(), "existing folders are not ours");
    }

    #[test]
    fn a_folder_that_holds_something_is_not_taken_back() {
        let tmp = tempfile::tempdir().unwrap();
        let made = NewFolders::make(&tmp.path().join("a/b")).unwrap();
        std::fs::write(tmp.path().join("a/theirs"), b"x").unwrap();
        drop(made);
        assert!(!tmp.path().join("a/b").exists());
        assert_eq!(std::fs::read(tmp.path().join("a/theirs")).unwrap(), b"x");
    }
}
