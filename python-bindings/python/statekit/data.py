"""Rank-sharded, resumable batch sampling with accelerate's semantics, for torch DataLoaders.

``ShardedBatchSampler`` is what ``accelerate.prepare_data_loader`` gives each rank (a
``BatchSamplerShard`` over a ``SeedableRandomSampler`` or a sequential sampler), computed by
``dataload``: a position is one number per epoch, so restoring a state costs the same at batch
10 as at batch 10⁷, and a state saved on N ranks loads on M (``dataload``'s elastic rule: the
rest of the interrupted epoch is dealt out over the new world, every remaining sample once).

The state follows torchdata's ``Stateful`` protocol and is plain data (dicts, ints, strings,
bools), so it survives ``torch.save(weights_only=True)``, ``pickle`` and JSON; torchdata's
``StatefulDataLoader`` saves and restores it mid-epoch, with workers.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Optional, Tuple

from ._datasets import ArrowDataset, JsonlDataset, ParquetDataset, TokenDataset
from ._iterable import _CollateEmpty, _iterable_shard_class, _prepare_iterable
from ._sampler import DataLoaderConfiguration, ShardedBatchSampler, _world
from .errors import UsageError
from .mixture import Mixture

__all__ = [
    "DataLoaderConfiguration",
    "ShardedBatchSampler",
    "IterableDatasetShard",
    "prepare_data_loader",
    "skip_first_batches",
    "TokenDataset",
    "ArrowDataset",
    "ParquetDataset",
    "JsonlDataset",
    "Mixture",
]


_MOVED = ("dispatch_batches", "split_batches", "even_batches", "use_seedable_sampler", "data_seed", "non_blocking")


def _rank0_settings(mine: Tuple[int, int, bool, bool, DataLoaderConfiguration], world: int, rank: int) -> Tuple[Any, ...]:
    """``dispatch_batches=True``: in accelerate only rank 0 reads the underlying loader, so its
    settings (dataset length, batch size, drop_last, shuffle, seed) decide every rank's batches.
    Over torch.distributed they are broadcast from rank 0 through the ``Collective`` that
    ``ckpt.save_sharded`` uses; then each rank computes its slice of rank 0's global batches
    (``dataload``'s dispatch plan, which equals its ``Dispatcher``) and reads only those rows."""
    length, batch_size, drop_last, shuffle, config = mine
    if world > 1:
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch is there (prepare_data_loader needs it)
            dist = None  # type: ignore[assignment]
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world:
            from ._dist import TorchCollective

            payload = json.dumps([length, batch_size, drop_last, shuffle, dataclasses.asdict(config)]).encode()
            theirs = json.loads(TorchCollective(rank, world).broadcast(0, payload if rank == 0 else None))
            if theirs[0] != length:
                raise UsageError(
                    f"prepare_data_loader(dispatch_batches=True): this rank's dataset has {length} samples, rank 0's "
                    f"{theirs[0]}: every rank reads the rows of its slice, so the datasets must be the same"
                )
            length, batch_size, drop_last, shuffle = theirs[0], theirs[1], theirs[2], theirs[3]
            config = DataLoaderConfiguration(**theirs[4])
    return length, batch_size, drop_last, shuffle, config


# Made by `__getattr__` below (a class, defined on first use).
IterableDatasetShard: Any


def __getattr__(name: str) -> Any:
    # ``IterableDatasetShard`` subclasses torch's ``IterableDataset``; torch is imported on first use.
    if name == "IterableDatasetShard":
        return _iterable_shard_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_data_loader(
    dataloader: Any,
    *,
    num_processes: Optional[int] = None,
    process_index: Optional[int] = None,
    dataloader_config: Optional[DataLoaderConfiguration] = None,
    **kwargs: Any,
) -> Any:
    """accelerate's ``prepare_data_loader`` for a map-style torch ``DataLoader``: a loader over
    the same dataset, collate function and workers whose batches on this rank are accelerate's,
    with a stateful, resumable ``ShardedBatchSampler`` as its ``batch_sampler``. It is
    torchdata's ``StatefulDataLoader`` when torchdata is installed, else a torch ``DataLoader``.

    ``dispatch_batches=True`` gives each rank its slice of the global batches rank 0 would
    read (accelerate's ``DataLoaderDispatcher``: one underlying batch per step with
    ``split_batches``, else ``num_processes`` of them; the last, uneven global batch padded
    with the epoch's first rows, ``even_batches`` ignored as accelerate ignores it). Rank 0's
    settings are broadcast over torch.distributed when it is initialized; each rank then reads
    the rows of its own slice (the dataset must be readable on every rank), and nothing is sent
    per batch.
    """
    for name in kwargs:
        if name in _MOVED:
            raise TypeError(
                f"prepare_data_loader() got an unexpected keyword argument `{name}`: since accelerate 1.0 it is "
                f"a field of `DataLoaderConfiguration`; pass `dataloader_config=DataLoaderConfiguration({name}=...)`"
            )
        raise TypeError(f"prepare_data_loader() got an unexpected keyword argument `{name}`")
    import torch
    from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

    config = dataloader_config or DataLoaderConfiguration()
    if isinstance(dataloader.dataset, IterableDataset):
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader as ILoader
        except ImportError:
            from torch.utils.data import DataLoader as ILoader
        world, rank = _world(num_processes, process_index)
        iextra: Dict[str, Any] = {}
        if dataloader.num_workers > 0:
            iextra["prefetch_factor"] = dataloader.prefetch_factor
            iextra["persistent_workers"] = dataloader.persistent_workers
        return _prepare_iterable(dataloader, world, rank, config, ILoader, iextra)
    batch_sampler = dataloader.batch_sampler
    if not isinstance(batch_sampler, BatchSampler):
        raise UsageError("prepare_data_loader: the loader must batch with torch's `BatchSampler` (batch_size=...)")
    sampler = batch_sampler.sampler
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler._num_samples is not None:
            raise UsageError("prepare_data_loader: a `RandomSampler` with replacement or num_samples is not supported")
        shuffle = True
    elif isinstance(sampler, SequentialSampler):
        shuffle = False
    else:
        raise UsageError(f"prepare_data_loader: sampler `{type(sampler).__name__}` is not supported (random or sequential)")
    world, rank = _world(num_processes, process_index)
    if shuffle and config.use_seedable_sampler and config.data_seed is None:
        config = dataclasses.replace(config, data_seed=torch.initial_seed())
    generator = None
    if shuffle and not config.use_seedable_sampler and isinstance(sampler, RandomSampler):  # (a shuffle's is)
        # accelerate's default: the RandomSampler keeps its generator (the DataLoader's), or
        # on more than one rank, not dispatched, gets a fresh one seeded from torch's global
        # generator (on the user's sampler itself, as accelerate does); with one rank or
        # dispatched, and no generator, it draws each epoch's seed from (rank 0's) global
        # generator, which `ShardedBatchSampler` does too.
        generator = sampler.generator
        if generator is None and world > 1 and not config.dispatch_batches:
            generator = torch.Generator()
            generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
            sampler.generator = generator
    length, batch_size, drop_last = len(dataloader.dataset), batch_sampler.batch_size, batch_sampler.drop_last
    if config.dispatch_batches:
        length, batch_size, drop_last, shuffle, config = _rank0_settings(
            (length, batch_size, drop_last, shuffle, config), world, rank)
    bs = ShardedBatchSampler.__new__(ShardedBatchSampler)
    # A `Mixture.of(...)` dataset: the state records the mixture's definition.
    mixture = dataloader.dataset if isinstance(dataloader.dataset, Mixture) else None
    bs._init(length, batch_size, world, rank, shuffle, drop_last, config, None, generator, mixture)
    if config.dispatch_batches and dataloader.num_workers > 0:
        bs._prefetched = dataloader.num_workers * (dataloader.prefetch_factor or 2)
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    except ImportError:
        from torch.utils.data import DataLoader as Loader
    extra: Dict[str, Any] = {}
    if dataloader.num_workers > 0:
        extra["prefetch_factor"] = dataloader.prefetch_factor
        extra["persistent_workers"] = dataloader.persistent_workers
    collate = dataloader.collate_fn
    if config.dispatch_batches:
        collate = _CollateEmpty(collate, dataloader.dataset)
    return Loader(
        dataloader.dataset,
        batch_sampler=bs,
        num_workers=dataloader.num_workers,
        collate_fn=collate,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        # accelerate's dispatcher drops the loader's generator (the base seed then comes
        # from torch's global generator, the sampler keeps its own)
        generator=None if config.dispatch_batches else dataloader.generator,
        **extra,
    )


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """accelerate's ``skip_first_batches`` on a loader ``prepare_data_loader`` returned: the
    next pass starts after this rank's first ``num_batches`` batches. Map-style loaders get
    there in O(1) (``ShardedBatchSampler.skip_first_batches``); iterable ones read and drop
    them, as accelerate does. Returns the loader."""
    target = dataloader.batch_sampler if isinstance(getattr(dataloader, "batch_sampler", None), ShardedBatchSampler) \
        else dataloader
    if not callable(getattr(target, "skip_first_batches", None)):
        raise UsageError("skip_first_batches: not a loader statekit.data.prepare_data_loader returned")
    target.skip_first_batches(num_batches)
    return dataloader
