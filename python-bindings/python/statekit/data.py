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
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import _native
from ._datasets import ArrowDataset, JsonlDataset, ParquetDataset, TokenDataset
from .errors import UsageError

__all__ = [
    "DataLoaderConfiguration",
    "ShardedBatchSampler",
    "prepare_data_loader",
    "TokenDataset",
    "ArrowDataset",
    "ParquetDataset",
    "JsonlDataset",
]


@dataclasses.dataclass
class DataLoaderConfiguration:
    """accelerate 1.x's ``DataLoaderConfiguration``: the same fields and defaults."""

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def _json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def _world(num_processes: Optional[int], process_index: Optional[int]) -> Tuple[int, int]:
    if num_processes is not None and process_index is not None:
        return int(num_processes), int(process_index)
    world, rank = 1, 0
    try:  # torch is optional: only asked when the world is not given
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
    except ImportError:
        pass
    return (world if num_processes is None else int(num_processes)), (rank if process_index is None else int(process_index))


class _EpochIterator:
    """One pass over the sampler's current epoch, from its position. Stateful itself (torchdata
    snapshots the iterator after each batch it hands to a worker)."""

    def __init__(self, owner: "ShardedBatchSampler") -> None:
        self._owner = owner
        self._done = False

    def __iter__(self) -> "_EpochIterator":
        return self

    def __next__(self) -> List[int]:
        if self._done:
            raise StopIteration
        batch = self._owner._native.next_batch()
        if batch is None:
            self._done = True
            raise StopIteration
        return batch

    def state_dict(self) -> Dict[str, Any]:
        return self._owner.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._owner.load_state_dict(state)
        self._done = False


class ShardedBatchSampler:
    """The batches of one rank, exactly as accelerate's ``prepare_data_loader(...,
    use_seedable_sampler=True)`` deals them (``dispatch_batches=False``); use it as a torch
    ``DataLoader``'s ``batch_sampler``, with any ``num_workers``.

    ``num_processes``/``process_index`` default to torch.distributed's world when it is
    initialized, else 1/0. ``seed`` is the seedable sampler's ``data_seed`` (used with
    ``shuffle``). ``fingerprint`` (any string) names the dataset: a state saved over another
    fingerprint is refused.

    Iterating continues from the current position (the start of an epoch unless a state was
    loaded); reading an epoch to its end moves to the next one, as accelerate's sampler does.
    """

    def __init__(
        self,
        length: int,
        batch_size: int,
        *,
        num_processes: Optional[int] = None,
        process_index: Optional[int] = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        split_batches: bool = False,
        even_batches: bool = True,
        fingerprint: Optional[str] = None,
    ) -> None:
        world, rank = _world(num_processes, process_index)
        config = DataLoaderConfiguration(
            split_batches=split_batches,
            dispatch_batches=False,
            even_batches=even_batches,
            use_seedable_sampler=True,
            data_seed=int(seed) if shuffle else None,
        )
        self._init(length, batch_size, world, rank, shuffle, drop_last, config, fingerprint)

    def _init(self, length, batch_size, world, rank, shuffle, drop_last, config, fingerprint) -> None:  # type: ignore[no-untyped-def]
        for name, v in (("length", length), ("batch_size", batch_size), ("num_processes", world), ("process_index", rank)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UsageError(f"`{name}` must be a non-negative int, not {v!r}")
        self._native = _native.Sampler(length, batch_size, world, rank, bool(shuffle), bool(drop_last), config._json(), fingerprint)
        self.length = length
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.shuffle = bool(shuffle)

    @property
    def num_processes(self) -> int:
        return int(self._native.world_size)

    @property
    def process_index(self) -> int:
        return int(self._native.rank)

    @property
    def epoch(self) -> int:
        return int(self._native.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch``; a no-op when the sampler is already in it (so that a
        loop calling ``set_epoch`` every epoch does not undo a resume)."""
        if int(epoch) != self._native.epoch:
            self._native.set_epoch(int(epoch))

    def skip_first_batches(self, num_batches: int) -> None:
        """accelerate's ``skip_first_batches`` for the current epoch, in O(1)."""
        self._native.skip_first_batches(int(num_batches))

    def __len__(self) -> int:
        return int(self._native.epoch_len())

    def __iter__(self) -> Iterator[List[int]]:
        return _EpochIterator(self)

    def __getstate__(self) -> Dict[str, Any]:
        # Pickles (spawned workers, copies) as its settings and position.
        return {"state": self._native.state_json(), "world": self.num_processes, "rank": self.process_index,
                "attrs": (self.length, self.batch_size, self.drop_last, self.shuffle)}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._native = _native.Sampler.from_state(state["state"], state["world"], state["rank"])
        self.length, self.batch_size, self.drop_last, self.shuffle = state["attrs"]

    def state_dict(self) -> Dict[str, Any]:
        """The position and the settings it is valid with (``dataload``'s ``LoaderState``)."""
        return json.loads(self._native.state_json())

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Continues from ``state_dict``, saved on any world size; settings that differ are
        refused with ``StateMismatch`` naming the field."""
        self._native.load_state_json(json.dumps(state_dict))


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
        raise UsageError("prepare_data_loader: iterable datasets are not supported here (map-style datasets only)")
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
    length, batch_size, drop_last = len(dataloader.dataset), batch_sampler.batch_size, batch_sampler.drop_last
    if config.dispatch_batches:
        length, batch_size, drop_last, shuffle, config = _rank0_settings(
            (length, batch_size, drop_last, shuffle, config), world, rank)
    bs = ShardedBatchSampler.__new__(ShardedBatchSampler)
    bs._init(length, batch_size, world, rank, shuffle, drop_last, config, None)
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    except ImportError:
        from torch.utils.data import DataLoader as Loader
    extra: Dict[str, Any] = {}
    if dataloader.num_workers > 0:
        extra["prefetch_factor"] = dataloader.prefetch_factor
        extra["persistent_workers"] = dataloader.persistent_workers
    return Loader(
        dataloader.dataset,
        batch_sampler=bs,
        num_workers=dataloader.num_workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        **extra,
    )
