//! The distributed optimizer's state, per parameter, whichever form the save used.
//!
//! `fully_reshardable` stores it per parameter already: `optimizer.state.<state>.<model key>`
//! (`param` the fp32 main parameter, `exp_avg`, `exp_avg_sq`), sharded exactly like the model
//! tensor. `dp_reshardable` stores one flat fp32 tensor per grad-buffer bucket and state
//! ([`buckets`]); each parameter is a range of it, at the place megatron's grad buffer gave it.

use super::info::Megatron;
use crate::error::{Error, Result};
use crate::read::catalog::{Checkpoint, TensorInfo};

/// The prefix of the per-parameter optimizer keys.
pub(crate) const STATE_PREFIX: &str = "optimizer.state.";

/// The optimizer's state per parameter, named as the `fully_reshardable` form names it
/// (`optimizer.state.{param,exp_avg,exp_avg_sq}.<stored key>`, stored shapes).
pub(crate) fn optimizer_state(ck: &Checkpoint) -> Result<Vec<TensorInfo>> {
    let refuse = |reason: String| Error::BadMegatron { path: ck.root.clone(), key: None, rank: None, reason };
    let Some(m) = ck.detail::<Megatron>() else {
        return Err(refuse("not a Megatron checkpoint".into()));
    };
    if let Some(legacy) = &m.legacy {
        return legacy.optimizer_state();
    }
    let Some(dcp) = &m.dcp else {
        return Err(refuse("the checkpoint holds no optimizer state".into()));
    };
    if super::chained::is_chained(dcp) {
        return super::chained::per_parameter(ck, m, dcp);
    }
    match m.meta.optimizer.as_deref() {
        Some("fully_reshardable") => Ok(dcp
            .tensors
            .iter()
            .filter(|t| t.key.starts_with(STATE_PREFIX))
            .map(super::torch_dist::as_stored)
            .collect()),
        Some("dp_reshardable") => super::buckets::per_parameter(ck, m, dcp),
        Some(other) => Err(refuse(format!("the optimizer's form `{other}` is not read yet"))),
        None => Err(refuse("the checkpoint holds no optimizer state".into())),
    }
}
