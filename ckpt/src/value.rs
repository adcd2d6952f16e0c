//! Non-tensor values of a checkpoint (a torch file's `step`, an optimizer's `param_groups`):
//! the plain data a restricted unpickler can give back, and nothing that could run.

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
    /// The value as JSON (bytes as an array of numbers; non-finite floats as strings).
    pub(crate) fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Leaf::None => J::Null,
            Leaf::Bool(b) => J::Bool(*b),
            Leaf::Int(i) => J::from(*i),
            Leaf::Float(f) => serde_json::Number::from_f64(*f).map_or_else(|| J::String(f.to_string()), J::Number),
            Leaf::Str(s) => J::String(s.clone()),
            Leaf::Bytes(b) => J::Array(b.iter().map(|&x| J::from(x)).collect()),
            Leaf::List(l) => J::Array(l.iter().map(Leaf::to_json).collect()),
            Leaf::Dict(d) => J::Object(d.iter().map(|(k, v)| (k.clone(), v.to_json())).collect()),
        }
    }
}
