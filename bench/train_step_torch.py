"""torch's step time on statekit-train's model, run by bench/train_bench.py under
`torchrun --nproc_per_node W` (gloo, CPU).

The model is the one `train/src/model.rs` builds, re-stated in torch: token and position
embeddings, pre-norm blocks (LayerNorm, one `c_attn` linear to q/k/v, causal
`scaled_dot_product_attention`, `c_proj`; LayerNorm, `c_fc`, exact GELU, `c_proj`), a final
LayerNorm and a head tied to the token embedding; weights N(0, 0.02), biases 0, no dropout,
f32. With `--reference` (a merged statekit checkpoint) the parameter names and shapes are
checked against it before anything is timed, so both sides are known to train the same tensors.

One step does what a torch user would write for the same job, mode by mode:
- `ddp`: `DistributedDataParallel` (the gradient all-reduce, averaged, overlapped with the
  backward pass in buckets), then `clip_grad_norm_` and `AdamW.step` on the whole model;
- `sharded`: FSDP2, `fully_shard` on the root module only, so that, like statekit's sharded
  mode, a step all-gathers the whole model once before the forward pass and reduce-scatters
  the whole gradient once after the backward pass; `clip_grad_norm_` (an all-reduce of the
  squared norm) and `AdamW.step` on the rank's dim-0 chunks.
Both then all-reduce the step's loss and token count (statekit's log line needs them too). The
learning rate follows statekit's schedule (linear warmup, cosine to a tenth), AdamW has its
hyper-parameters (betas 0.9/0.95, eps 1e-8, weight decay 0.1), the clip norm is 1.0, and each
rank runs one intra-op thread (`--threads`, statekit's default). Batches are random windows of
the same token file (`--data`), `--batch-size` windows of `--block-size` tokens per rank.

Prints one JSON line (rank 0): every step's wall time on rank 0, and the medians of its parts.
"""

import argparse
import json
import math
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(d, 3 * d)
        self.attn.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(d, 4 * d)
        self.mlp.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(d, 2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(a.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, block_size, layers, heads, dim):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        for name, p in self.named_parameters():
            if name.endswith(".bias") and "ln_" not in name:
                nn.init.zeros_(p)
            elif "ln_" not in name:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for blk in self.h:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def check_reference(model, path):
    """Refuses to time a model whose parameters are not the statekit checkpoint's."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        theirs = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    ours = {k: tuple(p.shape) for k, p in model.named_parameters()}
    if ours != theirs:
        only = sorted(set(ours.items()) ^ set(theirs.items()))[:6]
        raise SystemExit(f"{path}: the torch model's parameters differ from the checkpoint's: {only}")


def lr_at(step, lr, warmup, total):
    """statekit's schedule (train/src/optim.rs `Schedule::at`), step from 0."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return lr / 10
    frac = (step - warmup) / max(total - warmup, 1)
    return lr / 10 + 0.5 * (1 + math.cos(math.pi * frac)) * (lr - lr / 10)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "sharded"], required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--data", required=True, help="the u16 token file statekit-train read")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reference", help="merged model.safetensors of a statekit checkpoint of this model")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = Gpt(a.vocab, a.block_size, a.layers, a.heads, a.dim)
    if a.reference:
        check_reference(model, a.reference)
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = torch.from_numpy(np.fromfile(a.data, dtype="<u2").astype(np.int64))
    windows = (len(tokens) - 1) // a.block_size
    g = torch.Generator().manual_seed(1234 + rank)

    steps, data, fwd_bwd, opt_t = [], [], [], []
    for step in range(a.steps):
        t0 = time.perf_counter()
        starts = torch.randint(windows, (a.batch_size,), generator=g) * a.block_size
        rows = starts[:, None] + torch.arange(a.block_size + 1)
        x, y = tokens[rows[:, :-1]], tokens[rows[:, 1:]]
        t1 = time.perf_counter()
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        t2 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.lr, a.warmup, a.steps)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sums = torch.tensor([loss.item(), float(x.numel())], dtype=torch.float64)
        dist.all_reduce(sums)
        t3 = time.perf_counter()
        steps.append(t3 - t0)
        data.append(t1 - t0)
        fwd_bwd.append(t2 - t1)
        opt_t.append(t3 - t2)
    if rank == 0:
        print(json.dumps({"mode": a.mode, "world": world, "threads": torch.get_num_threads(),
                          "steps_s": steps, "median_step_s": statistics.median(steps),
                          "median_data_s": statistics.median(data), "median_fwd_bwd_s": statistics.median(fwd_bwd),
                          "median_opt_s": statistics.median(opt_t), "last_loss": sums[0].item() / world,
                          "adamw": {k: opt.defaults[k] for k in ("foreach", "fused")}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
