"""``ShardedBatchSampler``: one rank's batches of a map-style dataset, as ``dataload``'s sampler
computes them, with the torch generator and torchdata state glue around it. ``statekit.data``
is its public home (the classes here say so, for pickles and reprs)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import _native
from .errors import MalformedState, UsageError
from .mixture import Mixture

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
        # `iter()` starts the epoch again (`dataload`'s `PassState`).
        if batch is not None:
            owner._pass.batch_read()
        else:
            owner._pass.ended()
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
        # whether the next pass continues a position that was set or starts the epoch again
        self._pass = _native.PassState()
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
            self._pass.epoch_set()

    def skip_first_batches(self, num_batches: int) -> None:
        """accelerate's ``skip_first_batches`` for the current epoch, in O(1)."""
        self._native.skip_first_batches(_check_int("num_batches", num_batches, 0, _MAX_U64))
        self._pass.position_set()

    def resume_from_accelerate(self, folder: Any, *, dataloader: int = 0, step: Optional[int] = None,
                               epoch: Optional[int] = None) -> None:
        """Continues where an accelerate ``save_state`` folder says the data stream was:
        dataloader ``dataloader``'s stateful state (batches every rank had read), else ``step``
        (accelerate's resume recipe: the count passed to ``skip_first_batches``); the epoch from
        its pickled ``SeedableRandomSampler``, else ``epoch``. Saved on any world size."""
        self._native.resume_from_accelerate(os.fspath(folder), dataloader,
                                            None if step is None else int(step),
                                            None if epoch is None else int(epoch))
        self._pass.position_set()

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
            if not self._pass.position_kept:
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
        if self._pass.begin() == "broken_off":
            self._native.restart_epoch()

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
        self._pass = _native.PassState("positioned")
        self._dispatch, self._owns_generator, self._prefetched, self._draw_at_iter = state.get("pass", (False, True, 0, False))
        self._generator = None
        if gen is not None:
            import torch

            self._generator = torch.Generator()
            _set_state(self._generator, gen)

    def state_dict(self) -> Dict[str, Any]:
        """The position and the settings it is valid with (``dataload``'s ``LoaderState``)."""
        state: Dict[str, Any] = json.loads(self._native.state_json())
        return state

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
        self._pass.position_set()
        if self._random and self._generator is not None and self._owns_generator:
            if self._native.needs_generator:
                # The epoch has not started: its permutation is drawn from the saved running
                # state, after whatever the DataLoader draws first.
                running = self._native.running_generator()
                assert running is not None  # the loader shuffles from a generator
                _set_state(self._generator, running)
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
        ours: Dict[str, Any] = json.loads(
            self._native.torchdata_state(n, None if drawn_from is None else drawn_from.numpy().tobytes()))
        return ours


def _state_bytes(generator: Any) -> bytes:
    state: bytes = generator.get_state().numpy().tobytes()
    return state


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


DataLoaderConfiguration.__module__ = ShardedBatchSampler.__module__ = "statekit.data"
