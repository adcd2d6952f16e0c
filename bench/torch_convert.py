"""Benchmark: `ckpt convert pytorch_model.bin model.safetensors` against the Python path users
take today (`torch.load` + `safetensors.torch.save_file`), on a torch file of at least 2 GiB.

Usage: bench/torch_convert.sh [GIB] (writes bench/RESULTS-torch.md). Not part of the tests.
This script has two roles: `make FILE GIB` writes the input, `python SRC DST` is the baseline.
"""

import sys
import time


def make(path, gib):
    import torch

    g = torch.Generator().manual_seed(0)
    sd = {}
    total = 0
    i = 0
    # A transformer-like mix: big f32 matrices, bf16 ones, small vectors, a tied embedding.
    while total < gib * (1 << 30):
        if i % 4 == 3:
            t = torch.randn(2048, 4096, generator=g).bfloat16()
        else:
            t = torch.randn(4096, 4096, generator=g)
        sd[f"layers.{i}.weight"] = t
        sd[f"layers.{i}.bias"] = torch.randn(4096, generator=g)
        total += t.numel() * t.element_size() + 4096 * 4
        i += 1
    sd["lm_head.weight"] = sd["layers.0.weight"]
    torch.save(sd, path)
    print(f"wrote {path}: {len(sd)} tensors, {total / (1 << 30):.2f} GiB of storage")


def python_path(src, dst):
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    sd = torch.load(src, weights_only=True, map_location="cpu")
    # save_file refuses shared storage: copy the tie, as users have to.
    sd = {k: v.contiguous().clone() if k == "lm_head.weight" else v.contiguous() for k, v in sd.items()}
    save_file(sd, dst, metadata={"format": "pt"})
    print(f"python path: {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], float(sys.argv[3]))
    else:
        python_path(sys.argv[1], sys.argv[2])
