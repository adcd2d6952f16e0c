"""The Megatron-LM mixture-of-experts benchmark run (about 1 GB of bf16), written by real
megatron-core 0.19.2 on CPU, and the check that a `ckpt convert --to hf` of it holds megatron's own
one-rank tensors under the Hub's names.

    python bench/py/make_megatron_moe_checkpoint.py --ensure BASE        # BASE/run if missing
    python bench/py/make_megatron_moe_checkpoint.py --check HF_DIR BASE  # HF_DIR against BASE/ref

megatron-core is unpacked at /opt/mcore (override with MCORE_PATH), as for
bench/py/make_megatron_checkpoint.py, whose docstring has the pip command.

The run: a Qwen2-MoE-style GPTModel (the shape of DeepSeek-style MoE models at small scale: a dense
first layer, then MoE layers with a gated shared expert; QKV bias, which Qwen2-MoE has): 5 layers
(`--moe-layer-freq [0,1,1,1,1]`), hidden 2048, 16 heads in 4 query groups (head dim 128), dense
FFN 5632, 8 routed experts of FFN 1408 (top 2) and a shared expert of FFN 1408, vocab 32000,
untied output layer, RMSNorm, SwiGLU, rope; bf16 parameters. 528 M parameters, 1.057 GB.

It is written the way the MoE fixtures are (fixtures/gen/megatron_moe_fixtures.py, with its worker
fixtures/gen/megatron_moe_worker.py): Megatron-LM's own parse_args/validate_args from the command
line, get_model with the MoE layer spec (SequentialMLP experts, local spec), then Megatron-LM's
`save_checkpoint` (torch_dist), on 2 gloo ranks at expert parallel 2, the worker's `save_only` mode
(no training, no optimizer: Adam's state would triple the bytes and the conversion does not read
it). `save_checkpoint` is what saves the `args` that `--to hf` reads the architecture from; a bare
`dist_checkpointing.save` would not. BASE/run is the Megatron-LM run folder
(`latest_checkpointed_iteration.txt`, `iter_0000002/`).

The reference, BASE/ref.safetensors: the worker's `logits` mode at world size 1 (EP 1) builds the
same model, `dist_checkpointing.load`s the run and writes megatron's `state_dict()` (minus
`_extra_state`). `--check` re-derives the Hub's tensors from it with
tests/python/interop/test_megatron_to_hf.py's `hub_names` (independent of the Rust tables) and
compares them with the converted folder, names, dtypes and bytes.
"""

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GEN = os.path.join(ROOT, "fixtures", "gen")
MCORE = os.environ.get("MCORE_PATH", "/opt/mcore")
WORLD = 2
ITERATION = 2
CASE = {"layers": 5, "layer_freq": [0, 1, 1, 1, 1], "hidden": 2048, "heads": 16, "query_groups": 4, "ffn": 5632,
        "experts": 8, "topk": 2, "moe_ffn": 1408, "shared_ffn": 1408, "vocab": 32000, "seq_len": 4096,
        "ep": WORLD, "seed": 4242}


def argv(c, ep):
    """Megatron-LM's command line for the run at expert parallel `ep` (the world size)."""
    return [
        "--num-layers", str(c["layers"]), "--hidden-size", str(c["hidden"]),
        "--ffn-hidden-size", str(c["ffn"]), "--num-attention-heads", str(c["heads"]),
        "--group-query-attention", "--num-query-groups", str(c["query_groups"]),
        "--seq-length", str(c["seq_len"]), "--max-position-embeddings", str(c["seq_len"]),
        "--vocab-size", str(c["vocab"]), "--make-vocab-size-divisible-by", "128",
        "--tokenizer-type", "NullTokenizer",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--expert-model-parallel-size", str(ep),
        "--num-experts", str(c["experts"]), "--moe-router-topk", str(c["topk"]),
        "--moe-ffn-hidden-size", str(c["moe_ffn"]),
        "--moe-token-dispatcher-type", "allgather", "--moe-router-load-balancing-type", "none",
        "--moe-aux-loss-coeff", "0",
        "--micro-batch-size", "1", "--global-batch-size", str(ep),
        "--train-iters", str(ITERATION), "--lr", "1e-4", "--min-lr", "1e-5", "--save-interval", str(ITERATION),
        "--swiglu", "--disable-bias-linear", "--add-qkv-bias", "--untie-embeddings-and-output-weights",
        "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
        "--position-embedding-type", "rope", "--rotary-base", "1000000",
        "--moe-router-pre-softmax", "--moe-layer-freq", json.dumps(c["layer_freq"]).replace(" ", ""),
        "--moe-shared-expert-intermediate-size", str(c["shared_ffn"]), "--moe-shared-expert-gate",
        "--bf16", "--init-method-std", "0.02",
        "--ckpt-format", "torch_dist",
        "--use-cpu-initialization", "--transformer-impl", "local",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", str(c["seed"]),
    ]


