"""The Python path for merge: load every shard, then safetensors save_file."""
import json
import os
import sys

from safetensors.torch import load_file, save_file

src, out = sys.argv[1], sys.argv[2]
index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
sd = {}
for shard in sorted(set(index["weight_map"].values())):
    sd.update(load_file(os.path.join(src, shard)))
save_file(sd, out, metadata={"format": "pt"})
