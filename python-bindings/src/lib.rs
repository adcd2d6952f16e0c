//! `statekit._native`: the Rust side of the `statekit` Python package.
//!
//! The pure-Python package (`python/statekit`) is the public face; this module only exposes
//! what it needs from `ckpt` and `dataload`: the sharded sampler, opened checkpoints and their
//! reads into caller-owned buffers, the operations, and the writers. It never imports torch;
//! every call that reads or writes files, copies bytes or computes a permutation releases
//! the GIL.

mod args;
mod buffer;
mod checkpoint;
mod comm;
mod config;
mod datasets;
mod errors;
mod mixture;
mod passes;
mod sampler;
mod save;
mod states;
mod stream;

use pyo3::prelude::*;

// Free-threaded CPython may run this module without the GIL: nothing here relies on it. Every
// class is `frozen` (immutable, `Sync`) except `Sampler`, `DispatchSteps` and `PassState`, whose
// `&mut self` methods go through pyo3's borrow flag (atomic where there is no GIL: a second
// thread gets a `RuntimeError`, never a data race); buffers are held as exports for the whole
// call, which is what keeps them alive and sized, with or without the GIL (every call that
// touches their bytes releases it anyway).
#[pymodule(gil_used = false)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<sampler::Sampler>()?;
    m.add_function(wrap_pyfunction!(args::check_int, m)?)?;
    m.add_function(wrap_pyfunction!(sampler::default_config_json, m)?)?;
    m.add_function(wrap_pyfunction!(config::resolve_loader, m)?)?;
    m.add_class::<passes::PassState>()?;
    m.add_function(wrap_pyfunction!(stream::stream_plan, m)?)?;
    m.add_function(wrap_pyfunction!(stream::stream_len, m)?)?;
    m.add_function(wrap_pyfunction!(stream::dispatch_slice, m)?)?;
    m.add_function(wrap_pyfunction!(stream::dispatch_len, m)?)?;
    m.add_class::<stream::DispatchSteps>()?;
    m.add_function(wrap_pyfunction!(states::torchdata_position, m)?)?;
    m.add_function(wrap_pyfunction!(states::state_epoch, m)?)?;
    m.add_function(wrap_pyfunction!(states::iterable_state_json, m)?)?;
    m.add_function(wrap_pyfunction!(states::parse_iterable_state, m)?)?;
    m.add_class::<mixture::Mixture>()?;
    m.add_class::<checkpoint::PyCheckpoint>()?;
    m.add_class::<datasets::TokenSource>()?;
    m.add_class::<datasets::TableSource>()?;
    m.add_class::<datasets::JsonlSource>()?;
    m.add_function(wrap_pyfunction!(datasets::open_regular, m)?)?;
    m.add_function(wrap_pyfunction!(datasets::check_mapped, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::verify, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::split, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::merge, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::convert, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::reshard, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(save::save_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(save::save_sharded, m)?)?;
    Ok(())
}
