"""The block-scaled FP8 computation in torch, the way users write it: what `ckpt convert
--dequantize` and `--quantize fp8-e4m3` must equal bit for bit.

A weight `w` of shape [R, C] has one scale per B×B block, `s` of shape [ceil(R/B), ceil(C/B)]
(partial blocks at the edges); a block's real values are its FP8 values times its scale.
"""

import torch

E4M3_MAX = 448.0


def expand(s: torch.Tensor, shape, block: int) -> torch.Tensor:
    """Each scale repeated over its block, cut to the weight's shape."""
    r, c = shape
    return s.repeat_interleave(block, 0)[:r].repeat_interleave(block, 1)[:, :c]


def dequantize(w: torch.Tensor, s: torch.Tensor, block: int, dtype=torch.bfloat16) -> torch.Tensor:
    """The loop users run today: widen, multiply by the block's scale in f32, narrow."""
    return (w.to(torch.float32) * expand(s.to(torch.float32), w.shape, block)).to(dtype)


def quantize(w: torch.Tensor, block: int):
    """Per block: amax of |w| (NaN if the block has one), scale = amax / 448 (1 for an all-zero
    block), FP8 = (w / scale).to(float8_e4m3fn); returns (fp8 weight, f32 scales)."""
    x = w.to(torch.float32)
    r, c = x.shape
    rb, cb = -(-r // block), -(-c // block)
    padded = torch.zeros(rb * block, cb * block, dtype=torch.float32)
    padded[:r, :c] = x.abs()
    amax = padded.view(rb, block, cb, block).amax(dim=(1, 3))
    s = amax / E4M3_MAX
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = (x / expand(s, x.shape, block)).to(torch.float8_e4m3fn)
    return q, s
