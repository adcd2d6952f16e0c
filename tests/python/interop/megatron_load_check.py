"""One rank of megatron-core 0.19.2 loading a run folder that `ckpt convert --to megatron` wrote
(gloo on CPU, `fixtures/gen/megatron_cpu.py`'s patches), for test_megatron_save.py.

    PYTHONPATH=/opt/mcore torchrun --nproc_per_node TP megatron_load_check.py SPEC.json

SPEC.json: {"case": {...case.json...}, "tp": N, "pp": N (default 1), "reference": DIR, "ours": RUN_DIR,
            "hf_logits": PATH (optional: safetensors with `input_ids` and `logits` to match),
            "legacy": true (optional: RUN_DIR is in the legacy per-rank layout)}

A case with `rope_theta` is a Hugging Face model's (test_megatron_save.py's `hf_case`): built
with that base, `norm_eps`, `head_dim`, `qkv_bias` and `qk_norm`.

Each rank builds the case's GPTModel (local spec) at tensor parallel size `tp`, and:

1. `dist_checkpointing.load(model.sharded_state_dict(), ITER)` of the reference (megatron's own
   save, a run folder or a `dist_checkpointing.save` folder, when given) and of ours, each into a model whose parameters
   were all NaN: every parameter of ours must equal the reference's bit for bit (or, without a
   reference, hold no NaN);
2. Megatron-LM's `load_checkpoint` with `--finetune --no-load-optim --no-load-rng` from ours
   (args parsed and validated by `megatron.training.arguments`): it must start at iteration 0
   with the same parameters;
3. with `hf_logits`: the forward's logits of the loaded model, gathered over TP, must match
   the recorded ones (max |diff| < 1e-4).

With `legacy`, ours is Megatron-LM's legacy per-rank layout (`--to megatron-legacy`), which
only `load_checkpoint` reads: each rank's file must hold exactly the keys of its model's
`state_dict()` (`_extra_state` included; megatron's strict load would otherwise fall back to a
lax one), and the parameters `load_checkpoint` gives must equal, bit for bit, those
`dist_checkpointing.load` gives from the reference (a `torch_dist` run of the same model) at
the same tensor and pipeline parallel sizes.

An MoE spec (`argv`) with `legacy` does the same on megatron_moe_worker.py's model: ours the
`torch_dist` run, `legacy` the legacy one.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "..", "fixtures", "gen")
sys.path.insert(0, GEN)
import megatron_cpu  # noqa: E402  (must precede megatron imports)

import torch  # noqa: E402


def iteration_dir(run_dir):
    """The folder megatron loads: the tracker's iteration of a run folder, or the folder itself
    (what `dist_checkpointing.save` wrote)."""
    tracker = os.path.join(run_dir, "latest_checkpointed_iteration.txt")
    if not os.path.exists(tracker):
        return run_dir
    with open(tracker) as f:
        return os.path.join(run_dir, f"iter_{int(f.read().strip()):07d}")


def build_hf_model(case, tp):
    """GPTModel (local spec) for a Hugging Face family's settings: RoPE with the config's base,
    RMSNorm with its epsilon, the head width, Qwen2's QKV biases, Qwen3's q/k norms."""
    import dataclasses

    import megatron_worker
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = megatron_worker.transformer_config(case, tp, parallel_state.get_pipeline_model_parallel_world_size())
    config = dataclasses.replace(config, layernorm_epsilon=case["norm_eps"], kv_channels=case["head_dim"],
                                 add_qkv_bias=case["qkv_bias"], qk_layernorm=case["qk_norm"])
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=case["qk_norm"])
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=case["vocab"],
                    max_sequence_length=case["seq_len"], pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=case["tied"], position_embedding_type="rope",
                    rotary_base=case["rope_theta"])


def nan_model(case, tp):
    import megatron_worker

    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    model = build_hf_model(case, tp) if "rope_theta" in case else megatron_worker.build_model(case, tp, pp)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return model


def load_dist(case, tp, run_dir):
    from megatron.core import dist_checkpointing

    model = nan_model(case, tp)
    sharded = model.sharded_state_dict()
    loaded = dist_checkpointing.load(sharded, iteration_dir(run_dir))
    # The common state (a run's `args`, `iteration`) comes back beside the model's keys.
    model.load_state_dict({k: loaded[k] for k in sharded})
    return model


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def same(got, want, what):
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {k}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        assert a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)), f"{what}: {k} differs"


def no_nan(got, what):
    for k, v in got.items():
        assert not (v.is_floating_point() and torch.isnan(v.float()).any()), f"{what}: {k} still NaN"


class _CpuTensors:
    """`torch` as Megatron-LM's checkpointing module sees it, where `torch.tensor(...,
    device='cuda')` (`read_metadata`'s all-reduce of the tracker's iteration, which
    megatron_cpu does not cover) makes a CPU tensor for gloo; everything else is torch's."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.tensor(*args, **kwargs)


def load_megatron_lm(case, tp, run_dir, pp=1):
    """Megatron-LM's `load_checkpoint`, as a fine-tuning run starting from `run_dir` calls it."""
    import megatron_worker
    from megatron.training import checkpointing, global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_checkpoint

    case = {**case, "tp": tp, "pp": pp}
    sys.argv = megatron_worker.megatron_lm_argv(case, "/nonexistent-save")
    sys.argv += ["--load", run_dir, "--finetune", "--no-load-optim", "--no-load-rng"]
    args = parse_args()
    validate_args(args)
    global_vars.set_global_variables(args, build_tokenizer=False)
    checkpointing.torch = _CpuTensors()
    model = nan_model(case, tp)
    iteration, _ = load_checkpoint([model], None, None, strict=True)
    assert iteration == 0, f"load_checkpoint started at iteration {iteration}, not 0 (--finetune)"
    return model


def rank_file_keys_are_the_models(model, run_dir):
    """The file megatron's `load_checkpoint` reads on this rank holds exactly the keys of the
    rank's `state_dict()`."""
    from megatron.training.checkpointing import get_checkpoint_name

    path = get_checkpoint_name(run_dir, 0, release=False)
    saved = torch.load(path, map_location="cpu", weights_only=False)
    assert saved["checkpoint_version"] == 3.0, f"{path}: checkpoint_version {saved['checkpoint_version']}"
    want, got = set(model.state_dict()), set(saved["model"])
    assert got == want, f"{path}: keys differ from the model's: missing {sorted(want - got)}, extra {sorted(got - want)}"


def logits(model, tokens, tp):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    model.eval()
    b, s = tokens.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    with torch.no_grad():
        out = model(tokens, position_ids, mask)
    return gather_from_tensor_model_parallel_region(out) if tp > 1 else out


def moe_main(spec):
    """An MoE run at the layout of spec["argv"] (Megatron-LM's command line):
    `megatron_moe_worker.py`'s model, NaN-filled, `dist_checkpointing.load` of ours, no NaN
    left, and the forward's logits (gathered over TP) against the recorded."""
    import megatron_moe_worker as moe
    from megatron.core import dist_checkpointing
    from megatron.core.enums import ModelType
    from megatron.training.training import get_model

    moe.init_megatron(spec["argv"])
    gpt = moe.w.unwrapped(get_model(moe.model_provider, ModelType.encoder_or_decoder, wrap_with_ddp=False))
    with torch.no_grad():
        for p in gpt.parameters():
            p.fill_(float("nan"))
    sharded = gpt.sharded_state_dict()
    loaded = dist_checkpointing.load(sharded, iteration_dir(spec["ours"]))
    gpt.load_state_dict({k: loaded[k] for k in sharded}, strict=True)
    no_nan(params(gpt), "dist_checkpointing.load")
    if spec.get("legacy"):
        from megatron.training import checkpointing, get_args
        from megatron.training.checkpointing import load_checkpoint

        want = params(gpt)
        with torch.no_grad():
            for p in gpt.parameters():
                p.fill_(float("nan"))
        args = get_args()
        args.load, args.finetune, args.no_load_optim, args.no_load_rng = spec["legacy"], True, True, True
        checkpointing.torch = _CpuTensors()
        iteration, _ = load_checkpoint([gpt], None, None, strict=True)
        assert iteration == 0, f"load_checkpoint started at iteration {iteration}, not 0 (--finetune)"
        rank_file_keys_are_the_models(gpt, spec["legacy"])
        same(params(gpt), want, "load_checkpoint of the legacy ranks")
    from megatron.core import parallel_state

    check_logits(gpt, spec["hf_logits"], parallel_state.get_tensor_model_parallel_world_size())
    finish()


def check_logits(model, path, tp):
    """The forward's logits of `model`, gathered over TP, against those recorded at `path`
    (max |diff| < 1e-4)."""
    from safetensors.torch import load_file

    recorded = load_file(path)
    got = logits(model, recorded["input_ids"].long(), tp).float()
    diff = (got - recorded["logits"].float()).abs().max().item()
    assert diff < 1e-4, f"logits differ from the recorded ones by {diff}"
    print(f"rank {torch.distributed.get_rank()}: logits max |diff| {diff:.3g}")


def finish():
    """Every rank done: `ok`, then the process group torn down."""
    torch.distributed.barrier()
    print(f"rank {torch.distributed.get_rank()}: ok")
    torch.distributed.destroy_process_group()


def legacy_main(spec, case, tp, pp):
    """Ours in the legacy layout: what `load_checkpoint` reads of it against what
    `dist_checkpointing.load` reads of the reference, and the logits on one stage."""
    want = params(load_dist(case, tp, spec["reference"]))
    no_nan(want, "dist_checkpointing.load")
    lm = load_megatron_lm(case, tp, spec["ours"], pp)
    rank_file_keys_are_the_models(lm, spec["ours"])
    same(params(lm), want, "load_checkpoint of the legacy ranks")
    if spec.get("hf_logits") and pp == 1:
        check_logits(lm, spec["hf_logits"], tp)
    finish()


def main():
    spec = json.load(open(sys.argv[1]))
    megatron_cpu.install()
    if spec.get("argv"):
        return moe_main(spec)
    case, tp, pp = spec["case"], spec["tp"], spec.get("pp", 1)
    megatron_worker = __import__("megatron_worker")
    megatron_worker.init_parallel(tp, pp)
    if spec.get("legacy"):
        return legacy_main(spec, case, tp, pp)
    ours = params(load_dist(case, tp, spec["ours"]))
    if spec.get("reference"):
        same(ours, params(load_dist(case, tp, spec["reference"])), "dist_checkpointing.load")
    else:
        no_nan(ours, "dist_checkpointing.load")
    lm = load_megatron_lm(case, tp, spec["ours"])
    same(params(lm), ours, "load_checkpoint --finetune")
    if spec.get("hf_logits"):
        check_logits(lm, spec["hf_logits"], tp)
    finish()


if __name__ == "__main__":
    main()
