"""One rank of a torchrun job (gloo, CPU) that trains an FSDP2 model a step and saves it with
statekit.ckpt.save_sharded; rank 0 also writes the full state dict it gathered, for the test.

    torchrun --nproc-per-node W tests/python/bindings/bindings_sharded_job.py OUT_DIR
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from statekit import ckpt


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    model.register_buffer("step", torch.tensor(3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sd = model.state_dict()
    result = ckpt.save_sharded({"model": sd}, os.path.join(out, "ckpt"), rank=rank, world_size=world)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}
    if rank == 0:
        torch.save({"full": full, "files": result.files}, os.path.join(out, "expected.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # torch 2.13's gloo teardown at interpreter exit aborts about one run in eight on this
    # machine ("terminate called without an active exception", also without statekit: checked
    # with the save removed); everything is written and the group destroyed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
