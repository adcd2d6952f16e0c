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
import itertools
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import _native
from ._datasets import ArrowDataset, JsonlDataset, ParquetDataset, TokenDataset
from .errors import MalformedState, UsageError
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


_MAX_LEN = 2**63 - 1
_MAX_U64 = 2**64 - 1


# `v` when it is an int in `[lo, hi]`, else a `UsageError` naming `name` and the range (never
# the bare `OverflowError` of a conversion to a Rust integer): the native calls' own check.
_check_int = _native.check_int


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
        owner = self._owner
        if owner._random:
            owner._before_draw()
        batch = owner._native.next_batch()
        # (torchdata's RandomSampler wrote it back when it drew, at `iter()`; the loader has
        # drawn its base seed from it since)
        if owner._pending or (batch is None and owner._random and not owner._draw_at_iter):
            owner._write_back()
        # A pass that reads a batch and is not read to the end is broken off: the next
        # `iter()` starts the epoch again (see `ShardedBatchSampler.__iter__`).
        owner._read = batch is not None
        owner._kept = owner._kept and batch is None
        if batch is None:
            self._done = True
            raise StopIteration
        return batch

    def state_dict(self) -> Dict[str, Any]:
        return self._owner.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._done = False
        if isinstance(state, dict) and "batches_yielded" in state:
            # statekit.accelerate's form of accelerate's bare count: this rank's batches
            self._owner.skip_first_batches(state["batches_yielded"])
            return
        # torchdata's own record of one process (statekit.accelerate's loaders save that)
        if isinstance(state, dict) and "samples_yielded" in state:
            state = self._owner._from_torchdata(state)
        self._owner.load_state_dict(state)


