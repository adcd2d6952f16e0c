"""Iterable datasets: accelerate's ``IterableDatasetShard`` (per rank) and dispatched loaders
(rank 0 reads, every rank gets its slice), over the positions, lengths and steps ``dataload``
decides; this module moves the torch batches."""

from __future__ import annotations

import itertools
import json
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import _native
from ._sampler import _MAX_LEN, DataLoaderConfiguration, _check_int
from .errors import MalformedState


def _iterable_shard_class() -> Any:
    global _IterableDatasetShard
    if _IterableDatasetShard is None:
        import torch
        from torch.utils.data import IterableDataset

        class IterableDatasetShard(IterableDataset[Any]):
            """accelerate 1.15's ``IterableDatasetShard``: every rank reads the whole stream, cuts
            it into global batches (``batch_size`` with ``split_batches``, else ``batch_size *
            num_processes``) and keeps its slice of each; unless ``drop_last``, the last short
            global batch is completed with whole copies of the first one. ``len()`` is
            accelerate's, which ignores ``split_batches`` (too large in split mode)."""

            def __init__(self, dataset: Any, batch_size: int = 1, drop_last: bool = False,
                         num_processes: int = 1, process_index: int = 0, split_batches: bool = False) -> None:
                # accelerate's class makes `prepare_data_loader`'s split check (a batch of 1
                # passes it), not the per-rank loader's: `dataload` resolves it as for a loader
                # whose batches are not cut per rank yet.
                _native.resolve_loader(True, batch_size, num_processes, process_index, True, bool(split_batches), True)
                self.dataset = dataset
                self.batch_size = batch_size
                self.drop_last = drop_last
                self.num_processes = num_processes
                self.process_index = process_index
                self.split_batches = split_batches
                self.epoch = 0  # accelerate leaves it unset until set_epoch (its loader always calls it)
                self._st_first: Optional[List[Any]] = None  # the current pass's first chunk (a loader state holds it)

            def set_epoch(self, epoch: int) -> None:
                self.epoch = epoch
                if hasattr(self.dataset, "set_epoch"):
                    self.dataset.set_epoch(epoch)

            def __len__(self) -> int:
                return _native.stream_len(len(self.dataset), self.batch_size, self.drop_last, self.num_processes)

            def __iter__(self) -> Iterator[Any]:
                if (not hasattr(self.dataset, "set_epoch") and isinstance(getattr(self.dataset, "generator", None), torch.Generator)):
                    self.dataset.generator.manual_seed(self.epoch)
                # dataload's plan says which items this rank keeps; the objects stay here.
                args = (self.batch_size, self.drop_last, self.num_processes, self.process_index, self.split_batches)
                (real, lo, hi), _ = _native.stream_plan(*args)
                # A restored stream continues mid-epoch: the first chunk comes from the state.
                first: Optional[List[Any]] = self.__dict__.pop("_st_resume_first", None)
                cur: List[Any] = []
                for x in self.dataset:
                    cur.append(x)
                    if len(cur) == real:
                        first = self._st_first = first or cur  # before yielding: a state may be taken then
                        yield from cur[lo:hi]
                        cur = []
                first_len = None if first is None else len(first)
                for from_first, i in _native.stream_plan(*args, len(cur), first_len)[1] if cur else ():
                    yield (first if from_first else cur)[i]  # type: ignore[index]

        IterableDatasetShard.__module__ = "statekit.data"
        IterableDatasetShard.__qualname__ = "IterableDatasetShard"
        _IterableDatasetShard = IterableDatasetShard
    return _IterableDatasetShard


_IterableDatasetShard: Any = None
_LOADERS: Dict[Tuple[type, bool], type] = {}


def _concat(data: List[Any]) -> Any:
    from collections.abc import Mapping

    import torch

    if isinstance(data[0], (tuple, list)):
        items = [_concat([d[i] for d in data]) for i in range(len(data[0]))]
        return type(data[0])(*items) if hasattr(data[0], "_fields") else type(data[0])(items)
    if isinstance(data[0], Mapping):
        mapping: Any = type(data[0])  # made from a dict, as torch's collate makes it
        return mapping({k: _concat([d[k] for d in data]) for k in data[0].keys()})
    if isinstance(data[0], torch.Tensor):
        try:
            return torch.cat(data, dim=0)
        except RuntimeError as e:
            raise RuntimeError(
                "dispatch_batches=True: the batches rank 0 read for one step differ in shape and cannot be "
                "joined; use dispatch_batches=False (each rank reads its own) or split_batches=True "
                "(rank 0 reads one batch and cuts it)"
            ) from e
    if len(data) == 1:
        return data[0]
    raise TypeError(f"dispatch_batches=True joins tensors, not {type(data[0]).__name__}")


