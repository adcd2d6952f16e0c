"""One rank of a torchrun job (gloo, CPU) in which one rank's part of `save_sharded` fails, then
every rank saves again; each rank writes what each call raised to OUT_DIR/raisedR.json.

    torchrun --nproc-per-node N tests/python/sharded_failure_job.py OUT_DIR
"""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from statekit import _native, ckpt
from statekit._dist import TorchCollective


def attempt(call):
    try:
        call()
        return {"ok": True}
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return {
            "ok": False,
            "class": type(e).__name__,
            "bases": [c.__name__ for c in type(e).__mro__],
            "variant": getattr(e, "variant", ""),
            "rank": getattr(e, "rank", None),
            "cause": getattr(e, "cause", None),
            "message": str(e),
        }


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = TorchCollective(rank, world)
    # Rank 1's slice of its tensor is not whole rows: only rank 1 sees it, while laying out its file.
    data = np.ones(5 if rank == 1 else 6, dtype=np.float32).tobytes()
    tensors = [(["model", f"w{rank}"], "F32", [2, 3], 0, data)]
    done = {
        "tensor": attempt(lambda: _native.save_sharded(os.path.join(out, "tensor"), tensors, [], comm)),
        # Rank 1 names another destination: refused when the ranks claim it.
        "destination": attempt(
            lambda: ckpt.save_sharded({"w": torch.ones(2)}, os.path.join(out, f"dest{min(rank, 1)}"), rank=rank, world_size=world)
        ),
        # The ranks are still in step.
        "after": attempt(
            lambda: ckpt.save_sharded({"w": torch.ones(2)}, os.path.join(out, "after"), rank=rank, world_size=world)
        ),
    }
    with open(os.path.join(out, f"raised{rank}.json"), "w") as f:
        json.dump(done, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # As in bindings_sharded_job.py: torch 2.13's gloo teardown at exit can abort; all is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
