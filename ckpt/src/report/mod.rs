//! What `ckpt` says about a checkpoint: what its format describes, the verify report, and the
//! versioned JSON documents of an opened checkpoint, a report and an outcome that `ckpt --json`
//! prints and the Python bindings return.

pub(crate) mod describe;
pub(crate) mod verify;
pub(crate) mod view;
