"""The Python path for split: load_file + huggingface_hub.save_torch_state_dict."""
import sys

from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file

save_torch_state_dict(load_file(sys.argv[1]), sys.argv[2], max_shard_size=sys.argv[3])
