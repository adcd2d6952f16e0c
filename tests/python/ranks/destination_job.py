"""One rank of a torchrun job (gloo, CPU) whose ranks are given different destinations for one
`statekit.ckpt.split`: each rank records what it raised, as JSON in OUT_DIR/raised_RANK.json.

    torchrun --nproc-per-node 2 tests/python/ranks/destination_job.py SRC_FILE OUT_DIR
"""

import json
import os
import sys

import torch.distributed as dist

from statekit import ckpt


def main(src, out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    raised = None
    try:
        ckpt.split(src, os.path.join(out, f"split{rank}"), max_shard_size="1KB")
    except Exception as e:  # noqa: BLE001 - what was raised is the result
        raised = {"class": type(e).__name__, "message": str(e), "fields": {k: getattr(e, k, None) for k in ("path", "rank", "other")}}
    with open(os.path.join(out, f"raised_{rank}.json"), "w") as f:
        json.dump(raised, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
