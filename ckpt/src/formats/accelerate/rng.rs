//! The non-model files of an `accelerator.save_state` folder, read as data.
//!
//! `random_states_{rank}.pkl` is a `torch.save` zip of a dict: `step` (accelerate's
//! gradient-accumulation micro-step counter), `random_state` (Python's `random.getstate()`),
//! `numpy_random_seed` (`np.random.get_state()`: `("MT19937", key, pos, has_gauss,
//! cached_gaussian)`, the key a numpy array), `torch_manual_seed` (`torch.get_rng_state()`, a
//! byte tensor) and, where present, `torch_cuda_manual_seed`, `torch_xpu_manual_seed`, ...
//! (one byte tensor per device).
//!
//! transformers' `Trainer` writes `rng_state.pth` (one process) or `rng_state_{rank}.pth`: a dict
//! of `python` (`random.getstate()`), `numpy` (`np.random.get_state()`, as above), `cpu`
//! (`torch.random.get_rng_state()`) and, on accelerators, `cuda` (or `npu`, `xla`, ...): the same
//! states under other keys, read the same way ([`Keys::TRAINER`]).
//!
//! The numpy array is pickled as `numpy._core.multiarray._reconstruct(numpy.ndarray, (0,),
//! b"b")` followed by `BUILD` with `(1, shape, dtype, is_fortran, raw bytes)`, its dtype as
//! `numpy.dtype("u4", False, True)` with its own `BUILD` state. Those three names are the file's
//! allow-list: the unpickler keeps them as inert instances (class, arguments, state) and this
//! module decodes the array from them; numpy is never imported or called, and nothing else is
//! admitted.

use std::path::Path;

use crate::error::{Error, Result};
use std::rc::Rc;

use crate::formats::torch;
use crate::formats::torch::pickle::{Budget, Limits};
use crate::read::value::Leaf;

/// The classes a `random_states_N.pkl` may name besides torch's weights-only globals: numpy's
/// array reconstruction (numpy 2 and numpy 1 module names), the array type and its dtype.
const RNG_CLASSES: &[&str] =
    &["numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype"];

/// Where a file kind keeps each generator: accelerate's `random_states_N.pkl` or the `Trainer`'s
/// `rng_state_N.pth`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Keys {
    /// The micro-step counter (accelerate only).
    step: Option<&'static str>,
    /// `np.random.get_state()`.
    numpy: &'static str,
    /// `torch.get_rng_state()`.
    torch: &'static str,
}

impl Keys {
    pub(crate) const ACCELERATE: Keys =
        Keys { step: Some("step"), numpy: "numpy_random_seed", torch: "torch_manual_seed" };
    pub(crate) const TRAINER: Keys = Keys { step: None, numpy: "numpy", torch: "cpu" };
}

/// What one rank's RNG file holds.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RngState {
    /// accelerate's `step`: `accumulate()` calls since the last end of a dataloader, not
    /// optimizer steps (the `Trainer`'s files have none).
    pub step: Option<i64>,
    /// The generators saved, by key, in file order (`random_state`, `numpy_random_seed`,
    /// `torch_manual_seed`, `torch_cuda_manual_seed`, ...; the `Trainer`'s `python`, `numpy`,
    /// `cpu`, `cuda`).
    pub generators: Vec<String>,
    /// numpy's legacy generator state, decoded from its array.
    pub numpy: Option<NumpyRng>,
    /// Length in bytes of `torch.get_rng_state()` (5056 for the CPU generator).
    pub torch_state_len: Option<u64>,
}

/// `np.random.get_state()`: the Mersenne Twister key and position.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NumpyRng {
    /// The bit generator (`MT19937`).
    pub kind: String,
    /// The 624 words of the key.
    pub key: Vec<u32>,
    /// The position in the key.
    pub pos: i64,
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::BadTorchFile { path: path.to_path_buf(), reason: reason.into() }
}

