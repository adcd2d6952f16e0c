"""Where statekit computes a loader's batches, and its batch sampler for them: the samplers
statekit models (a plain batch sampler over a sequential or a ``RandomSampler`` without
replacement), the DataLoader arguments rewritten to use statekit's ``ShardedBatchSampler``,
and accelerate's ``BatchSamplerShard`` over it."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, TypeGuard, Union

import accelerate.data_loader as _acc
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from . import data as _data

_IGNORED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def _plain_batch_sampler(bs: Any) -> bool:
    """torch's ``BatchSampler``, or a subclass that batches the same way: one with its own
    ``__iter__`` decides batches statekit cannot compute."""
    return isinstance(bs, BatchSampler) and type(bs).__iter__ is BatchSampler.__iter__


def _modelled(bs: Any) -> TypeGuard[BatchSampler]:
    """Whether statekit computes the batches of ``bs``: a plain batch sampler over a sequential
    sampler or a ``RandomSampler`` without replacement or ``num_samples``."""
    if not _plain_batch_sampler(bs) or bs.batch_size is None:
        return False
    s = bs.sampler
    if isinstance(s, RandomSampler):
        return not s.replacement and s._num_samples is None
    return type(s) is SequentialSampler or (isinstance(s, range) and s.start == 0 and s.step == 1)


def _statekit_sampler(dataset: Any, batch_sampler: Optional[Union[Sampler[List[Any]], Iterable[List[Any]]]],
                      world: int, rank: int, config: "_data.DataLoaderConfiguration", collate_fn: Any,
                      generator: Any) -> Dict[str, Any]:
    """statekit's batch sampler (and the collate function and generator its loader uses) for a
    map-style ``dataset`` batched by ``batch_sampler``, on rank ``rank`` of ``world``:
    ``statekit.data.prepare_data_loader`` decides it, as it does for its own loaders."""
    template = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, generator=generator)
    made = _data.prepare_data_loader(template, num_processes=world, process_index=rank, dataloader_config=config)
    return {"batch_sampler": made.batch_sampler, "collate_fn": made.collate_fn, "generator": made.generator}


def _convert(dataset: Any, kwargs: Dict[str, Any], config: "_data.DataLoaderConfiguration", world: int,
             rank: int, use_stateful: bool) -> Dict[str, Any]:
    """The DataLoader arguments with torch's batching (``batch_size``/``shuffle``/``sampler``/
    ``drop_last``, or a ``batch_sampler``) replaced by statekit's batch sampler where statekit
    computes those batches; else unchanged."""
    if isinstance(dataset, IterableDataset) or isinstance(kwargs.get("batch_sampler"), _data.ShardedBatchSampler):
        return kwargs
    if isinstance(kwargs.get("sampler"), BatchSampler):
        return kwargs  # accelerate's `sampler_is_batch_sampler` form
    try:
        template = DataLoader(dataset, **{k: kwargs[k] for k in ("batch_size", "shuffle", "sampler", "batch_sampler",
                                                                  "drop_last", "generator") if k in kwargs})
    except (TypeError, ValueError):
        return kwargs  # torch refuses the combination: let accelerate's path say so
    batches = template.batch_sampler
    if not _modelled(batches):
        return kwargs
    # torchdata's StatefulDataLoader makes its own RandomSampler from `shuffle=True`: one that
    # draws each epoch when its iterator is made, and (no generator given) seeds a generator of
    # its own from torch's global one when it is made.
    torchdata_shuffle = use_stateful and kwargs.get("shuffle") and kwargs.get("sampler") is None
    sampler = batches.sampler
    # (torchdata's shuffle: `shuffle=True` without a sampler, for which the template made a RandomSampler)
    if torchdata_shuffle and isinstance(sampler, RandomSampler) and sampler.generator is None:
        sampler.generator = torch.Generator().manual_seed(
            int(torch.empty((), dtype=torch.int64).random_().item()))
    made = _statekit_sampler(dataset, batches, world, rank, config,
                             kwargs.get("collate_fn"), kwargs.get("generator"))
    made["batch_sampler"]._draw_at_iter = bool(torchdata_shuffle)
    out = {k: v for k, v in kwargs.items() if k not in _IGNORED}
    out["batch_sampler"] = made["batch_sampler"]
    if kwargs.get("collate_fn") is not None or config.dispatch_batches:
        out["collate_fn"] = made["collate_fn"]
    return out


class BatchSamplerShard(_acc.BatchSamplerShard):  # type: ignore[misc]  # accelerate is untyped
    """accelerate's ``BatchSamplerShard`` (same arguments and checks); over a plain batch
    sampler of a sequential sampler (or ``range(n)``), its batches are statekit's, else
    accelerate's."""

    def __init__(self, batch_sampler: Any, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True) -> None:
        super().__init__(batch_sampler, num_processes, process_index, split_batches, even_batches)
        self._statekit = None
        # modelled and not random: a SequentialSampler or a range(n)
        if _modelled(batch_sampler) and isinstance(batch_sampler.sampler, (SequentialSampler, range)):
            self._statekit = _data.ShardedBatchSampler(
                len(batch_sampler.sampler), batch_sampler.batch_size, num_processes=num_processes,
                process_index=process_index, drop_last=self.drop_last, split_batches=split_batches,
                even_batches=even_batches)

    def __len__(self) -> int:
        return super().__len__() if self._statekit is None else len(self._statekit)

    def __iter__(self) -> Any:
        if self._statekit is None:
            return super().__iter__()
        self._statekit.skip_first_batches(0)  # every pass from the start, as accelerate's
        return iter(self._statekit)


BatchSamplerShard.__module__ = "statekit.accelerate"