def _slice(data: Any, sl: slice) -> Any:
    from collections.abc import Mapping

    import torch

    if isinstance(data, (tuple, list)):
        items = [_slice(d, sl) for d in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, Mapping):
        mapping: Any = type(data)  # made from a dict, as torch's collate makes it
        return mapping({k: _slice(v, sl) for k, v in data.items()})
    return data[sl] if isinstance(data, torch.Tensor) else data


class _CollateEmpty:
    """The collate function of a dispatched map-style loader. accelerate's dispatcher gives a
    rank whose slice of the last global batch is empty (1 sample, 3 ranks) an empty batch: the
    batch's structure with 0 rows. torch's collate functions cannot collate no samples, so one
    sample is collated and cut to 0 rows, as the dispatcher cuts its global batch."""

    def __init__(self, collate_fn: Any, dataset: Any) -> None:
        self.collate_fn = collate_fn
        self.dataset = dataset

    def __call__(self, samples: List[Any]) -> Any:
        if samples:
            return self.collate_fn(samples)
        return _slice(self.collate_fn([self.dataset[0]]), slice(0, 0))


def _find_batch_size(data: Any) -> int:
    from collections.abc import Mapping

    import torch

    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"a batch that is an empty {type(data).__name__} has no batch size")
    if isinstance(data, (tuple, list)):
        return _find_batch_size(data[0])
    if isinstance(data, Mapping):
        return _find_batch_size(data[next(iter(data.keys()))])
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"the batch size is read from tensors, not {type(data).__name__}")
    return int(data.shape[0])


def _iterable_loader_class(base: type, dispatch: bool) -> type:
    """A subclass of the loader class (torchdata's ``StatefulDataLoader`` or torch's
    ``DataLoader``) with accelerate's epoch handling: ``iteration`` starts at 0, each pass calls
    ``set_epoch(iteration)`` first and a pass read to its end adds one (``DataLoaderShard`` /
    ``DataLoaderDispatcher``)."""
    key = (base, dispatch)
    if key in _LOADERS:
        return _LOADERS[key]

    class _Iterable(base):  # type: ignore[misc]  # a loader class given at run time
        _st_restore: Optional[Dict[str, Any]]  # set by `_prepare_iterable` and `load_state_dict`
        _st_skip: int

        def set_epoch(self, epoch: int) -> None:
            self.iteration = epoch
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(epoch)

        def __iter__(self) -> Iterator[Any]:
            self.set_epoch(self.iteration)
            restore, self._st_restore = self._st_restore, None
            skip, self._st_skip = self._st_skip, 0
            self._st_yielded = 0
            if restore is not None:  # after set_epoch, which may rewind a stream
                self._st_stream()[0].load_state_dict(restore["stream"])
                if isinstance(self.dataset, _iterable_shard_class()):
                    self.dataset._st_resume_first = restore["first"]
                self._st_yielded = restore["batches"]
            for batch in (self._dispatch(super().__iter__()) if dispatch else super().__iter__()):
                self._st_yielded += 1
                if self._st_yielded > skip:  # accelerate's skip_first_batches: read and dropped
                    yield batch
            self.iteration += 1
            self._st_yielded = 0

        def skip_first_batches(self, num_batches: int) -> None:
            """accelerate's ``skip_first_batches`` for the next pass: its first ``num_batches``
            batches are read and dropped (a stream has no position to jump to)."""
            self._st_skip = _check_int("num_batches", num_batches, 0, _MAX_LEN)

        def _st_stream(self) -> Tuple[Any, Any]:
            """The user's dataset and the shard around it (or None)."""
            shard = self.dataset if isinstance(self.dataset, _iterable_shard_class()) else None
            return (shard.dataset if shard is not None else self.dataset), shard

        def state_dict(self) -> Dict[str, Any]:
            """The epoch and the batches of it this rank was handed. A dataset with torchdata's
            ``state_dict``/``load_state_dict`` (read by one process: per-rank sharding,
            ``num_workers=0``) adds its own state, and the first global batch the shard
            completes the epoch with: restoring it is O(1). Otherwise the batches are replayed."""
            stream, shard = self._st_stream()
            state = None
            if not dispatch and self.num_workers == 0 and self._st_yielded and callable(getattr(stream, "state_dict", None)):
                state = {"stream": stream.state_dict(), "first": None if shard is None else shard._st_first,
                         "batches": self._st_yielded}
            return dict(json.loads(_native.iterable_state_json(self.iteration, self._st_yielded)), stream=state)

        def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
            # dataload reads the header (`IterableState`); the stream's own state stays here.
            header = {k: v for k, v in state_dict.items() if k != "stream"} if isinstance(state_dict, dict) else None
            try:
                text = json.dumps(header)
            except (TypeError, ValueError) as e:
                raise MalformedState(f"malformed loader state: {e}", variant="MalformedState") from None
            self.iteration, batches = _native.parse_iterable_state(text)
            stream = state_dict.get("stream")
            if stream is not None and callable(getattr(self._st_stream()[0], "load_state_dict", None)):
                self._st_restore, self._st_skip = stream, 0
            else:
                self._st_restore, self._st_skip = None, batches

        if dispatch:
            def __len__(self) -> int:
                return _native.dispatch_len(super().__len__(), self._st_world, self._st_split, self.drop_last)

            def _dispatch(self, it: Iterator[Any]) -> Iterator[Any]:
                # dataload's steps say when to fetch, stop, pad and cut; the batches stay here.
                coll = self._st_collective
                reader = coll is None or self._st_rank == 0
                steps = _native.DispatchSteps(self._st_world, self._st_rank, self._st_split, self.drop_last)
                held: List[Any] = []  # global batches fetched and not cut yet, oldest first
                first = None
                while True:
                    action = steps.next_action()
                    if action is None:
                        return  # an empty stream ends at once (accelerate fails on it with a ValueError)
                    if isinstance(action, str):  # "fetch", the one word
                        info: Any = None
                        if reader:  # rank 0 reads the underlying batches of one global batch
                            got = list(itertools.islice(it, steps.group))
                            kept, exhausted = steps.fetch_result(len(got))
                            info = [(got[0] if self._st_split else _concat(got)) if kept else None, exhausted]
                        batch, exhausted = info if coll is None else _broadcast_object(info, coll)
                        held.append(batch)
                        steps.fetched(None if batch is None else _find_batch_size(batch), exhausted)
                        continue
                    keep_first, padded, lo, hi = action
                    batch = held.pop(0)
                    if keep_first:
                        first = _slice(batch, slice(0, keep_first))
                    yield _slice(_concat([batch, first]) if padded else batch, slice(lo, hi))

    _Iterable.__name__ = _Iterable.__qualname__ = ("Dispatched" if dispatch else "Sharded") + base.__name__
    _LOADERS[key] = _Iterable
    return _Iterable


