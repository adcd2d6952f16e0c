"""accelerate's loader classes with statekit's batches: one line in an accelerate script.

``DataLoaderShard``, ``DataLoaderDispatcher`` and ``BatchSamplerShard`` subclass accelerate
1.15's classes of the same names, and ``prepare_data_loader`` / ``skip_first_batches`` take
accelerate's signatures, so every ``isinstance`` check and attribute accelerate's internals use
(``GradientState``'s ``end_of_dataloader`` and ``remainder``, which ``gather_for_metrics`` cuts
the last batch's duplicates by; ``set_epoch``, ``iteration``, ``total_batch_size``,
``total_dataset_length``, ``use_stateful_dataloader``, ``state_dict`` / ``load_state_dict``)
keeps working. What changes is where a map-style loader's batches come from: the batch sampler
is ``statekit.data``'s ``ShardedBatchSampler`` (made by ``statekit.data.prepare_data_loader``
from the same configuration: the seedable sampler or accelerate's default shuffle, per rank or
dispatched), whose position is one number per epoch. So:

* ``skip_first_batches(dl, k)`` moves that number, in O(1), where accelerate's
  ``SkipBatchSampler`` walks the first ``k`` batches of the epoch (as there, every pass of the
  skipped loader skips them);
* a loader's ``state_dict()`` is torchdata's ``StatefulDataLoader`` state with statekit's
  position inside (``_index_sampler_state``), the same on every rank; ``load_state_dict`` takes
  one saved on any number of processes (``dataload``'s elastic rule: the rest of the epoch is
  dealt out over the new world, every remaining sample once). On one process, where
  torchdata's own fields say the whole position (sequential, or shuffled from a generator),
  the state is torchdata's, key for key.

``patch(accelerator)`` routes ``accelerator.prepare`` / ``prepare_data_loader`` and
``accelerator.skip_first_batches`` through this module; ``save_state`` then writes a stateful
loader's position as ``dl_state_dict[_i].bin`` (accelerate's own code, our ``state_dict``) and
``load_state`` restores it, on the same or another number of processes.

What is left to accelerate, unchanged: loaders whose sampler statekit does not model (a custom
batch sampler or sampler, a ``RandomSampler`` with replacement or ``num_samples``, a
``sampler=`` that is itself a batch sampler), device meshes (TP/CP rank remapping), XLA and
Megatron; ``prepare_data_loader`` hands those to accelerate's own function. Iterable datasets
keep accelerate's flow (statekit's ``IterableDatasetShard`` per rank, or rank 0's stream
broadcast by accelerate's dispatcher); their ``skip_first_batches`` replays, as accelerate's does,
since a stream has no position to compute. A loaded state replays too (torchdata's
fast-forward), except where the dataset has torchdata's ``state_dict``/``load_state_dict`` and
one process reads it (per rank, no workers): then the state holds the dataset's own
(``_statekit_stream``) and resuming reads nothing again.

Two choices differ from accelerate on purpose. ``skip_first_batches`` on a dispatched map-style
loader counts steps, as it does for every other loader (accelerate's counts the underlying
loader's batches there, ``num_processes`` to a step). A prepared loader keeps a mid-epoch
position across ``iter()`` only after ``load_state_dict`` or ``skip_first_batches``; a pass that
was broken off starts its epoch again, as accelerate's does (with the default shuffle, from a new
draw of the running generator).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import accelerate.data_loader as _acc
import torch
from accelerate.state import DistributedType, PartialState
from accelerate.utils import send_to_device
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from . import _native
from . import data as _data
from ._batching import _IGNORED, BatchSamplerShard, _convert, _modelled, _statekit_sampler
from ._positioned import _bare, _Positioned

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "patch",
    "prepare_data_loader",
    "skip_first_batches",
]

# accelerate's own table of the DataLoader arguments it forwards (with their defaults).
_KWARGS = _acc._PYTORCH_DATALOADER_KWARGS


# Made by `__getattr__` below (statekit.data's, defined on first use).
IterableDatasetShard: Any


def __getattr__(name: str) -> Any:
    if name == "IterableDatasetShard":
        return _data.IterableDatasetShard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DataLoaderShard(_Positioned, _acc.DataLoaderShard):  # type: ignore[misc]  # accelerate is untyped
    """accelerate's ``DataLoaderShard`` (same arguments) over statekit's batch sampler.

    Made by ``prepare_data_loader``, its batch sampler is this rank's ``ShardedBatchSampler``.
    Made directly (``DataLoaderShard(dataset, batch_size=4, shuffle=...)``), a plain batch
    sampler over a sequential or random sampler becomes statekit's (one process, as accelerate's
    class does not shard); any other batch sampler is used as given, as accelerate does.
    """

    def __init__(self, dataset: Any, device: Any = None, rng_types: Any = None, synchronized_generator: Any = None,
                 skip_batches: int = 0, use_stateful_dataloader: bool = False, _drop_last: bool = False,
                 _non_blocking: bool = False, torch_device_mesh: Any = None, iteration: int = 0, **kwargs: Any) -> None:
        kwargs = _convert(dataset, kwargs, _data.DataLoaderConfiguration(dispatch_batches=False), 1, 0,
                          use_stateful_dataloader)
        skip_batches = self._build_base(dataset, use_stateful_dataloader, kwargs, iteration, skip_batches)
        self._init_kwargs = dict(kwargs, device=device, rng_types=rng_types, synchronized_generator=synchronized_generator,
                                 use_stateful_dataloader=use_stateful_dataloader, _drop_last=_drop_last,
                                 _non_blocking=_non_blocking, torch_device_mesh=torch_device_mesh)
        self.device = device
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self.gradient_state = _acc.GradientState()
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.iteration = iteration

    # An iterable dataset with torchdata's `state_dict`/`load_state_dict` (one process reads it:
    # per-rank sharding, no workers) resumes from its own state, in O(1), as statekit.data's
    # iterable loaders do; any other stream replays the batches it had handed out.
    _stream_batches = 0
    _stream_snapshot: Any = None
    _stream_restore: Any = None
    _pass_starting = False

    def _stream(self) -> Any:
        """The user's dataset and statekit's shard around it (or None), where the position can
        be taken from the dataset's own state."""
        shard = self.dataset if isinstance(self.dataset, _data.IterableDatasetShard) else None
        stream = shard.dataset if shard is not None else self.dataset
        stateful = (isinstance(stream, IterableDataset) and self.num_workers == 0
                    and callable(getattr(stream, "state_dict", None)) and callable(getattr(stream, "load_state_dict", None)))
        return (stream, shard) if stateful else (None, None)

    def __iter__(self) -> Any:
        self._start_pass()
        self._pass_starting = True
        if self._stream_restore is None:
            self._stream_batches = 0
        yield from super().__iter__()
        self._end_pass()
        self._stream_batches, self._stream_snapshot = 0, None

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        restore, self._stream_restore = self._stream_restore, None
        if self._pass_starting and restore is not None:
            # after the dataset's set_epoch (which may rewind it), before its first item is read
            stream, shard = self._stream()
            stream.load_state_dict(restore["stream"])
            if shard is not None and restore.get("first") is not None:
                shard._st_resume_first = restore["first"]
            self._stream_batches = restore["batches"]
        elif restore is not None:
            self._stream_restore = restore
        self._pass_starting = False

    def _update_state_dict(self) -> None:
        # accelerate calls this before each read ahead, when the batches handed out and the
        # stream's position agree: the stream's state is taken then
        super()._update_state_dict()
        stream, shard = self._stream()
        if stream is not None:
            self._stream_batches += 1
            self._stream_snapshot = {"stream": stream.state_dict(), "batches": self._stream_batches,
                                     "first": None if shard is None else shard._st_first}

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        if self._stream()[0] is None:
            return state
        state = dict(state, _statekit_stream=self._stream_snapshot)
        if self._stream_snapshot is not None:  # the batches of this epoch, resumed ones included
            state["_num_yielded"] = state["_sampler_iter_yielded"] = self._stream_snapshot["batches"]
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        snapshot = state_dict.get("_statekit_stream") if isinstance(state_dict, dict) else None
        if snapshot is None or self._stream()[0] is None:
            return super().load_state_dict(state_dict)
        self._stream_restore = snapshot  # O(1): the base loader replays nothing
        self._pass.position_set()

    def __reduce__(self) -> Any:
        return (_bare, (DataLoaderShard,), self._pickled())

    @property
    def total_batch_size(self) -> int:
        if self._statekit is None:
            total: int = super().total_batch_size
            return total
        return self._total()


