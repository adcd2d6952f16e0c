//! Non-tensor values of a checkpoint (a torch file's `step`, an optimizer's `param_groups`):
//! the plain data a restricted unpickler can give back, and nothing that could run.
//!
//! As JSON (`inspect --json` `values`, the `__metadata__` of a converted file) a byte string
//! stays one string: `{"__bytes__": "<base64>"}`, standard alphabet with `=` padding (RFC 4648
//! §4): 4 bytes of text per 3 bytes, where an array of numbers would take up to 4 bytes of text
//! and some 70 bytes of memory (one `serde_json::Value` each) per byte.

/// The key of the one-entry object that stands for a byte string in JSON.
pub(crate) const BYTES_KEY: &str = "__bytes__";

/// A non-tensor value.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Leaf {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Leaf>),
    Dict(Vec<(String, Leaf)>),
}

impl Leaf {
    /// The value as JSON (bytes as `{"__bytes__": "<base64>"}`; non-finite floats as strings).
    pub(crate) fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Leaf::None => J::Null,
            Leaf::Bool(b) => J::Bool(*b),
            Leaf::Int(i) => J::from(*i),
            Leaf::Float(f) => serde_json::Number::from_f64(*f).map_or_else(|| J::String(f.to_string()), J::Number),
            Leaf::Str(s) => J::String(s.clone()),
            Leaf::Bytes(b) => {
                let mut m = serde_json::Map::new();
                m.insert(BYTES_KEY.to_string(), J::String(base64(b)));
                J::Object(m)
            }
            Leaf::List(l) => J::Array(l.iter().map(Leaf::to_json).collect()),
            Leaf::Dict(d) => J::Object(d.iter().map(|(k, v)| (k.clone(), v.to_json())).collect()),
        }
    }
}

/// Standard base64 with padding.
fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let sym = |n: u32, shift: u32| char::from(ALPHABET[((n >> shift) & 63) as usize]);
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (b(0) << 16) | (b(1) << 8) | b(2);
        out.push(sym(n, 18));
        out.push(sym(n, 12));
        out.push(if chunk.len() > 1 { sym(n, 6) } else { '=' });
        out.push(if chunk.len() > 2 { sym(n, 0) } else { '=' });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_stay_one_base64_string() {
        let cases: [(&[u8], &str); 5] =
            [(b"", ""), (b"f", "Zg=="), (b"fo", "Zm8="), (b"foo", "Zm9v"), (b"\x00\xffok", "AP9vaw==")];
        for (data, text) in cases {
            assert_eq!(Leaf::Bytes(data.to_vec()).to_json(), serde_json::json!({ "__bytes__": text }));
        }
        let big = Leaf::Bytes(vec![0xAB; 3 << 20]);
        let json = serde_json::to_string(&big.to_json()).unwrap_or_default();
        assert_eq!(json.len(), "{\"__bytes__\":\"\"}".len() + (4 << 20), "4 bytes of JSON per 3 bytes");
    }
}
