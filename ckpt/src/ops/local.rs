//! What the ranks of a running job hand to [`crate::save_sharded`]: the slices of tensors and
//! the values each holds in memory, named by their place in the state dict.

use crate::read::dtype::Dtype;
use crate::read::value::Leaf;

/// One element of a state-dict path: a dict key or a list index. The key of an entry is its
/// path joined with `.` (`model.embed.weight`, `optimizer.param_groups.0.lr`), as DCP
/// flattens it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyPart {
    /// A dict key.
    Key(String),
    /// A list index.
    Index(i64),
}

/// A rank's slice of a tensor: rows `dim0_offset..` of the row-major global tensor, as bytes.
/// A 0-d tensor is one value with `global_shape` empty and `dim0_offset` 0.
#[derive(Clone, Debug)]
pub struct LocalTensor<'a> {
    /// Where the tensor sits in the state dict.
    pub path: Vec<KeyPart>,
    /// Element type.
    pub dtype: Dtype,
    /// Shape of the whole tensor, across ranks.
    pub global_shape: Vec<u64>,
    /// First global row this rank holds.
    pub dim0_offset: u64,
    /// The rows, row-major, little-endian; their count is the byte length over a row's.
    pub bytes: &'a [u8],
}

/// A non-tensor entry (an optimizer's `param_groups` fields), pickled as Python values.
#[derive(Clone, Debug, PartialEq)]
pub enum LocalValue {
    /// `None`.
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int`.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `list`.
    List(Vec<LocalValue>),
}

impl LocalValue {
    /// The value as the torch writer pickles it.
    pub(crate) fn leaf(&self) -> Leaf {
        match self {
            LocalValue::None => Leaf::None,
            LocalValue::Bool(b) => Leaf::Bool(*b),
            LocalValue::Int(i) => Leaf::Int(*i),
            LocalValue::Float(f) => Leaf::Float(*f),
            LocalValue::Str(s) => Leaf::Str(s.clone()),
            LocalValue::List(l) => Leaf::List(l.iter().map(LocalValue::leaf).collect()),
        }
    }
}
