"""Helpers the Python benches share (imported from the bench folder, which Python puts on the
path of a script it runs)."""

import os

import numpy as np

# GPT-2's vocabulary: the ids a synthetic token file draws from.
VOCAB = 50257


def token_file(path, tokens, seed):
    """`path`, holding `tokens` uniform random uint16 token ids from numpy's generator seeded with
    `seed`; written on first use, an existing file is kept."""
    if not os.path.exists(path):
        np.random.default_rng(seed).integers(0, VOCAB, size=tokens, dtype=np.uint16).tofile(path)
    return path
