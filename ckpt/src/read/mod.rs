//! Opening a source: `hf://` resolution, then detection, then the format's reader, each once.

pub(crate) mod catalog;
pub(crate) mod checksum;
pub(crate) mod crc_pass;
pub(crate) mod dtype;
pub(crate) mod io;
pub(crate) mod shape;
pub(crate) mod value;

use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};
use crate::formats;
use crate::hub;
use crate::ops::misuse::{Misuse, Opt};
use crate::read::catalog::{Checkpoint, Format, Scan};
use crate::AllowGlobals;

/// How to open a checkpoint.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// DeepSpeed: the tag folder to read (default: the one named in `latest`).
    pub tag: Option<String>,
    /// Torch files: globals beyond torch's weights-only list to read as inert data (records
    /// of their name and state; numpy arrays as tensors). Nothing is imported or called.
    pub allow_globals: AllowGlobals,
    /// Megatron `torch_dist` checkpoints: the tensors under their stored keys and global shapes (stacked
    /// layers, TransformerEngine's norm names, the optimizer's tensors), instead of the model
    /// megatron holds on one rank.
    pub as_stored: bool,
    /// `hf://` sources: read the catalog alone, by range requests on the Hub, downloading
    /// nothing (what `inspect` and `verify --headers-only` need); the checkpoint's tensors
    /// cannot be read then. Otherwise the files a source consists of are downloaded into the
    /// Hugging Face cache unless they are there already.
    pub headers_only: bool,
    /// `hf://` sources: the branch, tag or commit to read (an `@REV` in the address must say
    /// the same); refused for a local path.
    pub revision: Option<String>,
    /// `hf://` downloads: called as bytes arrive, for one progress bar over the whole download.
    pub progress: Option<crate::hub::DownloadProgress>,
}

impl OpenOptions {
    /// Refuses options that do not apply to `format`.
    fn check(&self, format: Format, root: &Path) -> Result<()> {
        if self.tag.is_some() && format != Format::DeepSpeed {
            return Err(not_for_format(Opt::Tag, root, format));
        }
        if !self.allow_globals.is_empty() && !matches!(format, Format::Torch | Format::TorchSharded) {
            return Err(not_for_format(Opt::AllowGlobals, root, format));
        }
        if self.as_stored && format != Format::MegatronTorchDist {
            return Err(not_for_format(Opt::AsStored, root, format));
        }
        Ok(())
    }
}

/// The misuse of an open `option` that the source `root`, of `format`, does not take.
fn not_for_format(option: Opt, root: &Path, format: Format) -> Error {
    let misuse = Misuse::OptionNotForFormat { option, source: root.to_path_buf(), format };
    Error::Misuse { path: root.to_path_buf(), misuse }
}

impl Checkpoint {
    /// Opens a checkpoint: a `.safetensors` file, a sharded folder or its index, a torch file or
    /// set, a DCP folder, a DeepSpeed ZeRO folder, or an `hf://ORG/NAME[@REV][/PATH]` address
    /// found in the Hugging Face cache or downloaded into it (see [`OpenOptions::headers_only`]).
    pub fn open(src: &str) -> Result<Checkpoint> {
        Checkpoint::open_with(src, &OpenOptions::default())
    }

    /// [`Checkpoint::open`] with options.
    pub fn open_with(src: &str, options: &OpenOptions) -> Result<Checkpoint> {
        let scan = match locate(src, options)? {
            Source::Local(format, root) => scan(format, root, options)?,
            Source::Remote(scan) => {
                options.check(scan.checkpoint.format(), scan.checkpoint.root())?;
                *scan
            }
        };
        match scan.problems.into_iter().next() {
            Some(first) => Err(first),
            None => Ok(scan.checkpoint),
        }
    }
}

/// Where a source is, after `hf://` resolution.
#[derive(Debug)]
pub(crate) enum Source {
    /// A local file or folder, its format and root decided, not yet read.
    Local(Format, PathBuf),
    /// An `hf://` checkpoint read on the Hub by its headers ([`OpenOptions::headers_only`]).
    Remote(Box<Scan>),
}

/// Resolves `src` (downloading an `hf://` source's files unless only its headers are asked
/// for) and, for a local one, decides its format and root without reading it.
pub(crate) fn locate(src: &str, options: &OpenOptions) -> Result<Source> {
    let need = if options.headers_only { hub::Need::Headers } else { hub::Need::Bytes };
    match hub::locate(src, options.revision.as_deref(), need, options.progress.as_ref().map(|p| &*p.0))? {
        hub::Located::Path(path) => detect_path(&path).map(|(format, root)| Source::Local(format, root)),
        hub::Located::Remote(scan) => Ok(Source::Remote(scan)),
    }
}

fn detect_path(path: &Path) -> Result<(Format, PathBuf)> {
    let meta = std::fs::metadata(path).at(path)?;
    if !meta.is_file() && !meta.is_dir() {
        // A FIFO, socket or device: the one check that refuses it by name, before any open.
        crate::read::io::open(path)?;
    }
    for (format, detect) in formats::DETECTORS {
        if let Some(root) = detect(path)? {
            return Ok((*format, root));
        }
    }
    if meta.is_dir() {
        // Say what is there when it looks like a checkpoint but fits no layout.
        let (_, singles) = formats::safetensors::folder_files(path)?;
        if !singles.is_empty() {
            let found = singles.iter().take(4).filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned());
            return Err(Error::UnknownSafetensorsLayout {
                path: path.to_path_buf(),
                count: singles.len(),
                found: found.collect(),
            });
        }
    }
    Err(Error::NotACheckpoint { path: path.to_path_buf() })
}

/// Reads a detected checkpoint, collecting the problems `verify` reports.
pub(crate) fn scan(format: Format, root: PathBuf, options: &OpenOptions) -> Result<Scan> {
    options.check(format, &root)?;
    formats::catalog(format, root, options)
}
