//! Which global layers a pipeline stage's model chunk holds: megatron-core 0.19.2's
//! `get_transformer_layer_offset` (`megatron/core/transformer/transformer_layer.py`) and
//! `get_num_layers_to_build` (`transformer_block.py`), from the saved `args`.
//!
//! A legacy save numbers each chunk's layers from 0 (`model` without virtual stages, `model0`,
//! `model1`, ... with them); nothing in the file says where they sit. Megatron places chunk
//! `v` of stage `p` by rule: with `P` stages of `L` layers each split into `V` chunks
//! (`--num-layers-per-virtual-pipeline-stage`), chunk `v` of stage `p` starts at
//! `v · (L·P / V) + p · (L / V)` (interleaved: stage 0 holds `[0] [4]`, stage 1 `[1] [5]` ...);
//! with an uneven first or last stage (`--decoder-first-pipeline-num-layers`,
//! `--decoder-last-pipeline-num-layers`) those stages hold what they were given and the middle
//! ones share the rest evenly; a stage may also count the embedding or the loss as a layer
//! (`--account-for-embedding-in-pipeline-split`, `--account-for-loss-in-pipeline-split`). An
//! explicit `--pipeline-model-parallel-layout` places layers by a string this reader does not
//! parse, and is refused by name.

use crate::read::value::Leaf;

use super::info;

/// The saved `args` that decide the layer placement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Stages {
    pub num_layers: u64,
    pub pipeline: u64,
    /// Model chunks per stage (virtual pipeline size), when there are virtual stages.
    pub virtual_size: Option<u64>,
    pub first: Option<u64>,
    pub last: Option<u64>,
    pub embedding_in_split: bool,
    pub loss_in_split: bool,
}

impl Stages {
    /// The placement the saved `args` give, or why it is not read. `None` when the args do not
    /// say the number of layers (a save without Megatron-LM's `args`).
    pub(crate) fn from_args(args: Option<&Leaf>) -> Result<Option<Stages>, String> {
        Stages::from_lookup(|name| args.and_then(|a| info::lookup(a, &[name])))
    }

