//! What a format says about a checkpoint it read: the one description that `ckpt inspect`
//! prints, `--json` extends the inspect document with, and an operation's summary names its
//! source by, so that no edge formats a format itself.
//!
//! The catalog's own facts (format name, path, files, tensors, bytes) are the same for every
//! format and are not repeated here; a [`Description`] holds only what the format adds.

use serde_json::Value;

use crate::read::catalog::Checkpoint;

/// What a format says about one of its checkpoints, beyond the catalog.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Description {
    /// How the format names this source, as an operation's summary says what it read:
    /// `a ZeRO-2 checkpoint of 4 ranks`, `a Megatron torch_dist checkpoint (...)`.
    pub title: String,
    /// `label: value` facts, shown under the catalog's own (`megatron: torch_dist (...)`).
    pub facts: Vec<(&'static str, String)>,
    /// Blocks shown after the tensors (an accelerate folder's components), each a heading and
    /// its lines.
    pub sections: Vec<Section>,
    /// The fields the format adds to the inspect document (`statekit.inspect/2`), in order,
    /// after the ones every checkpoint has.
    pub json: Vec<(&'static str, Value)>,
}

/// A block of a [`Description`]: a heading line, then one line per item.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Section {
    /// The heading (`accelerate save_state, saved by 2 rank(s):`).
    pub heading: String,
    /// Its lines, unindented: the edge decides how to lay them out.
    pub lines: Vec<String>,
}

impl Section {
    pub(crate) fn new(heading: String, lines: Vec<String>) -> Section {
        Section { heading, lines }
    }
}

impl Description {
    /// A description that only names the source (`title`).
    pub(crate) fn titled(title: String) -> Description {
        Description { title, ..Description::default() }
    }

    /// The plain description of a checkpoint whose format adds nothing: its files counted.
    pub(crate) fn of_files(ck: &Checkpoint) -> Description {
        Description::titled(format!("{} file(s)", ck.files().len()))
    }
}