def _broadcast_object(obj: Any, coll: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``broadcast_object_list`` through ``TorchCollective``'s group)."""
    import torch.distributed as dist

    box = [obj if coll.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=coll.group)
    return box[0]


def _prepare_iterable(dataloader: Any, world: int, rank: int, config: DataLoaderConfiguration, Loader: type,
                      extra: Dict[str, Any]) -> Any:
    batch_size, drop_last = dataloader.batch_size, bool(dataloader.drop_last)
    # `dataload` resolves the configuration: dispatch_batches=None is True here (an Accelerator
    # places on a device), the rank, split and unbatched checks, the per-rank batch size.
    dispatch, loader_batch_size = _native.resolve_loader(
        True, batch_size, world, rank, True, bool(config.split_batches),
        None if config.dispatch_batches is None else bool(config.dispatch_batches), bool(config.even_batches))
    split = bool(config.split_batches)
    common = dict(num_workers=dataloader.num_workers, collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory,
                  timeout=dataloader.timeout, worker_init_fn=dataloader.worker_init_fn,
                  multiprocessing_context=dataloader.multiprocessing_context, **extra)
    if dispatch:
        coll = None
        if world > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world and dist.get_rank() == rank:
                from ._dist import TorchCollective

                coll = TorchCollective(rank, world)
        loader = _iterable_loader_class(Loader, True)(dataloader.dataset, batch_size=batch_size, drop_last=drop_last, **common)
        loader._st_world, loader._st_rank, loader._st_split, loader._st_collective = world, rank, split, coll
    else:
        dataset = dataloader.dataset
        if world != 1:
            dataset = _iterable_shard_class()(dataset, batch_size=batch_size, drop_last=drop_last,
                                               num_processes=world, process_index=rank, split_batches=split)
        loader = _iterable_loader_class(Loader, False)(
            dataset, batch_size=loader_batch_size, drop_last=drop_last,
            generator=dataloader.generator, **common)
    loader.iteration, loader._st_skip, loader._st_yielded, loader._st_restore = 0, 0, 0, None
    return loader
