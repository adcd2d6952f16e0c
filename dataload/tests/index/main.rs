//! The index side of `dataload` (no `sources` feature needed): samplers and rank sharding
//! against accelerate's and torch's own results, the loader's arithmetic, its state and
//! refusals, and resume properties.

#[path = "../common/mod.rs"]
mod common;

mod accelerate_test_file;
mod generated_vectors;
mod loader_arithmetic;
mod random_sampler;
mod resume_props;
mod state_and_errors;
mod torch_conformance;
