"""statekit: checkpoint formats and resumable, rank-sharded data loading, in Rust.

* ``statekit.data``: ``ShardedBatchSampler`` (accelerate's per-rank batches, stateful, O(1)
  and elastic resume), ``DataLoaderConfiguration``, ``prepare_data_loader``;
* ``statekit.ckpt``: ``load``, ``save``, ``save_sharded``, ``inspect``, ``verify``,
  ``split``, ``merge``, ``convert``, ``reshard``;
* ``statekit.errors``: the exception hierarchy (``StatekitError`` at the root);
* ``statekit.accelerate`` (imported on its own: it needs torch and accelerate): accelerate's
  loader classes over ``statekit.data``'s sampler, and ``patch(accelerator)``.

numpy is the only dependency; torch is imported only where torch tensors are asked for.
"""

from . import ckpt, data, errors
from ._native import __version__
from .errors import StatekitError

__all__ = ["ckpt", "data", "errors", "StatekitError", "__version__"]