class DataLoaderDispatcher(_Positioned, _acc.DataLoaderDispatcher):  # type: ignore[misc]  # accelerate is untyped
    """accelerate's ``DataLoaderDispatcher`` (same arguments).

    A map-style dataset: every rank reads its own slice of rank 0's global batches, which
    ``statekit.data``'s dispatch plan computes (nothing is broadcast per batch); the slices,
    the padding of a last uneven global batch and ``remainder`` (the rows of that batch, which
    ``gather_for_metrics`` keeps) are accelerate's. An iterable dataset: accelerate's dispatcher
    itself (rank 0 reads the stream and broadcasts each global batch).
    """

    _dispatched = True

    def __init__(self, dataset: Any, split_batches: bool = False, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 slice_fn: Optional[Callable[..., Any]] = None, torch_device_mesh: Any = None, iteration: int = 0,
                 **kwargs: Any) -> None:
        self.state = PartialState()
        config = _data.DataLoaderConfiguration(dispatch_batches=True, split_batches=split_batches)
        kwargs = _convert(dataset, kwargs, config, self.state.num_processes, self.state.process_index,
                          use_stateful_dataloader)
        skip_batches = self._build_base(dataset, use_stateful_dataloader, kwargs, iteration, skip_batches)
        self._init_kwargs = dict(kwargs, split_batches=split_batches, use_stateful_dataloader=use_stateful_dataloader,
                                 _drop_last=_drop_last, _non_blocking=_non_blocking, slice_fn=slice_fn,
                                 torch_device_mesh=torch_device_mesh)
        self.split_batches = split_batches
        self.gradient_state = _acc.GradientState()
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.skip_batches = skip_batches
        self.torch_device_mesh = torch_device_mesh
        self.slice_fn = _acc.slice_tensors if slice_fn is None else slice_fn
        self.iteration = iteration
        self.submesh_tp = self.submesh_dp = self.submesh_fsdp = None
        if torch_device_mesh is not None and self._statekit is not None:
            raise ValueError("statekit.accelerate: a device mesh is accelerate's (prepare_data_loader hands it over)")

    def __iter__(self) -> Any:
        self._start_pass()
        if self._statekit is None:
            yield from super().__iter__()
        else:
            yield from self._iter_slices()
        self._end_pass()

    def _iter_slices(self) -> Any:
        # accelerate's loop, one batch ahead to know the last, over slices each rank reads itself.
        self.begin()
        self.set_epoch(self.iteration)
        it = iter(self.base_dataloader)
        try:
            current = next(it)
        except StopIteration:
            self.end()
            return
        while True:
            current = send_to_device(current, self.state.device, non_blocking=self._non_blocking)
            self._update_state_dict()
            try:
                following = next(it)
            except StopIteration:
                self.end_of_dataloader = True
                self._update_state_dict()
                self.remainder = self._last_rows()
                yield current
                break
            yield current
            current = following
        self.iteration += 1
        self.end()

    def _last_rows(self) -> int:
        """The rows of the last global batch rank 0 would have read (accelerate's dispatcher sets
        ``remainder`` to them; -1 where there is none)."""
        rows = self._statekit._native.epoch_remainder()
        return -1 if rows is None else rows

    def adjust_state_dict_for_prefetch(self) -> None:
        # accelerate's correction is for rank 0 reading `num_processes` batches a step; here each
        # rank's base loader reads one slice a step.
        if self._statekit is None:
            super().adjust_state_dict_for_prefetch()

    def set_epoch(self, epoch: int) -> None:
        if self._statekit is None:
            super().set_epoch(epoch)
            return
        self.iteration = epoch
        self._statekit.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):  # as accelerate does where the sampler has no set_epoch chain
            self.dataset.set_epoch(epoch)

    def __reduce__(self) -> Any:
        return (_bare, (DataLoaderDispatcher,), self._pickled())

    @property
    def total_batch_size(self) -> int:
        if self._statekit is None:
            bs: int = self.base_dataloader.batch_size
            return bs if self.split_batches else bs * self.state.num_processes
        return self._total()


