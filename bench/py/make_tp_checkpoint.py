"""The FSDP2 + tensor-parallel DCP benchmark checkpoint: writer (one rank under torchrun), and the
helpers the benchmarks use to make it once, make torch's reference merge of it, and check a merge
against that reference.

    torchrun --standalone --nproc_per_node 4 bench/py/make_tp_checkpoint.py OUT_DIR LAYERS
    python bench/py/make_tp_checkpoint.py --ensure BASE [--layers 3]      # write BASE/dcp if missing
    python bench/py/make_tp_checkpoint.py --check MERGED.safetensors BASE  # compare with BASE/ref.pt

The writer: gloo on CPU, a (dp=2, tp=2) `init_device_mesh`, a bf16 toy transformer of LAYERS
blocks (dim 4096, FFN 8192: wq, wk, wv, wo of 4096x4096 and w1, w3 of 8192x4096, w2 of 4096x8192,
two RMSNorm weights; 320 MiB a block, so 3 blocks are 1.007 GB), made tensor parallel on the "tp"
dim with `parallelize_module` (wq/wk/wv/w1/w3 `ColwiseParallel`: weights Shard(0); wo/w2
`RowwiseParallel`: weights Shard(1)) and then `fully_shard` on the "dp" dim (each block, then the
root). The state dict's placements on (dp, tp) are then:

- colwise weights: (_StridedShard(0, split_factor=2), Shard(0)): each rank holds a block of
  whole rows, one contiguous run per chunk;
- rowwise weights: (Shard(0), Shard(1)): each rank holds a [rows/2, cols/2] box, so a row of the
  merged tensor is two runs of cols/2 elements (4 KiB for wo, 8 KiB for w2), from two ranks' files;
- wq's bias (Shard(0) on tp) and the norms (Shard(0) on dp, replicated on tp: DCP saves one copy).

The model is built on the meta device, parallelized and sharded, then only the local shards are
materialized (`to_empty`) and filled, so each rank holds a quarter of the model. Every local shard
is filled from a generator seeded by the tensor and the shard's coordinates on the non-replicated
mesh dims, so replicas are equal, as in training. `get_model_state_dict(model)` (flat FQNs, as
torchtitan saves) goes to OUT_DIR/dcp with `dcp.save`.

The reference is torch's own merge, `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`
of that folder, kept as BASE/ref.pt.
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DIM = 4096
HIDDEN = 8192
LAYERS = 3
WORLD = 4


def checkpoint_dir(base):
    return os.path.join(base, "dcp")


def reference_path(base):
    return os.path.join(base, "ref.pt")


# ------------------------------------------------------------------------------ one rank


def build(layers):
    import torch
    import torch.nn as nn

    class RMSNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq = nn.Linear(DIM, DIM, bias=True)
            self.wk = nn.Linear(DIM, DIM, bias=False)
            self.wv = nn.Linear(DIM, DIM, bias=False)
            self.wo = nn.Linear(DIM, DIM, bias=False)

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
            self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
            self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm = RMSNorm(DIM)
            self.attention = Attention()
            self.ffn_norm = RMSNorm(DIM)
            self.feed_forward = FeedForward()

    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
    model.norm = RMSNorm(DIM)
    return model


def worker(out, layers):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world != WORLD:
        raise SystemExit(f"run under torchrun --nproc_per_node {WORLD} (got {world})")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = build(layers).to(torch.bfloat16)
    plan = {}
    for i in model.layers:
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for n, (name, p) in enumerate(model.named_parameters()):
            local = p.to_local()
            if not local.numel():
                continue
            # Replicas (Replicate on a mesh dim) get the same seed, hence the same values.
            coord = p.device_mesh.get_coordinate()  # (dp, tp), or (dp,) for a tensor only FSDP shards
            key = [c + 1 if not isinstance(pl, Replicate) else 0 for c, pl in zip(coord, p.placements)]
            gen = torch.Generator().manual_seed(1000 * n + sum(k * 10**d for d, k in enumerate(key)))
            local.copy_(torch.randn(local.shape, generator=gen, dtype=torch.float32).to(local.dtype))
    sd = get_model_state_dict(model)
    if dist.get_rank() == 0:
        for k, v in list(sd.items())[:12]:
            print(f"  {k}: {tuple(v.shape)} {v.dtype} placements {v.placements} local {tuple(v.to_local().shape)}",
                  flush=True)
    dcp.save(sd, checkpoint_id=checkpoint_dir(out))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


# ------------------------------------------------------------------------------ helpers


def ensure(base, layers=LAYERS, env=None):
    """Writes BASE/dcp with 4 torchrun ranks unless its `.metadata` is there, and BASE/ref.pt
    (torch's `dcp_to_torch_save` of it) unless that is there. Returns the DCP folder."""
    import shutil

    src = checkpoint_dir(base)
    bindir = os.path.dirname(sys.executable)
    env = dict(env or os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if not os.path.exists(os.path.join(src, ".metadata")):
        print(f"writing {src} with torch DCP (FSDP2 + TP, dp=2 x tp=2 gloo ranks) ...", file=sys.stderr, flush=True)
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
        subprocess.run([os.path.join(bindir, "torchrun"), "--standalone", "--nproc_per_node", str(WORLD),
                        os.path.abspath(__file__), base, str(layers)], check=True, env=env)
    ref = reference_path(base)
    if not os.path.exists(ref):
        print(f"writing {ref} with torch's dcp_to_torch_save ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-c",
                        "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                        "dcp_to_torch_save(sys.argv[1], sys.argv[2])", src, ref + ".part"], check=True, env=env)
        os.replace(ref + ".part", ref)
    return src


def tensors(path):
    """name -> tensor of a safetensors file or a torch.save file (mapped, not read)."""
    import torch

    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def check(merged, base, what="`ckpt merge` output"):
    """True when the file `merged` (safetensors or torch.save) holds exactly the tensors of
    BASE/ref.pt: the same names, dtypes, shapes and bytes. Prints what differs."""
    import torch

    ref, got = tensors(reference_path(base)), tensors(merged)
    if set(got) != set(ref):
        print(f"FAIL: names differ: only in {what} {sorted(set(got) - set(ref))[:5]}, "
              f"only in dcp_to_torch_save's {sorted(set(ref) - set(got))[:5]}", flush=True)
        return False
    ok = True
    for k in sorted(got):
        x, y = got[k], ref[k]
        same = x.dtype == y.dtype and x.shape == y.shape and \
            torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))
        if not same:
            print(f"FAIL: {k}: {what} {x.dtype} {tuple(x.shape)}, dcp_to_torch_save {y.dtype} {tuple(y.shape)}",
                  flush=True)
            ok = False
    print(f"{'PASS' if ok else 'FAIL'}: {what} equals dcp_to_torch_save's tensor for tensor "
          f"({len(got)} tensors, bytes compared)", flush=True)
    return ok


def layout(src):
    """The checkpoint's layout from its `.metadata`: per tensor the global shape, dtype, chunk
    boxes, and the row run a row-major merge reads (the inner length of the chunks)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(src).read_metadata()
    rows = []
    for k, v in md.state_dict_metadata.items():
        if not isinstance(v, TensorStorageMetadata):
            continue
        elem = torch.empty((), dtype=v.properties.dtype).element_size()
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]
        inner = min(c[1][-1] for c in chunks) if v.size else 1
        split_dims = sorted({d for o, s in chunks for d in range(len(s)) if s[d] != v.size[d]})
        rows.append((k, tuple(v.size), str(v.properties.dtype).replace("torch.", ""), len(chunks), split_dims,
                     inner * elem, inner == v.size[-1] if v.size else True))
    return rows


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
