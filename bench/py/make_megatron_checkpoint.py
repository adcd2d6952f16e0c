"""The Megatron-Core `torch_dist` benchmark checkpoint (about 1 GB of bf16), written by real
megatron-core 0.19.2 on CPU: one rank's writer (under torchrun), and the helpers that make it once
and check a merge of it against megatron's own one-rank load.

    PYTHONPATH=/opt/mcore torchrun --standalone --nproc_per_node 2 \
        bench/py/make_megatron_checkpoint.py OUT_DIR LAYERS              # one rank (the writer)
    python bench/py/make_megatron_checkpoint.py --ensure BASE [--layers 7]   # BASE/ckpt if missing
    python bench/py/make_megatron_checkpoint.py --check MERGED.safetensors BASE

megatron-core is not in the venv; it is unpacked, pure Python, into /opt/mcore (override with
MCORE_PATH), as for the fixture generators (fixtures/gen/megatron_fixtures.py):

    pip install --python-version 3.12 --ignore-requires-python --no-deps --target /opt/mcore \
        megatron-core==0.19.2

(the venv's Python is 3.11; fixtures/gen/megatron_cpu.py supplies the one 3.12 name megatron
imports). No GPU: megatron_cpu.install() patches the few CUDA-only calls megatron makes on the
model / dist_checkpointing paths; what lands on disk is megatron's and torch's own bytes.

The writer: 2 gloo ranks, tensor parallel 2 (pipeline 1), megatron's GPTModel with the local
layer spec, `use_cpu_initialization=True` (each rank draws the full fp32 master weight of a layer
from torch's CPU generator and keeps its TP slice, so init peaks at one master weight, 262 MB for
the embedding), bf16 params (cast with Float16Module, as Megatron-LM does): hidden 2048, FFN 8192
(GELU), 16 heads, vocab 32000, LayerNorm, linear biases, rope, untied output layer. One layer is
50.37 M params (100.7 MB), the embedding and the output layer 65.5 M each (131.1 MB each), so
LAYERS=7 stores 0.967 GB of tensors. Then
`megatron.core.dist_checkpointing.save(model.sharded_state_dict(), BASE/ckpt)`: megatron's default
torch_dist strategy, a DCP folder (`__R_K.distcp`, `.metadata`) plus `metadata.json`; replicated
tensors (norms, row-parallel biases) are stored once, the layers stacked per key.

The model building is fixtures/gen/megatron_worker.py's (`init_parallel`, `build_model`; biases
and norms get seeded values too), and `--check` runs that worker's `load` mode: 1 rank builds the
same architecture unsharded, `dist_checkpointing.load`s the checkpoint and writes its
`model.state_dict()` (minus `_extra_state`) to BASE/ref.safetensors, which a merge must equal
tensor for tensor.
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GEN = os.path.join(ROOT, "fixtures", "gen")
MCORE = os.environ.get("MCORE_PATH", "/opt/mcore")
WORLD = 2
LAYERS = 7
# fixtures/gen/megatron_worker.py's case fields
CASE = {"hidden": 2048, "ffn": 8192, "heads": 16, "query_groups": 16, "vocab": 32000, "seq_len": 4096,
        "swiglu": False, "tied": False, "dtype": "bfloat16", "norms_dtype": None, "normalization": "LayerNorm",
        "bias_linear": True, "position_embedding": "rope", "tp": WORLD, "pp": 1, "seed": 77}


def checkpoint_dir(base):
    return os.path.join(base, "ckpt")


def reference_path(base):
    return os.path.join(base, "ref.safetensors")


def available():
    return os.path.isdir(os.path.join(MCORE, "megatron", "core"))


# ------------------------------------------------------------------------------ one rank


def worker(out, layers):
    sys.path[:0] = [MCORE, GEN]
    import warnings

    warnings.filterwarnings("ignore")
    import megatron_cpu  # before anything imports megatron

    megatron_cpu.install()
    import megatron_worker
    import torch
    from megatron.core import dist_checkpointing

    case = dict(CASE, layers=layers)
    megatron_worker.init_parallel(case["tp"], case["pp"])
    model = megatron_worker.build_model(case, case["tp"], case["pp"])
    rank = torch.distributed.get_rank()
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"rank {rank}: {local / 1e9:.3f} GB of local parameters", flush=True)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------ helpers


def tool_env(env=None):
    env = dict(env or os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join([MCORE, GEN] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def torchrun(nproc, args, cwd, env=None):
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node",
                    str(nproc), *args], check=True, cwd=cwd, env=tool_env(env))


def ensure(base, layers=LAYERS, env=None):
    """Writes BASE/ckpt with 2 torchrun ranks unless its `metadata.json` (megatron's last file)
    is there. Returns the checkpoint folder."""
    import shutil

    if not available():
        raise SystemExit(f"megatron-core is not at {MCORE}; see bench/py/make_megatron_checkpoint.py")
    base = os.path.abspath(base)
    src = checkpoint_dir(base)
    if not os.path.exists(os.path.join(src, "metadata.json")):
        print(f"writing {src} with megatron-core dist_checkpointing (GPTModel, TP 2 on 2 gloo ranks, {layers} "
              "layers, bf16) ...", file=sys.stderr, flush=True)
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
        with open(os.path.join(base, "case.json"), "w") as f:
            json.dump(dict(CASE, layers=layers), f, indent=1)
        # cwd = BASE, so the checkpoint id torch records is the relative "ckpt" (as in the fixtures)
        torchrun(WORLD, [os.path.abspath(__file__), "ckpt", str(layers)], cwd=base, env=env)
    return src


def reference(base):
    """BASE/ref.safetensors, megatron's one-rank load of BASE/ckpt (written unless there)."""
    base = os.path.abspath(base)
    ref = reference_path(base)
    if not os.path.exists(ref):
        print(f"writing {ref} with megatron's dist_checkpointing.load at tp=1 ...", file=sys.stderr, flush=True)
        case = json.load(open(os.path.join(base, "case.json")))
        spec = os.path.join(base, "load-spec.json")
        with open(spec, "w") as f:
            json.dump({"mode": "load", "case": dict(case, tp=1, pp=1), "ckpt": "ckpt", "out": ref + ".part",
                       "out_extra": os.path.join(base, "ref_extra.json")}, f)
        torchrun(1, [os.path.join(GEN, "megatron_worker.py"), spec], cwd=base)
        os.replace(ref + ".part", ref)
    return ref


def check(merged, base):
    """True when the safetensors file `merged` holds exactly the tensors megatron's one-rank load
    of BASE/ckpt gives (BASE/ref.safetensors, written once): names, dtypes, shapes, bytes."""
    import torch
    from safetensors import safe_open

    with safe_open(reference(base), "pt") as r, safe_open(merged, "pt") as g:
        if set(r.keys()) != set(g.keys()):
            print(f"FAIL: names differ: only in the merge {sorted(set(g.keys()) - set(r.keys()))[:5]}, "
                  f"only in megatron's load {sorted(set(r.keys()) - set(g.keys()))[:5]}", flush=True)
            return False
        ok, total, n = True, 0, len(r.keys())
        for k in sorted(r.keys()):
            x, y = g.get_tensor(k), r.get_tensor(k)
            total += y.numel() * y.element_size()
            if not (x.dtype == y.dtype and x.shape == y.shape and
                    torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))):
                print(f"FAIL: {k}: merge {x.dtype} {tuple(x.shape)}, megatron {y.dtype} {tuple(y.shape)}", flush=True)
                ok = False
    print(f"{'PASS' if ok else 'FAIL'}: {merged} equals megatron's one-rank load tensor for tensor "
          f"({n} tensors, {total / 1e9:.3f} GB, bytes compared)", flush=True)
    return ok


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--ensure":
        layers = int(sys.argv[sys.argv.index("--layers") + 1]) if "--layers" in sys.argv else LAYERS
        print(ensure(sys.argv[2], layers))
    elif len(sys.argv) == 4 and sys.argv[1] == "--check":
        sys.exit(0 if check(sys.argv[2], sys.argv[3]) else 1)
    elif len(sys.argv) == 3:
        worker(sys.argv[1], int(sys.argv[2]))
    else:
        raise SystemExit(__doc__)