def available():
    return os.path.isdir(os.path.join(MCORE, "megatron", "core"))


def run_dir(base):
    return os.path.join(base, "run")


def reference_path(base):
    return os.path.join(base, "ref.safetensors")


def torchrun(nproc, spec, cwd, base, env=None):
    path = os.path.join(base, f"spec-{spec['mode']}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(env or os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join([MCORE, GEN] + [p for p in [env.get("PYTHONPATH")] if p])
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node",
                    str(nproc), os.path.join(GEN, "megatron_moe_worker.py"), path], check=True, cwd=cwd, env=env)


def ensure(base, env=None):
    """Writes BASE/run with 2 torchrun ranks unless its `latest_checkpointed_iteration.txt`
    (Megatron-LM's last file) is there. Returns the run folder."""
    if not available():
        raise SystemExit(f"megatron-core is not at {MCORE}; see bench/py/make_megatron_checkpoint.py")
    base = os.path.abspath(base)
    run = run_dir(base)
    if not os.path.exists(os.path.join(run, "latest_checkpointed_iteration.txt")):
        print(f"writing {run} with Megatron-LM save_checkpoint (Qwen2-MoE-style GPTModel, EP 2 on 2 gloo ranks, "
              "bf16) ...", file=sys.stderr, flush=True)
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(run)
        with open(os.path.join(base, "case.json"), "w") as f:
            json.dump(dict(CASE, argv=argv(CASE, WORLD)), f, indent=1)
        torchrun(WORLD, {"mode": "save_only", "argv": argv(CASE, WORLD) + ["--save", "."], "save": ".",
                         "iteration": ITERATION}, run, base, env)
    return run


def reference(base):
    """BASE/ref.safetensors, megatron's one-rank (EP 1) load of BASE/run (written unless there)."""
    base = os.path.abspath(base)
    ref = reference_path(base)
    if not os.path.exists(ref):
        print(f"writing {ref} with megatron's dist_checkpointing.load at EP 1 ...", file=sys.stderr, flush=True)
        torchrun(1, {"mode": "logits", "argv": argv(CASE, 1), "ckpt": f"iter_{ITERATION:07d}", "out": ref + ".part",
                     "out_extra": os.path.join(base, "ref_extra.json"),
                     "logits": os.path.join(base, "ref_logits.safetensors"),
                     "tokens": [[1, 5, 9, 17, 23, 2, 20, 7]]}, run_dir(base), base)
        os.replace(ref + ".part", ref)
    return ref


def check(hf_dir, base):
    """True when the converted folder HF_DIR holds exactly megatron's one-rank tensors of
    BASE/run under the Hub's names (every name, dtype, shape and byte), and transformers loads it
    with no missing or unexpected keys."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    sys.path.insert(0, os.path.join(ROOT, "tests", "python", "interop"))
    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    from test_megatron_to_hf import hub_names

    config = json.load(open(os.path.join(hf_dir, "config.json")))
    expected = hub_names(load_file(reference(base)), config)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else \
        ["model.safetensors"]
    written, ok = {}, True
    for name in files:
        with safe_open(os.path.join(hf_dir, name), "pt") as f:
            for k in f.keys():
                written[k] = (name, f.get_slice(k).get_shape())
    if set(written) != set(expected):
        print(f"FAIL: names differ: only written {sorted(set(written) - set(expected))[:5]}, "
              f"only expected {sorted(set(expected) - set(written))[:5]}", flush=True)
        return False
    total = 0
    for name in files:
        with safe_open(os.path.join(hf_dir, name), "pt") as f:
            for k in f.keys():
                x, y = f.get_tensor(k), expected[k]
                total += y.numel() * y.element_size()
                if not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
                    print(f"FAIL: {k}: written {x.dtype} {tuple(x.shape)}, megatron {y.dtype} {tuple(y.shape)}")
                    ok = False
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        print(f"FAIL: transformers loads it with {bad}", flush=True)
        ok = False
    print(f"{'PASS' if ok else 'FAIL'}: {hf_dir} ({config['model_type']}, {config['architectures']}) holds megatron's "
          f"one-rank tensors under the Hub's names ({len(expected)} tensors, {total / 1e9:.3f} GB, bytes compared); "
          f"transformers {transformers.__version__} loads it as {type(model).__name__}"
          + ("" if bad else " with no missing or unexpected keys"), flush=True)
    return ok


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--ensure":
        print(ensure(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "--check":
        sys.exit(0 if check(sys.argv[2], sys.argv[3]) else 1)
    else:
        raise SystemExit(__doc__)
