//! Hostile inputs through the real binary: exit code 2 and one line naming the file, never an
//! abort: hostile accelerate folders (`accelerate`), files that need gigabytes if read naively
//! under an address-space limit (`memory`), and the output side under attack (`output`).

#[path = "../common/mod.rs"]
mod common;

mod accelerate;
mod memory;
mod output;
