//! numpy arrays and scalars inside a pickle, decoded as data (never by importing numpy).
//!
//! numpy pickles an `ndarray` (protocols 2 to 4) as `_reconstruct(ndarray, (0,), b"b")` from
//! `numpy.core.multiarray` (`numpy._core.multiarray` since numpy 2), then `BUILD` with the
//! state `(1, shape, dtype, is_fortran, raw bytes)`: the bytes are the elements in C order, or
//! in Fortran order when `is_fortran` is true. The dtype is `numpy.dtype(descr, False, True)`
//! (`"f4"`, `"i8"`, `"b1"`, `"c16"`, …) with its own `BUILD` state `(3, byte order, subarray,
//! names, fields, elsize, alignment, flags)`, the byte order `<`, `>`, `|` (not applicable) or
//! `=`. A scalar (`numpy.float32(1.5)`) is `scalar(dtype, raw bytes)` from the same module.
//!
//! The unpickler keeps all of these as inert records when the user allows their globals; here
//! an array of a numeric dtype becomes a tensor (its bytes copied out of the pickle, big-endian
//! elements swapped to little-endian, Fortran order kept as column-major strides) and a
//! numeric scalar a plain value. Arrays of other dtypes (strings, objects, records, dates) and
//! `ndarray` subclasses stay records, kept as values like any other allowed object.

use super::pickle::{Obj, Pickle, V};
use crate::read::dtype::Dtype;
use crate::read::value::Leaf;

const RECONSTRUCT: [&str; 2] = ["numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct"];
const SCALAR: [&str; 2] = ["numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar"];

/// A decoded array: little-endian bytes, with the strides of its element order.
#[derive(Debug)]
pub(crate) struct Array {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub strides: Vec<u64>,
    pub bytes: Vec<u8>,
}

/// A numeric dtype record: the dtype and whether its elements are big-endian.
fn dtype(p: &Pickle, v: V) -> Option<(Dtype, bool)> {
    let Some(Obj::Instance { class, args, state: Some(state), .. }) = p.obj(v) else { return None };
    if &**class != "numpy.dtype" {
        return None;
    }
    let descr = match args.first().and_then(|&a| p.obj(a)) {
        Some(Obj::Str(s)) => s.as_str(),
        _ => return None,
    };
    let d = match descr {
        "b1" => Dtype::Bool,
        "i1" => Dtype::I8,
        "i2" => Dtype::I16,
        "i4" => Dtype::I32,
        "i8" => Dtype::I64,
        "u1" => Dtype::U8,
        "u2" => Dtype::U16,
        "u4" => Dtype::U32,
        "u8" => Dtype::U64,
        "f2" => Dtype::F16,
        "f4" => Dtype::F32,
        "f8" => Dtype::F64,
        "c8" => Dtype::C64,
        "c16" => Dtype::C128,
        _ => return None,
    };
    let Some(Obj::Tuple(st)) = p.obj(*state) else { return None };
    let order = match st.get(1).and_then(|&o| p.obj(o)) {
        Some(Obj::Str(o)) => o.as_str(),
        _ => return None,
    };
    // No subarray, no fields: a plain element type.
    if st.len() < 8 || st.get(2..5).is_none_or(|s| s.iter().any(|&x| x != V::None)) {
        return None;
    }
    match order {
        "<" | "|" | "=" => Some((d, false)),
        ">" => Some((d, true)),
        _ => None,
    }
}

fn bytes_of(p: &Pickle, v: V) -> Option<&[u8]> {
    match p.obj(v) {
        Some(Obj::Bytes(b)) => Some(b),
        // Protocol 2 writes an empty `bytes` as `bytes()`.
        Some(Obj::Instance { class, args, state: None, items: None })
            if &**class == "builtins.bytes" && args.is_empty() =>
        {
            Some(&[])
        }
        _ => None,
    }
}

/// True when `v` is a numpy array of a numeric dtype (what [`array`] decodes or refuses).
pub(crate) fn is_array(p: &Pickle, v: V) -> bool {
    parts(p, v).is_some()
}

/// What an array record holds: its shape tuple, dtype (and whether big-endian), whether its
/// elements are in Fortran order, and their bytes.
struct Parts<'a> {
    shape: V,
    dtype: (Dtype, bool),
    fortran: bool,
    bytes: &'a [u8],
}

fn parts(p: &Pickle, v: V) -> Option<Parts<'_>> {
    let Some(Obj::Instance { class, args, state: Some(state), items: None }) = p.obj(v) else { return None };
    if !RECONSTRUCT.contains(&&**class) {
        return None;
    }
    // Only `ndarray` itself: a subclass (`matrix`, a masked array) has state of its own.
    match args.first().and_then(|&a| p.obj(a)) {
        Some(Obj::Global(super::pickle::Global::Class(c))) if p.class_name(*c) == "numpy.ndarray" => {}
        _ => return None,
    }
    let Some(Obj::Tuple(st)) = p.obj(*state) else { return None };
    let [V::Int(1), shape, dt, fortran, data] = st.as_slice() else { return None };
    let fortran = match fortran {
        V::Bool(b) => *b,
        V::Int(i) => *i != 0,
        _ => return None,
    };
    Some(Parts { shape: *shape, dtype: dtype(p, *dt)?, fortran, bytes: bytes_of(p, *data)? })
}

