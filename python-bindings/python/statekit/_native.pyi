# Stubs of the native module (python-bindings/src). tests/python/test_bindings_api.py checks
# that they name exactly what the module exports.
from typing import Any, Dict, List, Optional, Sequence, Tuple

__version__: str

class Sampler:
    def __init__(
        self,
        length: int,
        batch_size: int,
        world_size: int,
        rank: int,
        shuffle: bool,
        drop_last: bool,
        config: str,
        fingerprint: Optional[str] = None,
    ) -> None: ...
    @staticmethod
    def from_state(state: str, world_size: int, rank: int) -> Sampler: ...
    def next_batch(self) -> Optional[List[int]]: ...
    def set_epoch(self, epoch: int) -> None: ...
    def skip_first_batches(self, k: int) -> None: ...
    @property
    def epoch(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def cursor(self) -> int: ...
    def epoch_len(self) -> int: ...
    def remaining(self) -> int: ...
    def state_json(self) -> str: ...
    def load_state_json(self, state: str) -> None: ...

def default_config_json() -> str: ...

class Checkpoint:
    def __init__(self, src: str, tag: Optional[str] = None) -> None: ...
    def info_json(self) -> str: ...
    def read_into(self, index: int, addr: int, len: int) -> None: ...

def verify(src: str) -> str: ...
def split(
    src: str, out: str, max_shard_size: int, *, tag: Optional[str] = None, checksums: bool = False, allow_expanded: bool = False
) -> str: ...
def merge(
    src: str,
    out: str,
    *,
    tag: Optional[str] = None,
    max_shard_size: Optional[int] = None,
    optimizer: bool = False,
    checksums: bool = False,
    allow_expanded: bool = False,
) -> str: ...
def convert(
    src: str,
    out: str,
    *,
    to: Optional[str] = None,
    dtype: Optional[str] = None,
    max_shard_size: Optional[int] = None,
    dedupe: bool = False,
    world_size: Optional[int] = None,
    tag: Optional[str] = None,
    checksums: bool = False,
    allow_expanded: bool = False,
) -> str: ...
def reshard(
    src: str, out: str, world_size: int, *, tag: Optional[str] = None, checksums: bool = False, allow_expanded: bool = False
) -> str: ...
def parse_size(text: str) -> int: ...
def save_safetensors(
    entries: Sequence[Tuple[str, str, Sequence[int], int, int]],
    path: str,
    max_shard_size: Optional[int] = None,
    metadata: Optional[Dict[str, str]] = None,
) -> List[str]: ...
def save_sharded(
    dir: str,
    tensors: Sequence[Tuple[Sequence[Any], str, Sequence[int], int, int, int]],
    values: Sequence[Tuple[Sequence[Any], Any]],
    comm: Any,
) -> str: ...
