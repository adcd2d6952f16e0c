"""One rank of a torchrun job (gloo, CPU) in which rank 1 fails alone inside
`statekit.ckpt.merge`, twice, then every rank merges again; each rank writes what each call
did to OUT_DIR/rankR.json.

    torchrun --nproc-per-node N tests/python/ranks/rank_failure_job.py SRC_FILE OUT_DIR
"""

import json
import os
import sys

import torch.distributed as dist

from statekit import ckpt
from statekit.errors import StatekitError


def attempt(call):
    try:
        call()
        return {"ok": True}
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return {
            "ok": False,
            "statekit": isinstance(e, StatekitError),
            "variant": getattr(e, "variant", ""),
            "message": str(e),
        }


def main(src, out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    missing = os.path.join(out, "missing.safetensors")
    done = {
        # Rank 1's source is not there: it fails opening it.
        "open": attempt(lambda: ckpt.merge(missing if rank == 1 else src, os.path.join(out, "open.safetensors"))),
        # Rank 1 asks for what its source cannot give (a model of a `save_state` folder):
        # refused while planning, when the other ranks have gone on to write. (Not `optimizer`:
        # that names a second destination, which the ranks' agreement on the destination
        # refuses before planning.)
        "plan": attempt(
            lambda: ckpt.merge(src, os.path.join(out, "plan.safetensors"), model=0 if rank == 1 else None)
        ),
        # The ranks are still in step.
        "after": attempt(lambda: ckpt.merge(src, os.path.join(out, "after.safetensors"))),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(done, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