    /// The same, with `arg` giving the saved `args.NAME` (a `torch_dist` save's `common_state`).
    pub(crate) fn from_lookup<'a>(arg: impl Fn(&str) -> Option<&'a Leaf>) -> Result<Option<Stages>, String> {
        let set = |name: &str| !matches!(arg(name), None | Some(Leaf::None));
        let flag = |name: &str| matches!(arg(name), Some(Leaf::Bool(true)));
        if set("pipeline_model_parallel_layout") {
            return Err("`args.pipeline_model_parallel_layout` places layers by a layout string: not read yet".into());
        }
        let Some(num_layers) = info::uint(arg("num_layers")) else { return Ok(None) };
        let pipeline = info::uint(arg("pipeline_model_parallel_size")).unwrap_or(1).max(1);
        let virtual_size = info::uint(arg("virtual_pipeline_model_parallel_size")).filter(|_| pipeline > 1);
        let s = Stages {
            num_layers,
            pipeline,
            virtual_size,
            first: info::uint(arg("decoder_first_pipeline_num_layers")),
            last: info::uint(arg("decoder_last_pipeline_num_layers")),
            embedding_in_split: flag("account_for_embedding_in_pipeline_split"),
            loss_in_split: flag("account_for_loss_in_pipeline_split"),
        };
        if s.virtual_size == Some(0) {
            return Err("`args.virtual_pipeline_model_parallel_size` is 0".into());
        }
        if (s.first.is_some() || s.last.is_some()) && (s.embedding_in_split || s.loss_in_split) {
            return Err("uneven stages with the embedding or loss counted as a layer: megatron refuses it".into());
        }
        Ok(Some(s))
    }

    /// The model chunks of each stage.
    pub(crate) fn chunks(&self) -> u64 {
        self.virtual_size.unwrap_or(1)
    }

    fn uneven(&self) -> bool {
        self.first.is_some() || self.last.is_some()
    }

    /// The global index of the first layer of chunk `vp` of stage `pp`
    /// (`get_transformer_layer_offset`); checked arithmetic, `None` where it does not hold.
    pub(crate) fn offset(&self, pp: u64, vp: u64) -> Option<u64> {
        if self.pipeline <= 1 {
            return Some(0);
        }
        let vs = self.virtual_size;
        if self.uneven() {
            let middle_stages = self.pipeline - u64::from(self.first.is_some()) - u64::from(self.last.is_some());
            let (first, last) = (self.first.unwrap_or(0), self.last.unwrap_or(0));
            let middle_layers = self.num_layers.checked_sub(first)?.checked_sub(last)?;
            // Stage 0 returns before this is used; megatron computes it as `pp_rank - 1` there too.
            let middle_rank = if self.first.is_none() { pp } else { pp.saturating_sub(1) };
            if let Some(v) = vs {
                let (first_v, last_v, middle_v) = (first / v, last / v, middle_layers / v);
                let total = first_v + middle_v + last_v;
                if pp == 0 {
                    return vp.checked_mul(total);
                }
                let per_middle = middle_v.checked_div(middle_stages).unwrap_or(0);
                return vp.checked_mul(total)?.checked_add(first_v)?.checked_add(middle_rank.checked_mul(per_middle)?);
            }
            let per_rank = middle_layers.checked_div(middle_stages).unwrap_or(0);
            if pp == 0 {
                return Some(0);
            }
            return middle_rank.checked_mul(per_rank)?.checked_add(first);
        }
        let counted = self.num_layers + u64::from(self.embedding_in_split) + u64::from(self.loss_in_split);
        let per_rank = counted / self.pipeline;
        // Every chunk but the very first gives back the embedding's place.
        let minus = u64::from(self.embedding_in_split && !(vp == 0 && pp == 0));
        let offset = match vs {
            Some(v) => vp.checked_mul(counted / v)?.checked_add(pp.checked_mul(per_rank / v)?)?,
            None => pp.checked_mul(per_rank)?,
        };
        offset.checked_sub(minus)
    }

    /// The layers chunk `vp` of stage `pp` builds (`get_num_layers_to_build`), or why the
    /// `args` do not divide.
    pub(crate) fn layers(&self, pp: u64, vp: u64) -> Result<u64, String> {
        let (is_first, is_last) = (pp == 0, pp + 1 == self.pipeline);
        let mut per_rank = if self.uneven() {
            let mut left = self.num_layers;
            let mut stages = self.pipeline;
            for n in [self.first, self.last].into_iter().flatten() {
                left = left.checked_sub(n).ok_or("the first and last stages hold more layers than there are")?;
                stages = stages.saturating_sub(1);
            }
            let per = match stages {
                0 => 0,
                s if left.is_multiple_of(s) => left / s,
                s => return Err(format!("{left} middle layers do not divide over {s} middle stages")),
            };
            match (self.first, self.last) {
                (Some(n), _) if is_first => n,
                (_, Some(n)) if is_last => n,
                _ => per,
            }
        } else {
            let counted = self.num_layers + u64::from(self.embedding_in_split) + u64::from(self.loss_in_split);
            if !counted.is_multiple_of(self.pipeline) {
                return Err(format!("{counted} layers do not divide over {} stages", self.pipeline));
            }
            counted / self.pipeline
        };
        if let Some(v) = self.virtual_size {
            if !per_rank.is_multiple_of(v) {
                return Err(format!("a stage's {per_rank} layers do not divide into {v} virtual chunks"));
            }
            per_rank /= v;
        }
        // The embedding and the loss take a layer's place in the first and last chunks.
        let v_last = self.chunks() - 1;
        if !self.uneven() {
            per_rank -= u64::from(self.embedding_in_split && is_first && vp == 0).min(per_rank);
            per_rank -= u64::from(self.loss_in_split && is_last && vp == v_last).min(per_rank);
        }
        Ok(per_rank)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn placement(s: &Stages) -> Vec<Vec<(u64, u64)>> {
        (0..s.pipeline)
            .map(|pp| (0..s.chunks()).map(|vp| (s.offset(pp, vp).unwrap(), s.layers(pp, vp).unwrap())).collect())
            .collect()
    }

    #[test]
    fn virtual_chunks_interleave_over_the_stages_as_megatrons_docstring_draws_them() {
        // "With 8 layers, 2 stages, and 4 model chunks: Stage 0: [0] [2] [4] [6], Stage 1: [1] [3] [5] [7]".
        let s = Stages { num_layers: 8, pipeline: 2, virtual_size: Some(4), ..Stages::default() };
        assert_eq!(placement(&s), [[(0, 1), (2, 1), (4, 1), (6, 1)], [(1, 1), (3, 1), (5, 1), (7, 1)]]);
        // "With 8 layers, 2 stages, and 2 virtual stages: Stage 0: [0, 1] [4, 5], Stage 1: [2, 3] [6, 7]".
        let s = Stages { virtual_size: Some(2), ..s };
        assert_eq!(placement(&s), [[(0, 2), (4, 2)], [(2, 2), (6, 2)]]);
    }

    #[test]
    fn uneven_first_and_last_stages_hold_what_they_were_given() {
        let s = Stages { num_layers: 3, pipeline: 2, first: Some(1), ..Stages::default() };
        assert_eq!(placement(&s), [[(0, 1)], [(1, 2)]]);
        let s = Stages { num_layers: 8, pipeline: 4, first: Some(1), last: Some(1), ..Stages::default() };
        assert_eq!(placement(&s), [[(0, 1)], [(1, 3)], [(4, 3)], [(7, 1)]]);
        let s = Stages { num_layers: 7, pipeline: 3, first: Some(1), ..Stages::default() };
        assert_eq!(placement(&s), [[(0, 1)], [(1, 3)], [(4, 3)]]);
    }

    #[test]
    fn the_embedding_counted_as_a_layer_shifts_every_later_chunk_back() {
        let s = Stages { num_layers: 3, pipeline: 2, embedding_in_split: true, ..Stages::default() };
        assert_eq!(placement(&s), [[(0, 1)], [(1, 2)]]);
    }

    #[test]
    fn layers_that_do_not_divide_are_named() {
        let s = Stages { num_layers: 5, pipeline: 2, ..Stages::default() };
        assert_eq!(s.layers(0, 0), Err("5 layers do not divide over 2 stages".to_string()));
        let s = Stages { num_layers: 6, pipeline: 2, virtual_size: Some(2), ..Stages::default() };
        assert_eq!(s.layers(0, 0), Err("a stage's 3 layers do not divide into 2 virtual chunks".to_string()));
    }
}
