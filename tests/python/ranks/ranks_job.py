"""One rank of a torchrun job (gloo, CPU) that calls statekit.ckpt's operations on every rank,
as one operation over the job (the default process group), writing under OUT/ranks/.

    torchrun --nproc-per-node N tests/python/ranks/ranks_job.py SRC_FILE DCP_DIR OUT_DIR
"""

import json
import os
import sys

import torch.distributed as dist

from statekit import ckpt


def main(src, dcp, out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    o = os.path.join(out, "ranks")
    done = {
        "split": ckpt.split(src, os.path.join(o, "split"), max_shard_size="3MB").document,
        "merge": ckpt.merge(os.path.join(out, "one", "split"), os.path.join(o, "merged.safetensors")).document,
        "reshard": ckpt.reshard(dcp, os.path.join(o, "reshard"), 3).document,
        "convert": ckpt.convert(src, os.path.join(o, "model.bin"), to="torch").document,
    }
    # An explicit group: the same operation over a group that is the whole world.
    group = dist.new_group(list(range(dist.get_world_size())))
    done["merge_group"] = ckpt.merge(dcp, os.path.join(o, "dcp.safetensors"), group=group).document
    if rank == 0:
        with open(os.path.join(out, "documents.json"), "w") as f:
            json.dump(done, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