/// Reads one rank's RNG file as data. A global outside torch's weights-only list and numpy's
/// array reconstruction is refused by name before anything is built.
pub fn read_rng_state(path: &Path) -> Result<RngState> {
    let trainer = path.extension().is_some_and(|e| e == "pth");
    read_sharing(path, if trainer { Keys::TRAINER } else { Keys::ACCELERATE }, &Budget::shared(Limits::default()))
}

/// [`read_rng_state`] for a file that keeps its generators under `keys`, charging `budget`,
/// which the other value files of the folder share.
pub(crate) fn read_sharing(path: &Path, keys: Keys, budget: &Rc<Budget>) -> Result<RngState> {
    let f = torch::read_with_classes_sharing(path, RNG_CLASSES, budget)?;
    let mut out = RngState { step: None, generators: Vec::new(), numpy: None, torch_state_len: None };
    for (key, leaf) in &f.leaves {
        let top = key.split('.').next().unwrap_or(key);
        if Some(key.as_str()) == keys.step {
            out.step = match leaf {
                Leaf::Int(i) => Some(*i),
                _ => return Err(bad(path, format!("`{key}` is not an integer"))),
            };
        } else if !out.generators.iter().any(|g| g == top) {
            out.generators.push(top.to_string());
        }
        if key == keys.numpy {
            out.numpy = Some(numpy_state(leaf).map_err(|r| bad(path, format!("`{key}`: {r}")))?);
        }
    }
    for t in &f.tensors {
        if !out.generators.contains(&t.name) {
            out.generators.push(t.name.clone());
        }
        if t.name == keys.torch {
            out.torch_state_len = Some(crate::read::shape::numel(&t.shape).unwrap_or(0));
        }
    }
    Ok(out)
}

fn field<'a>(d: &'a [(String, Leaf)], name: &str) -> Option<&'a Leaf> {
    d.iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

/// `("MT19937", _reconstruct(...) with its BUILD state, pos, has_gauss, cached_gaussian)`.
fn numpy_state(leaf: &Leaf) -> std::result::Result<NumpyRng, String> {
    let Leaf::List(items) = leaf else { return Err("not a tuple".into()) };
    let (Some(Leaf::Str(kind)), Some(Leaf::Dict(arr)), Some(Leaf::Int(pos))) =
        (items.first(), items.get(1), items.get(2))
    else {
        return Err("not `(name, key array, pos, ...)`".into());
    };
    match field(arr, "__class__") {
        Some(Leaf::Str(c)) if c.ends_with("multiarray._reconstruct") => {}
        _ => return Err("the key is not a numpy array".into()),
    }
    // BUILD state of an ndarray: (version, shape, dtype, is_fortran, raw bytes).
    let Some(Leaf::List(state)) = field(arr, "state") else { return Err("the array has no state".into()) };
    let (Some(Leaf::List(shape)), Some(Leaf::Dict(dtype)), Some(Leaf::Bytes(raw))) =
        (state.get(1), state.get(2), state.get(4))
    else {
        return Err("the array state is not `(version, shape, dtype, fortran, bytes)`".into());
    };
    let Some(Leaf::List(dargs)) = field(dtype, "args") else { return Err("the dtype has no arguments".into()) };
    // The dtype's BUILD state: (version, byte order, ...); `|` or `<` is little-endian here.
    let order = match field(dtype, "state") {
        Some(Leaf::List(s)) => match s.get(1) {
            Some(Leaf::Str(o)) => o.clone(),
            _ => "=".into(),
        },
        _ => "=".into(),
    };
    if !matches!(dargs.first(), Some(Leaf::Str(t)) if t == "u4") || order == ">" {
        return Err(format!("the key is not a little-endian `u4` array ({dargs:?}, order {order})"));
    }
    let n = match shape.as_slice() {
        [Leaf::Int(n)] if *n >= 0 => *n as usize,
        _ => return Err("the key is not one-dimensional".into()),
    };
    if raw.len() != n * 4 {
        return Err(format!("the key has {} bytes, not {}", raw.len(), n * 4));
    }
    let key = raw.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    Ok(NumpyRng { kind: kind.clone(), key, pos: *pos })
}
