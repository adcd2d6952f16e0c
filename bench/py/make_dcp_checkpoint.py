"""One rank of the DCP benchmark checkpoint writer (launched by bench/dcp_bench.py via torchrun).

    torchrun --standalone --nproc_per_node 2 bench/py/make_dcp_checkpoint.py OUT_DIR LAYERS

Writes accelerate's FSDP layout, OUT_DIR/pytorch_model_fsdp_0/, with real torch DCP from an FSDP2
model on gloo/CPU: a bf16 transformer-shaped stack (embedding of 50257 rows, which no world size
divides, and LAYERS blocks of 96 MiB). The model is created on the meta device, sharded, and only
the local shards are materialized, so each rank holds half of the model.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

HIDDEN = 2048
VOCAB = 50257


def block():
    m = torch.nn.Module()
    m.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=True)
    m.proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=True)
    m.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
    m.down = torch.nn.Linear(4 * HIDDEN, HIDDEN, bias=False)
    m.norm = torch.nn.LayerNorm(HIDDEN)
    return m


def main():
    out, layers = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = torch.nn.Module()
        model.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        model.layers = torch.nn.ModuleList([block() for _ in range(layers)])
        model.final_norm = torch.nn.LayerNorm(HIDDEN)
    model = model.to(torch.bfloat16)
    for b in model.layers:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            if local.numel():
                local.copy_(torch.randn(local.shape, generator=gen, dtype=torch.float32).to(local.dtype))
    sd = get_model_state_dict(model)
    dcp.save({"model": sd}, checkpoint_id=os.path.join(out, "pytorch_model_fsdp_0"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