def _torchdata_iter_state(state: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A one-process position as torchdata's own ``BatchSampler`` iterator records it:
    ``samples_yielded``, and for a shuffle drawn from a generator the ``RandomSampler``
    iterator's ``yielded`` and ``generator`` (the state the epoch's permutation was drawn from).
    None where that does not say it all (``dataload``'s ``LoaderState::to_torchdata``)."""
    words = _native.torchdata_position(json.dumps(state))
    if words is None:
        return None
    n, generator = words
    out: Dict[str, Any] = {"samples_yielded": n}
    if generator is not None:
        out["sampler_iter_state"] = {"yielded": n, "generator": _state_tensor(generator)}
    return out


class ShardedBatchSampler:
    """The batches of one rank, exactly as accelerate's ``prepare_data_loader(...,
    use_seedable_sampler=True)`` deals them (``dispatch_batches=False``); use it as a torch
    ``DataLoader``'s ``batch_sampler``, with any ``num_workers``.

    ``num_processes``/``process_index`` default to torch.distributed's world when it is
    initialized, else 1/0. ``seed`` is the seedable sampler's ``data_seed`` (used with
    ``shuffle``). With ``shuffle`` and a CPU ``generator`` (a ``torch.Generator``) instead, the
    order is accelerate's default shuffle (``use_seedable_sampler=False``): torch's
    ``RandomSampler`` drawing each epoch's ``randperm`` from the generator's running state,
    which the generator then holds, as it would in accelerate (over torch.distributed, rank 0's
    state is taken at the start of each epoch, as accelerate synchronizes it).
    ``fingerprint`` (any string) names the dataset: a state saved over another fingerprint is
    refused. ``mixture`` (a ``Mixture`` of ``length`` samples) is the mixture the dataset is:
    the state records its definition, and a state of another mixture is refused by field
    (``mixture.weights``, ...).

    Reading an epoch to its end moves to the next one, as accelerate's sampler does. A pass
    broken off (a ``break``) is not continued by the next ``iter()``: as torch's and
    accelerate's samplers do, that starts the epoch again, from the same order for the seedable
    and sequential samplers, from a new draw of the running generator for the default shuffle
    (the broken-off pass's draw advanced it). Only a position that was set, by
    ``load_state_dict``, ``skip_first_batches`` or ``resume_from_accelerate``, is continued.
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
        generator: Any = None,
        mixture: Optional[Mixture] = None,
    ) -> None:
        world, rank = _world(num_processes, process_index)
        seedable = generator is None
        if shuffle and seedable:
            seed = _check_int("seed", seed, -(2**63), _MAX_U64)
        config = DataLoaderConfiguration(
            split_batches=split_batches,
            dispatch_batches=False,
            even_batches=even_batches,
            use_seedable_sampler=seedable,
            data_seed=int(seed) if shuffle and seedable else None,
        )
        self._init(length, batch_size, world, rank, shuffle, drop_last, config, fingerprint, generator, mixture)

    def _init(self, length, batch_size, world, rank, shuffle, drop_last, config, fingerprint, generator=None,  # type: ignore[no-untyped-def]
              mixture=None) -> None:
        # Python's `len` counts to 2^63 - 1: a longer dataset would be accepted here and fail
        # at `len(sampler)`; the other counts are refused by dataload, by name, past its limits.
        length = _check_int("length", length, 0, _MAX_LEN)
        batch_size, world, rank = (_check_int(name, v, 0, _MAX_U64) for name, v in (
            ("batch_size", batch_size), ("num_processes", world), ("process_index", rank)))
        if config.data_seed is not None:
            _check_int("data_seed", config.data_seed, -(2**63), _MAX_U64)
        # accelerate's default shuffle: epochs drawn from `generator`'s running state, or (one
        # rank, no generator: torch's RandomSampler untouched) from a generator seeded from
        # torch's global one at each epoch.
        self._random = bool(shuffle) and not config.use_seedable_sampler
        self._generator = generator if self._random else None
        self._pending = False
        self._read = False  # a batch of the current epoch was read by a pass not finished
        self._kept = False  # a position set (loaded, skipped to, unpickled) that no batch was read from yet
        # Dispatched (accelerate's DataLoaderDispatcher), rank 0 alone reads the underlying
        # loader: its generator draws every epoch, and the others' stay as they are.
        self._dispatch = bool(config.dispatch_batches)
        self._owns_generator = not (self._dispatch and rank != 0)
        self._prefetched = 0  # dispatched: underlying batches torch's workers ask for on every rank
        first = None
        if self._random:
            import torch

            if generator is not None and (not isinstance(generator, torch.Generator) or generator.device.type != "cpu"):
                raise UsageError(f"`generator` must be a CPU `torch.Generator`, not {generator!r}")
            first = _state_bytes(generator if generator is not None else torch.Generator())
        if mixture is not None and not isinstance(mixture, Mixture):
            raise UsageError(f"`mixture` must be a `statekit.data.Mixture`, not {type(mixture).__name__}")
        self._native = _native.Sampler(length, batch_size, world, rank, bool(shuffle), bool(drop_last), config._json(),
                                       fingerprint, first, None if mixture is None else mixture.spec_json())
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
        epoch = _check_int("epoch", epoch, 0, _MAX_U64)
        if epoch != self._native.epoch:
            self._native.set_epoch(epoch)
            self._read = False
            self._kept = False

    def skip_first_batches(self, num_batches: int) -> None:
        """accelerate's ``skip_first_batches`` for the current epoch, in O(1)."""
        self._native.skip_first_batches(_check_int("num_batches", num_batches, 0, _MAX_U64))
        self._read = False
        self._kept = True

    def resume_from_accelerate(self, folder: Any, *, dataloader: int = 0, step: Optional[int] = None,
                               epoch: Optional[int] = None) -> None:
        """Continues where an accelerate ``save_state`` folder says the data stream was:
        dataloader ``dataloader``'s stateful state (batches every rank had read), else ``step``
        (accelerate's resume recipe: the count passed to ``skip_first_batches``); the epoch from
        its pickled ``SeedableRandomSampler``, else ``epoch``. Saved on any world size."""
        self._native.resume_from_accelerate(os.fspath(folder), dataloader,
                                            None if step is None else int(step),
                                            None if epoch is None else int(epoch))
        self._read = False
        self._kept = True

    def __len__(self) -> int:
        return int(self._native.epoch_len())

    def __iter__(self) -> Iterator[List[int]]:
        self._new_pass()
        if (self._random and not self._dispatch and self._generator is not None and self._native.needs_generator
                and self.num_processes > 1):
            # accelerate's DataLoaderShard synchronizes the sampler's generator from rank 0 at
            # each `__iter__`, before torch's DataLoader draws its base seed from it.
            coll = _collective(self.num_processes, self.process_index)
            if coll is not None:
                theirs = coll.broadcast(0, _state_bytes(self._generator) if coll.rank == 0 else None)
                _set_state(self._generator, theirs)
        if self._draw_at_iter and self._random:
            # torchdata's own RandomSampler draws a permutation each time its iterator is made
            # (torch's loader with workers makes two), before the loader takes its base seed
            # from the same generator; a position that was set is kept.
            if not self._kept:
                self._native.restart_epoch()
            self._before_draw()
            self._native.remaining()  # draws the epoch's order now, from the state just set
            if self._pending:
                self._write_back()
        return _EpochIterator(self)

    # Set where the batches stand for torchdata's `RandomSampler` (a `StatefulDataLoader` made
    # with `shuffle=True`): each epoch drawn at `iter()` rather than at the first batch.
    _draw_at_iter = False

    def _new_pass(self) -> None:
        """After a pass broken off, the epoch starts again (a random sampler draws anew from the
        running generator, where the broken-off pass's draw left it, as torch's RandomSampler
        does at each ``iter()``); the epoch number stays, as accelerate's ``iteration`` does."""
        if self._read:
            self._native.restart_epoch()
            self._read = False

    def _draw_state(self) -> bytes:
        """The running state the epoch is drawn from here: the generator's, or (none given) a
        fresh one seeded from torch's global generator, as torch's RandomSampler seeds its own."""
        if self._generator is not None:
            return _state_bytes(self._generator)
        import torch

        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        return _state_bytes(torch.Generator().manual_seed(seed))

    def _before_draw(self) -> None:
        """The current epoch is drawn from the generator's running state as it is now (torch's
        RandomSampler draws at its first index, after the DataLoader took its base seed).
        Dispatched over torch.distributed, it is rank 0's: accelerate's rank 0 alone draws the
        order (from its own generator, or from a seed its global generator gives), so rank 0
        sends that state to the others here, at each epoch's first batch, through the
        collective the dispatcher's settings came by; the others draw nothing themselves."""
        if not self._native.needs_generator:
            return
        coll = _collective(self.num_processes, self.process_index) if self._dispatch and self.num_processes > 1 else None
        if coll is not None:
            state = coll.broadcast(0, self._draw_state() if coll.rank == 0 else None)
            self._native.set_generator(state)
            self._pending = coll.rank == 0 and self._generator is not None
            if coll.rank != 0 and self._generator is not None:
                self._shadow_prefetch()
            return
        if self._generator is not None:
            self._native.set_generator(_state_bytes(self._generator))
            self._pending = True
        else:
            import torch

            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            self._native.set_generator(_state_bytes(torch.Generator().manual_seed(seed)))

    def _shadow_prefetch(self) -> None:
        """accelerate's other ranks make the underlying loader's iterator too, and with workers
        torch prefetches ``prefetch_factor * num_workers`` batches from it at once: their
        RandomSampler draws one permutation from their own generator, or two (dataload counts
        the draws). Their generators move on the same way here."""
        if self._prefetched:
            _set_state(self._generator, self._native.prefetch_advanced(_state_bytes(self._generator), self._prefetched))

    def _write_back(self) -> None:
        """The generator advances as torch's RandomSampler advances it: by the epoch's draw."""
        self._pending = False
        state = self._native.running_generator()
        if state is not None and self._generator is not None and self._owns_generator:
            _set_state(self._generator, state)

    def __getstate__(self) -> Dict[str, Any]:
        # Pickles (spawned workers, copies) as its settings and position.
        gen = None if self._generator is None else _state_bytes(self._generator)
        return {"state": self._native.state_json(), "world": self.num_processes, "rank": self.process_index,
                "attrs": (self.length, self.batch_size, self.drop_last, self.shuffle),
                "random": (self._random, gen, self._pending),
                "pass": (self._dispatch, self._owns_generator, self._prefetched, self._draw_at_iter)}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._native = _native.Sampler.from_state(state["state"], state["world"], state["rank"])
        self.length, self.batch_size, self.drop_last, self.shuffle = state["attrs"]
        self._random, gen, self._pending = state["random"]
        # A copy continues from the position it was taken at (a position set, like a loaded one).
        self._read = False
        self._kept = True
        self._dispatch, self._owns_generator, self._prefetched, self._draw_at_iter = state.get("pass", (False, True, 0, False))
        self._generator = None
        if gen is not None:
            import torch

            self._generator = torch.Generator()
            _set_state(self._generator, gen)

    def state_dict(self) -> Dict[str, Any]:
        """The position and the settings it is valid with (``dataload``'s ``LoaderState``)."""
        return json.loads(self._native.state_json())

    def load_state_dict(self, state_dict: Optional[Dict[str, Any]]) -> None:
        """Continues from ``state_dict``, saved on any world size; settings that differ are
        refused with ``StateMismatch`` naming the field. A shuffle drawn from a generator
        redraws the saved epoch from the generator state the epoch started with (nothing is
        replayed) and leaves the generator where the uninterrupted run left it. ``None``
        changes nothing: it is what torchdata saved for a batch sampler it keeps no state of,
        whose position is in the iterator's state."""
        if state_dict is None:
            return
        self._native.load_state_json(json.dumps(state_dict))
        self._read = False
        self._kept = True
        if self._random and self._generator is not None and self._owns_generator:
            if self._native.needs_generator:
                # The epoch has not started: its permutation is drawn from the saved running
                # state, after whatever the DataLoader draws first.
                _set_state(self._generator, self._native.running_generator())
            else:
                self._pending = True


    def _from_torchdata(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """statekit's state for a position torchdata's ``BatchSampler`` iterator recorded (one
        process: ``samples_yielded`` of this sampler's order in the current epoch, and for a
        shuffle the generator state its permutation was drawn from), with this sampler's
        settings (``dataload``'s ``LoaderState::with_torchdata``)."""
        n = state["samples_yielded"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise MalformedState(f"torchdata's `samples_yielded` is {n!r}, not a sample count", variant="MalformedState")
        inner = state.get("sampler_iter_state")
        drawn_from = inner.get("generator") if isinstance(inner, dict) else None
        return json.loads(self._native.torchdata_state(n, None if drawn_from is None else drawn_from.numpy().tobytes()))


def _state_bytes(generator: Any) -> bytes:
    return generator.get_state().numpy().tobytes()


def _state_tensor(state: bytes) -> Any:
    """A generator's ``get_state()`` tensor from its bytes."""
    import torch

    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def _set_state(generator: Any, state: bytes) -> None:
    generator.set_state(_state_tensor(state))


def _collective(world: int, rank: int) -> Any:
    """``TorchCollective`` when torch.distributed runs this world, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world and dist.get_rank() == rank:
        from ._dist import TorchCollective

        return TorchCollective(rank, world)
    return None


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


# --- iterable datasets (accelerate's IterableDatasetShard and DataLoaderDispatcher) -------------

def _iterable_shard_class() -> Any:
    global _IterableDatasetShard
    if _IterableDatasetShard is None:
        import torch
        from torch.utils.data import IterableDataset

        class IterableDatasetShard(IterableDataset):
            """accelerate 1.15's ``IterableDatasetShard``: every rank reads the whole stream, cuts
            it into global batches (``batch_size`` with ``split_batches``, else ``batch_size *
            num_processes``) and keeps its slice of each; unless ``drop_last``, the last short
            global batch is completed with whole copies of the first one. ``len()`` is
            accelerate's, which ignores ``split_batches`` (too large in split mode)."""

            def __init__(self, dataset: Any, batch_size: int = 1, drop_last: bool = False,
                         num_processes: int = 1, process_index: int = 0, split_batches: bool = False) -> None:
                if split_batches and batch_size > 1 and batch_size % num_processes != 0:
                    raise UsageError(
                        f"IterableDatasetShard(split_batches=True): batch size {batch_size} does not divide "
                        f"among {num_processes} processes"
                    )
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
                for from_first, i in _native.stream_plan(*args, len(cur), first and len(first))[1] if cur else ():
                    yield (first if from_first else cur)[i]  # type: ignore[index]

        IterableDatasetShard.__module__ = __name__
        IterableDatasetShard.__qualname__ = "IterableDatasetShard"
        _IterableDatasetShard = IterableDatasetShard
    return _IterableDatasetShard


_IterableDatasetShard: Any = None
_LOADERS: Dict[Tuple[type, bool], type] = {}


def __getattr__(name: str) -> Any:
    # ``IterableDatasetShard`` subclasses torch's ``IterableDataset``; torch is imported on first use.
    if name == "IterableDatasetShard":
        return _iterable_shard_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _concat(data: List[Any]) -> Any:
    import torch
    from collections.abc import Mapping

    if isinstance(data[0], (tuple, list)):
        items = [_concat([d[i] for d in data]) for i in range(len(data[0]))]
        return type(data[0])(*items) if hasattr(data[0], "_fields") else type(data[0])(items)
    if isinstance(data[0], Mapping):
        return type(data[0])({k: _concat([d[k] for d in data]) for k in data[0].keys()})
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
    import torch
    from collections.abc import Mapping

    if isinstance(data, (tuple, list)):
        items = [_slice(d, sl) for d in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, Mapping):
        return type(data)({k: _slice(v, sl) for k, v in data.items()})
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
    import torch
    from collections.abc import Mapping

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

    class _Iterable(base):  # type: ignore[misc, valid-type]
        def set_epoch(self, epoch: int) -> None:
            self.iteration = epoch
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(epoch)

        def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
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
                    if action == "fetch":
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
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"prepare_data_loader: process_index {rank} is not in a world of {world}")
    split = bool(config.split_batches)
    # accelerate resolves dispatch_batches=None to True here (an Accelerator places on a device)
    dispatch = True if config.dispatch_batches is None else bool(config.dispatch_batches)
    if batch_size is None:
        # Unbatched: the loader yields samples as they come. accelerate's dispatcher then joins
        # P samples a step and cuts them like a batch, and one rank reads them as they are;
        # `split_batches` needs a batch size and its IterableDatasetShard fails on None.
        if split:
            raise UsageError("prepare_data_loader(split_batches=True): an unbatched loader (`batch_size=None`) has no "
                             "batch size to split")
        if not dispatch and world > 1:
            raise UsageError("prepare_data_loader(dispatch_batches=False): an unbatched loader (`batch_size=None`) over "
                             "an iterable dataset cannot be sharded per rank (accelerate's IterableDatasetShard needs a "
                             "batch size); use dispatch_batches=True or give a batch size")
    elif split and batch_size > 1 and batch_size % world != 0:
        raise UsageError(
            f"prepare_data_loader(split_batches=True): batch size {batch_size} does not divide "
            f"among {world} processes"
        )
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
        if split and batch_size // world == 0:  # accelerate passes batch_size=0 on, which torch refuses
            raise UsageError(f"batch_size should be a positive integer value, but got batch_size={batch_size // world} "
                             f"(split_batches: {batch_size} // {world} processes)")
        dataset = dataloader.dataset
        if world != 1:
            dataset = _iterable_shard_class()(dataset, batch_size=batch_size, drop_last=drop_last,
                                               num_processes=world, process_index=rank, split_batches=split)
        loader = _iterable_loader_class(Loader, False)(
            dataset, batch_size=batch_size // world if split else batch_size, drop_last=drop_last,
            generator=dataloader.generator, **common)
    loader.iteration, loader._st_skip, loader._st_yielded, loader._st_restore = 0, 0, 0, None
    return loader


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
    if shuffle and not config.use_seedable_sampler:
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
