//! Entry points for the fuzz target in `train/fuzz/` (built without the `trainer` feature, so
//! without libtorch or MPI). Not part of the API.

use std::path::Path;

use crate::state_file;

/// `statekit_state.json` on arbitrary bytes: parsed and checked as `--resume` does, never a
/// panic, a hang or an allocation out of proportion to the input. An accepted state is written
/// back and accepted again, and its parameters' geometry (what the resume cuts rows by) is
/// computed for a few world sizes.
pub fn state_json(data: &[u8]) {
    let path = Path::new("fuzz/step-0000001/statekit_state.json");
    let Ok(state) = state_file::parse(data, path, 0) else { return };
    let again = serde_json::to_vec_pretty(&state).map(|t| state_file::parse(&t, path, 0));
    assert!(matches!(again, Ok(Ok(_))), "an accepted state is refused once written back: {again:?}");
    let name = state_file::step_dir_name(state.step);
    assert_eq!(state_file::parse_step_dir_name(&name), Some(state.step), "{name}");
    for p in &state.params {
        let _ = (p.numel(), p.row_len());
        for w in [1, 3, state.world_size] {
            let _ = (p.chunk(w, 0), p.chunk(w, w - 1));
        }
    }
}

/// Seeds for [`state_json`]: states as the trainer writes them (its sampler's loader state, a
/// small model's parameters), on 1, 2 and 3 ranks, in both modes (`run.sh` writes them through
/// `examples/fuzz_seeds.rs`).
pub fn state_json_seeds() -> Vec<(String, Vec<u8>)> {
    use crate::optim::{AdamW, Schedule};
    use crate::state_file::{ModelConfig, ParamMeta, TrainState, STATE_FORMAT, STATE_VERSION};
    let model = ModelConfig { vocab: 64, block_size: 16, layers: 1, heads: 2, dim: 32, tied: true };
    let params = [
        ("h.0.attn.c_attn.bias", vec![96]),
        ("h.0.attn.c_attn.weight", vec![96, 32]),
        ("ln_f.weight", vec![32]),
        ("wpe.weight", vec![16, 32]),
        ("wte.weight", vec![64, 32]),
    ];
    let mut out = Vec::new();
    for (world, mode, step) in [(1u64, "ddp", 0u64), (2, "ddp", 6), (3, "sharded", 40)] {
        let sampler = dataload::ShardedSampler::builder()
            .dataset_len(1000)
            .batch_size(4)
            .world_size(world)
            .rank(0)
            .shuffle(true)
            .torch_initial_seed(1234)
            .config(dataload::DataLoaderConfiguration {
                use_seedable_sampler: true,
                dispatch_batches: Some(false),
                ..Default::default()
            })
            .fingerprint("seed")
            .build();
        let Ok(sampler) = sampler else { continue };
        let state = TrainState {
            format: STATE_FORMAT.into(),
            version: STATE_VERSION,
            step,
            world_size: world,
            mode: mode.into(),
            model,
            adamw: AdamW::default(),
            schedule: Schedule { lr: 3e-3, min_lr: 3e-4, warmup: 4, total: 40 },
            seed: 1234,
            batch_size: 4,
            grad_accum: 1,
            params: params.iter().map(|(n, s)| ParamMeta { name: n.to_string(), shape: s.clone() }).collect(),
            loader: sampler.state_dict(),
            rank_rng: vec![1234; world as usize],
        };
        if let Ok(json) = serde_json::to_vec_pretty(&state) {
            out.push((format!("{mode}-{world}-ranks-step-{step}.json"), json));
        }
    }
    out
}
