"""Writes the synthetic benchmark checkpoint: bf16 tensors shaped like a 1B-parameter model."""
import sys

import torch
from safetensors.torch import save_file

out, gib = sys.argv[1], float(sys.argv[2])
gen = torch.Generator().manual_seed(0)
sd, total, i = {}, 0, 0
while total < gib * 2**30:
    shape = (4096, 4096) if i % 4 else (8192, 2048)
    sd[f"model.layers.{i // 4}.w{i % 4}"] = torch.randn(shape, generator=gen).to(torch.bfloat16)
    total += shape[0] * shape[1] * 2
    i += 1
save_file(sd, out, metadata={"format": "pt"})
print(f"{out}: {len(sd)} tensors, {total / 2**30:.2f} GiB", file=sys.stderr)
