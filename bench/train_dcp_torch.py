"""torch's side of bench/train_bench.py, run under `torchrun --nproc_per_node W` (gloo, CPU):
an FSDP2 model with the parameter shapes of a statekit-train checkpoint and an AdamW state of
the same shapes, saved the way accelerate's `save_state` saves FSDP2 (`dcp.save` of
`{"model": ...}` into `pytorch_model_fsdp_0/`, of `{"optimizer": ...}` into `optimizer_0/`), then
loaded back with `dcp.load`. Prints one JSON line (rank 0): median save and load seconds over
the repeats, and the peak RSS of each rank."""

import argparse
import json
import resource
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard


class Flat(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.names = sorted(shapes)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(shapes[n])) for n in self.names])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", required=True, help="merged model.safetensors of the statekit checkpoint")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with safe_open(a.reference, "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    torch.manual_seed(0)
    model = Flat(shapes)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = sum((p.to_local() ** 2).sum() for p in model.parameters())
    loss.backward()
    opt.step()
    saves, loads = [], []
    for i in range(a.repeats):
        d = f"{a.out}/run{i}"
        dist.barrier()
        t = time.perf_counter()
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{d}/pytorch_model_fsdp_0")
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=f"{d}/optimizer_0")
        dist.barrier()
        saves.append(time.perf_counter() - t)
        t = time.perf_counter()
        msd = {"model": get_model_state_dict(model)}
        dcp.load(msd, checkpoint_id=f"{d}/pytorch_model_fsdp_0")
        osd = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(osd, checkpoint_id=f"{d}/optimizer_0")
        dist.barrier()
        loads.append(time.perf_counter() - t)
        if rank == 0 and i + 1 < a.repeats:
            shutil.rmtree(d, ignore_errors=True)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], dtype=torch.int64)
    all_rss = [torch.zeros_like(rss) for _ in range(dist.get_world_size())]
    dist.all_gather(all_rss, rss)
    if rank == 0:
        print(json.dumps({"save_s": statistics.median(saves), "load_s": statistics.median(loads),
                          "peak_rss_kib": [int(r.item()) for r in all_rss]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
