//! The `ckpt` binary end to end, one module per command family or shared behaviour: exit codes,
//! stdout and stderr, `--help` (`basics`), `ckpt data` (`data`), `--allow-global`
//! (`allow_global`) and `hf://` addresses against a local Hub (`hub`).

#[path = "../common/mod.rs"]
mod common;

mod allow_global;
mod basics;
mod data;
mod hub;
