//! The references between a folder's files that `load_state` relies on: one RNG file per rank
//! of the world that saved the sharded models, every model saved by that world, and each
//! optimizer beside a model whose tensors its state fits.

use super::{bad, trainer, OptimizerState, SaveState};
use crate::error::Error;
use crate::read::catalog::Checkpoint;

impl SaveState {
    /// The references between components that `load_state` relies on.
    pub(super) fn cross_check(&self) -> Vec<Error> {
        let mut out = Vec::new();
        // One RNG file per rank of the world that saved the sharded models. A folder with none
        // at all is what accelerate's `save_fsdp_model`/`save_fsdp_optimizer` leave (and what
        // `load_state` tolerates, keeping the current generators); one with some is half saved.
        // The ranks missing are found from the files present, never by counting up to the
        // world size, and reported as ranges in one problem.
        let w = self.world_size;
        if let Some(p) = self.missing_rng() {
            out.push(p);
        }
        for f in self.rng.iter().filter(|f| f.rank >= w) {
            out.push(bad(
                &f.path,
                Some(f.rank),
                format!("an RNG file for rank {} but the models were saved by {w} ranks", f.rank),
            ));
        }
        for m in &self.models {
            if let Some(mw) = m.checkpoint.world_size().filter(|&mw| mw != w) {
                out.push(bad(&m.path, None, format!("saved by {mw} ranks, but another model by {w}")));
            }
        }
        for o in &self.optimizers {
            let OptimizerState::Own(ock) = &o.state else { continue };
            match self.models.iter().find(|m| m.index == o.index) {
                None => {
                    out.push(bad(&o.path, None, format!("optimizer {} has no model {} beside it", o.index, o.index)))
                }
                Some(m) => {
                    if let Err(reason) = matches_model(ock, &m.checkpoint) {
                        out.push(bad(&o.path, None, format!("does not match {}: {reason}", m.path.display())));
                    }
                }
            }
        }
        out
    }

    /// The one problem that names the ranks of the world without an RNG file, where some RNG
    /// files are there: a single rank at its file's name, several as ranges at the file that
    /// sets the world size (the model saved by that many ranks, else the highest rank's file).
    fn missing_rng(&self) -> Option<Error> {
        if self.rng.is_empty() {
            return None;
        }
        let w = self.world_size;
        // At most one gap per file present, plus one.
        let mut gaps: Vec<(u64, u64)> = Vec::new();
        let mut next = 0u64;
        for r in self.rng.iter().map(|f| f.rank).filter(|&r| r < w).chain([w]) {
            if r > next {
                gaps.push((next, r - 1));
            }
            next = next.max(r.saturating_add(1));
        }
        match gaps.as_slice() {
            [] => None,
            [(a, b)] if a == b => {
                Some(Error::MissingRngFile { path: self.root.join(self.rng_name(*a, w)), rank: *a, world: w })
            }
            _ => {
                const SHOWN: usize = 8;
                let mut list: Vec<String> = gaps
                    .iter()
                    .take(SHOWN)
                    .map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
                    .collect();
                if gaps.len() > SHOWN {
                    list.push(format!("and {} more ranges", gaps.len() - SHOWN));
                }
                let list = list.join(", ");
                Some(match self.models.iter().find(|m| m.checkpoint.world_size() == Some(w)) {
                    Some(m) => bad(
                        &m.path,
                        None,
                        format!("missing: the folder was saved by {w} ranks, as this model says, and ranks {list} left no RNG file"),
                    ),
                    None => {
                        let last = self.rng.iter().rfind(|f| f.rank < w)?;
                        bad(
                            &last.path,
                            Some(last.rank),
                            format!(
                                "missing: the folder was saved by {w} ranks, as this file's name says, and ranks {list} left no RNG file"
                            ),
                        )
                    }
                })
            }
        }
    }

    /// The name of rank `rank`'s RNG file in a folder of this kind saved by `world` ranks.
    pub(crate) fn rng_name(&self, rank: u64, world: u64) -> String {
        match self.trainer {
            Some(_) => trainer::rng_name(rank, world),
            None => format!("random_states_{rank}.pkl"),
        }
    }
}

/// Whether an optimizer's state fits its model: for a DCP optimizer every parameter it names is
/// a model tensor of the same shape; for a torch file, whose state is keyed by position in
/// `model.parameters()`, the parameters' shapes appear in the model's state dict in order (its
/// buffers, which have no optimizer state, in between).
fn matches_model(optim: &Checkpoint, model: &Checkpoint) -> std::result::Result<(), String> {
    let shape_of = |name: &str| model.tensors().iter().find(|t| t.name == name).map(|t| &t.shape);
    // The state tensors shaped like their parameter, by parameter key, in file order.
    let mut keyed: Vec<(&str, &Vec<u64>)> = Vec::new();
    for t in optim.tensors() {
        let Some(rest) = t.name.strip_prefix("state.") else { continue };
        let Some((key, _)) = rest.rsplit_once('.') else { continue };
        if t.shape.is_empty() {
            continue;
        }
        match keyed.iter().find(|(k, _)| *k == key) {
            Some((_, s)) if *s != &t.shape => return Err(format!("the states of parameter `{key}` differ in shape")),
            Some(_) => {}
            None => keyed.push((key, &t.shape)),
        }
    }
    let positional = keyed.iter().all(|(k, _)| k.bytes().all(|b| b.is_ascii_digit()));
    if !positional {
        for (key, shape) in &keyed {
            match shape_of(key) {
                None => return Err(format!("it has state for `{key}`, which the model does not have")),
                Some(s) if s != *shape => {
                    return Err(format!("`{key}` is {s:?} in the model but its optimizer state is {shape:?}"))
                }
                Some(_) => {}
            }
        }
        return Ok(());
    }
    // Positions cannot be named without the module tree, and safetensors files keep tensors
    // sorted by name, not in `parameters()` order: each shape must have at least as many model
    // tensors as parameters with state.
    keyed.sort_by_key(|(k, _)| k.parse::<u64>().unwrap_or(u64::MAX));
    for (key, shape) in &keyed {
        let need = keyed.iter().filter(|(_, s)| s == shape).count();
        let have = model.tensors().iter().filter(|t| &t.shape == *shape).count();
        if have < need {
            return Err(format!(
                "{need} parameter(s) with state are shaped {shape:?} (parameter {key} among them) but the model has {have} such tensor(s)"
            ));
        }
    }
    let listed: usize = optim
        .values()
        .iter()
        .filter(|(k, _)| *k == "param_groups")
        .filter_map(|(_, v)| {
            v.as_array().map(|gs| gs.iter().filter_map(|g| g.get("params")?.as_array().map(Vec::len)).sum::<usize>())
        })
        .sum();
    if listed > model.tensors().len() {
        return Err(format!("its groups list {listed} parameters; the model has {} tensors", model.tensors().len()));
    }
    Ok(())
}