# --- prepare_data_loader, skip_first_batches, patch ------------------------------------------

def prepare_data_loader(
    dataloader: DataLoader[Any],
    device: Optional[torch.device] = None,
    num_processes: Optional[int] = None,
    process_index: Optional[int] = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Optional[List[Any]] = None,
    dispatch_batches: Optional[bool] = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Optional[Callable[..., Any]] = None,
    use_seedable_sampler: bool = False,
    data_seed: Optional[int] = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> DataLoader[Any]:
    """accelerate 1.15's ``prepare_data_loader`` (same arguments, same checks and defaults),
    giving this module's loaders. Inputs statekit does not model go to accelerate's own."""
    state = PartialState()
    dataset: Any = dataloader.dataset  # (becomes statekit's IterableDatasetShard around it)
    iterable = isinstance(dataset, IterableDataset)
    sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    accelerate_only = (
        torch_device_mesh is not None
        or state.distributed_type in (DistributedType.XLA, DistributedType.MEGATRON_LM)
        or (not iterable and (sampler_is_batch_sampler or not _modelled(dataloader.batch_sampler)))
    )
    if accelerate_only:
        theirs: DataLoader[Any] = _acc.prepare_data_loader(
            dataloader, device, num_processes, process_index, split_batches, put_on_device, rng_types,
            dispatch_batches, even_batches, slice_fn_for_dispatch, use_seedable_sampler, data_seed, non_blocking,
            use_stateful_dataloader, torch_device_mesh)
        return theirs
    world = state.num_processes if num_processes is None else num_processes
    rank = state.process_index if process_index is None else process_index
    # `dataload` resolves the configuration as accelerate does: `dispatch_batches=None`'s
    # default, the refusal to dispatch without device placement, the rank, the `split_batches`
    # checks (on the batch sampler's size where the loader has none) and the batch size of the
    # rank's own loader.
    batch_size: Any = dataloader.batch_size
    if batch_size is None:
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
    dispatch_batches, loader_batch_size = _native.resolve_loader(
        iterable, batch_size, world, rank, bool(put_on_device), bool(split_batches),
        None if dispatch_batches is None else bool(dispatch_batches), bool(even_batches))
    kwargs = {k: getattr(dataloader, k, _KWARGS[k]) for k in _KWARGS if k not in _IGNORED}
    synchronized_generator = None
    if iterable:
        if world != 1 and not dispatch_batches:
            if getattr(dataset, "generator", None) is not None:
                synchronized_generator = dataset.generator
            dataset = _data.IterableDatasetShard(dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last,
                                                 num_processes=world, process_index=rank, split_batches=split_batches)
        kwargs["drop_last"] = dataloader.drop_last
        kwargs["batch_size"] = loader_batch_size
    else:
        config = _data.DataLoaderConfiguration(
            split_batches=split_batches, dispatch_batches=bool(dispatch_batches), even_batches=even_batches,
            use_seedable_sampler=use_seedable_sampler, data_seed=data_seed, non_blocking=non_blocking,
            use_stateful_dataloader=use_stateful_dataloader)
        made = _statekit_sampler(dataset, dataloader.batch_sampler, world, rank, config, dataloader.collate_fn,
                                 dataloader.generator)
        kwargs.update(batch_sampler=made["batch_sampler"], collate_fn=made["collate_fn"], generator=made["generator"])
    # statekit computes the order from the generator's state: nothing to keep in step per pass.
    if rng_types is not None and synchronized_generator is None and "generator" in rng_types:
        rng_types.remove("generator")
    if dispatch_batches:
        kwargs.pop("generator")
        return DataLoaderDispatcher(dataset, split_batches=split_batches, _drop_last=dataloader.drop_last,
                                    _non_blocking=non_blocking, slice_fn=slice_fn_for_dispatch,
                                    use_stateful_dataloader=use_stateful_dataloader, **kwargs)
    return DataLoaderShard(dataset, device=device if put_on_device else None, rng_types=rng_types,
                           synchronized_generator=synchronized_generator, _drop_last=dataloader.drop_last,
                           _non_blocking=non_blocking, use_stateful_dataloader=use_stateful_dataloader, **kwargs)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """accelerate's ``skip_first_batches``: a loader whose passes start after their first
    ``num_batches`` batches (this rank's; steps for a dispatcher), from the epoch ``dataloader``
    is in; ``len()`` counts the rest, as accelerate's does. O(1) over statekit's sampler (a
    position); an iterable dataset replays them, as accelerate does; loaders that are not this
    module's go to accelerate's."""
    if not isinstance(dataloader, (DataLoaderShard, DataLoaderDispatcher)):
        return _acc.skip_first_batches(dataloader, num_batches=num_batches)
    kwargs = dict(dataloader._init_kwargs)
    if dataloader._statekit is not None:  # a copy of the sampler, positioned: O(1)
        kwargs["batch_sampler"] = copy.copy(dataloader._statekit)
        return type(dataloader)(dataloader.dataset, iteration=dataloader.iteration, skip_batches=num_batches, **kwargs)
    if isinstance(dataloader.dataset, IterableDataset):
        return type(dataloader)(dataloader.dataset, iteration=dataloader.iteration, skip_batches=num_batches, **kwargs)
    # a batch sampler statekit does not model: accelerate's replaying `SkipBatchSampler`, in our class
    if isinstance(kwargs.get("sampler"), BatchSampler):
        kwargs["sampler"] = _acc.SkipBatchSampler(kwargs["sampler"], skip_batches=num_batches)
    else:
        kwargs["batch_sampler"] = _acc.SkipBatchSampler(dataloader.batch_sampler, skip_batches=num_batches)
        for k in _IGNORED:
            if k != "batch_sampler":
                kwargs.pop(k, None)
    return type(dataloader)(dataloader.dataset, iteration=dataloader.iteration, **kwargs)


class _Patched:
    """What ``patch`` mixes into an accelerator's class: ``Accelerator.prepare_data_loader``
    (which ``prepare`` calls) and ``skip_first_batches``, over this module's functions. A
    class, not bound methods stored on the instance, so that the accelerator holds no reference
    to itself and is freed as soon as it is dropped (accelerate's tests check that)."""

    if TYPE_CHECKING:  # what the methods read of the accelerator (accelerate's `Accelerator`)
        _dataloaders: List[Any]
        device_placement: bool
        distributed_type: Any
        device: Any
        num_processes: int
        process_index: int
        split_batches: bool
        rng_types: List[Any]
        dispatch_batches: Optional[bool]
        even_batches: bool
        use_seedable_sampler: bool
        dataloader_config: Any
        non_blocking: bool
        use_stateful_dataloader: bool

        def _prepare_device_mesh(self) -> Any: ...

    def prepare_data_loader(self, data_loader: DataLoader[Any], device_placement: Optional[bool] = None,
                            slice_fn_for_dispatch: Optional[Callable[..., Any]] = None) -> Any:
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement if self.distributed_type != DistributedType.XLA else False
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.num_processes,
            process_index=self.process_index,
            split_batches=self.split_batches,
            put_on_device=device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=self.dispatch_batches,
            even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
            torch_device_mesh=self._prepare_device_mesh(),
        )
        self._dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        return skip_first_batches(dataloader, num_batches=num_batches)


_PATCHED: Dict[type, type] = {}


def patch(accelerator: Any) -> Any:
    """Makes ``accelerator.prepare(...)`` / ``prepare_data_loader(...)`` and
    ``accelerator.skip_first_batches(...)`` use this module's loaders (this accelerator only: its
    class becomes a subclass of its class with those two methods); returns it, so
    ``accelerator = patch(Accelerator(...))`` is the one line a script adds."""
    cls = type(accelerator)
    if issubclass(cls, _Patched):
        return accelerator
    if cls not in _PATCHED:
        _PATCHED[cls] = type(cls.__name__, (_Patched, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    accelerator.__class__ = _PATCHED[cls]
    return accelerator