/// The array `v` is, when it is one; the error (a reason) when its bytes do not fit its shape.
pub(crate) fn array(p: &Pickle, v: V) -> Result<Option<Array>, String> {
    let Some(Parts { shape, dtype: (dtype, big), fortran, bytes }) = parts(p, v) else { return Ok(None) };
    let Some(Obj::Tuple(dims)) = p.obj(shape) else { return Err("a numpy array's shape is not a tuple".into()) };
    let mut shape = Vec::with_capacity(dims.len());
    for d in dims {
        match d {
            V::Int(n) if *n >= 0 => shape.push(*n as u64),
            _ => return Err("a numpy array's shape holds a negative or non-integer size".into()),
        }
    }
    let elem = dtype.bits() / 8;
    let need = crate::read::shape::numel(&shape).and_then(|n| n.checked_mul(elem));
    if need != Some(bytes.len() as u64) {
        return Err(format!(
            "a numpy array of shape {shape:?} and dtype `{}` needs {} bytes, its pickle holds {}",
            dtype.safetensors_name(),
            need.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string()),
            bytes.len()
        ));
    }
    p.charge(bytes.len() + std::mem::size_of::<Array>() + 16 * shape.len())?;
    let mut bytes = bytes.to_vec();
    if big {
        // Complex numbers swap each of their two parts.
        let unit = if matches!(dtype, Dtype::C64 | Dtype::C128) { elem / 2 } else { elem } as usize;
        if unit > 1 {
            bytes.chunks_exact_mut(unit).for_each(<[u8]>::reverse);
        }
    }
    let strides = if fortran {
        let mut s = Vec::with_capacity(shape.len());
        let mut acc = 1u64;
        for &n in &shape {
            s.push(acc);
            acc = acc.saturating_mul(n.max(1));
        }
        s
    } else {
        crate::read::shape::contiguous_strides(&shape).unwrap_or_else(|| vec![0; shape.len()])
    };
    Ok(Some(Array { dtype, shape, strides, bytes }))
}

/// A numeric numpy scalar as a value; `None` for anything else.
pub(crate) fn scalar(p: &Pickle, v: V) -> Option<Leaf> {
    let Some(Obj::Instance { class, args, state: None, .. }) = p.obj(v) else { return None };
    if !SCALAR.contains(&&**class) {
        return None;
    }
    let [dt, data] = args.as_slice() else { return None };
    let (d, big) = dtype(p, *dt)?;
    let raw = bytes_of(p, *data)?;
    if raw.len() as u64 != d.bits() / 8 {
        return None;
    }
    let mut b = raw.to_vec();
    let part = if matches!(d, Dtype::C64 | Dtype::C128) { b.len() / 2 } else { b.len() };
    if big && part > 1 {
        b.chunks_exact_mut(part).for_each(<[u8]>::reverse);
    }
    let arr = |n: usize, at: usize| -> Option<[u8; 8]> {
        let mut out = [0u8; 8];
        out.get_mut(..n)?.copy_from_slice(b.get(at..at + n)?);
        Some(out)
    };
    let float = |n: usize, at: usize| -> Option<f64> {
        let x = arr(n, at)?;
        Some(match n {
            2 => {
                let mut wide = Vec::with_capacity(4);
                crate::map::cast::cast_into(&x[..2], Dtype::F16, Dtype::F32, &mut wide);
                f64::from(f32::from_le_bytes(<[u8; 4]>::try_from(wide.as_slice()).ok()?))
            }
            4 => f64::from(f32::from_le_bytes([x[0], x[1], x[2], x[3]])),
            _ => f64::from_le_bytes(x),
        })
    };
    let signed = |n: usize| -> Option<i64> {
        let x = arr(n, 0)?;
        let fill = if x.get(n - 1).is_some_and(|b| b & 0x80 != 0) { 0xff } else { 0 };
        let mut y = [fill; 8];
        y.get_mut(..n)?.copy_from_slice(x.get(..n)?);
        Some(i64::from_le_bytes(y))
    };
    Some(match d {
        Dtype::Bool => Leaf::Bool(b.first().is_some_and(|&x| x != 0)),
        Dtype::I8 | Dtype::I16 | Dtype::I32 | Dtype::I64 => Leaf::Int(signed(b.len())?),
        Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64 => {
            Leaf::Int(i64::try_from(u64::from_le_bytes(arr(b.len(), 0)?)).ok()?)
        }
        Dtype::F16 | Dtype::F32 | Dtype::F64 => Leaf::Float(float(b.len(), 0)?),
        Dtype::C64 | Dtype::C128 => {
            let n = b.len() / 2;
            Leaf::Dict(vec![("real".into(), Leaf::Float(float(n, 0)?)), ("imag".into(), Leaf::Float(float(n, n)?))])
        }
        _ => return None,
    })
}
