"""What statekit.accelerate's two loaders share: the base loader over statekit's sampler, a
position that survives ``iter()`` only when it was set, and the loader state in torchdata's
form (``dataload`` converts statekit's position to and from torchdata's words)."""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, Optional, Type, TypeVar

from torch.utils.data import DataLoader

from . import _native
from . import data as _data
from ._sampler import _torchdata_iter_state
from .errors import MalformedState


def _stateful_loader() -> Optional[Type[Any]]:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    loader: Type[Any] = StatefulDataLoader
    return loader


def _position_epoch(state: Any) -> Optional[int]:
    """The epoch a loader state (torchdata's form, with or without workers) holds statekit's
    position in, else None."""
    main = _main_snapshot(state)
    inner = None if main is None else main.get("_index_sampler_state")
    if not isinstance(inner, dict):
        return None
    try:
        text = json.dumps(inner)
    except (TypeError, ValueError):
        return None  # not a state of ours: torchdata's load says what it is
    return _native.state_epoch(text)


def _main_snapshot(state: Any) -> Optional[Dict[str, Any]]:
    """The part of a torchdata loader state that holds the samplers' states: the state itself,
    or with workers its ``_snapshot._main_snapshot``."""
    if not isinstance(state, dict):
        return None
    main = (state.get("_snapshot") or {}).get("_main_snapshot") if "_snapshot" in state else state
    return main if isinstance(main, dict) else None


def _torchdata_form(state: Any) -> Any:
    """``state`` with statekit's position in torchdata's own words where they say all of it
    (one process, see ``statekit._sampler._torchdata_iter_state``): the iterator's state as
    torchdata's ``BatchSampler`` iterator records it, and None for the batch sampler, which
    torchdata's keeps no state of. Else ``state`` itself."""
    main = _main_snapshot(state)
    inner = None if main is None else main.get("_sampler_iter_state")
    words = _torchdata_iter_state(inner) if isinstance(inner, dict) and "format" in inner else None
    if words is None or main is None:  # (no `main`, no words)
        return state
    return _with_main(state, dict(main, _index_sampler_state=None, _sampler_iter_state=words))


def _with_main(state: Dict[str, Any], main: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` with ``main`` in place of the part ``_main_snapshot`` finds."""
    if "_snapshot" in state:
        return dict(state, _snapshot=dict(state["_snapshot"], _main_snapshot=main))
    return main


_T = TypeVar("_T")


def _bare(cls: Type[_T]) -> _T:
    """An instance of ``cls`` not yet initialized, which unpickling fills with its attributes
    (accelerate's ``__reduce__`` calls the class on placeholder arguments, which ours would
    build a sampler from)."""
    return cls.__new__(cls)


class _Positioned:
    """What the two loaders share: the base loader built over statekit's sampler (torchdata's
    ``StatefulDataLoader`` where torchdata is installed, so that a state can be taken, else
    torch's ``DataLoader``), and a position that survives ``iter()`` only when it was set."""

    _statekit: Any = None
    _dispatched = False  # accelerate's DataLoaderDispatcher (rank 0 alone reads the base loader)
    _pass: Any = None  # `dataload`'s `PassState`: whether the next pass continues a set position
    _skip = 0

    def _build_base(self, dataset: Any, use_stateful_dataloader: bool, kwargs: Dict[str, Any], iteration: int,
                    skip_batches: int) -> int:
        """Makes the base loader; returns the ``skip_batches`` left for accelerate's replay."""
        self.use_stateful_dataloader = use_stateful_dataloader
        self._pass = _native.PassState()
        bs = kwargs.get("batch_sampler")
        self._statekit = bs if isinstance(bs, _data.ShardedBatchSampler) else None
        if self._statekit is not None and skip_batches:
            # accelerate's `skip_batches` (every pass skips them): here a position, set before
            # the base loader exists (a stateful one makes its iterator, and prefetches, now)
            self._skip = skip_batches
            self._statekit.set_epoch(iteration)
            self._statekit.skip_first_batches(skip_batches)
            self._pass.position_set()
            skip_batches = 0
        stateful = _stateful_loader()
        if use_stateful_dataloader and stateful is None:
            raise ImportError("StatefulDataLoader is not available. Please install torchdata version 0.8.0 or higher to use it.")
        # (stateful is None here only where it is not needed: raised above otherwise)
        if stateful is not None and (use_stateful_dataloader or self._statekit is not None):
            self.base_dataloader = stateful(dataset, **kwargs)
        else:
            self.base_dataloader = DataLoader(dataset, **kwargs)
        # accelerate takes a snapshot when the loader is made only for stateful loaders (it makes
        # the base iterator, and its workers); ours is taken on the first `state_dict()`.
        if use_stateful_dataloader:
            self.dl_state_dict = self.base_dataloader.state_dict()
        return skip_batches

    def _pickled(self) -> Dict[str, Any]:
        # torchdata's loader keeps its last iterator, which does not pickle (torch's keeps none
        # without persistent workers): the copy goes without it, its sampler keeps the position
        state = self.__dict__.copy()
        base: Any = state.get("base_dataloader")
        if getattr(base, "_iterator", None) is not None:
            base = state["base_dataloader"] = copy.copy(base)
            base._iterator = None
        return state

    def _start_pass(self) -> None:
        s = self._statekit
        start = self._pass.begin()
        if s is not None and (start == "broken_off" or (start == "fresh" and self._skip)):
            # accelerate's samplers start every pass at the start of the epoch (after the skipped
            # batches; the default shuffle from a new draw of its running generator): a pass
            # broken off (a `break`) starts again here, and the skip is a position set anew.
            s.set_epoch(self.iteration)
            s._new_pass()
            s.skip_first_batches(self._skip)
        # the pass is under way (a generator: this runs at its first batch)
        self._pass.batch_read()

    def _end_pass(self) -> None:
        """The pass was read to its end: the next one is not a restart."""
        self._pass.ended()

    def __len__(self) -> int:
        if self._statekit is None:
            n: int = super().__len__()  # type: ignore[misc]  # the loader class mixed in after this one
            return n
        return max(len(self.base_dataloader) - self._skip, 0)

    def state_dict(self) -> Dict[str, Any]:
        """torchdata's ``StatefulDataLoader`` state after the batches handed out so far. On one
        process, sequential or shuffled from a generator, it is key for key the state
        torchdata's loader (and accelerate's) saves for the same batches, whose own fields hold
        the whole position; elsewhere statekit's position is ``_index_sampler_state`` (the
        same on every rank), which holds the world size and the seed and epoch too."""
        if "dl_state_dict" not in self.__dict__:
            if not hasattr(self.base_dataloader, "state_dict"):
                raise AttributeError("state_dict needs torchdata's StatefulDataLoader (pip install torchdata)")
            self.dl_state_dict = self.base_dataloader.state_dict()
        state: Dict[str, Any] = _torchdata_form(self.dl_state_dict)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Continues from ``state_dict``. statekit's position, and torchdata's record of one
        process, load on any number of processes. accelerate's own record of a batch sampler
        that keeps no state (only ``_sampler_iter_yielded``, the batches this rank had handed
        out) skips that many of the batches of the epoch the next pass reads, as torchdata's
        fast-forward would, in O(1)."""
        epoch = _position_epoch(state_dict)
        if epoch is not None:
            self.iteration = epoch  # accelerate's `iteration` is not in the state; its epoch is
        if self._statekit is not None:
            state_dict = self._with_skip(state_dict)
        self._pass.position_set()
        self.base_dataloader.load_state_dict(state_dict)

    def _with_skip(self, state: Any) -> Any:
        """``state`` with accelerate's bare batch count made a skip the sampler's iterator
        loads (torchdata loads the iterator's state when the pass starts, after ``set_epoch``)."""
        main = _main_snapshot(state)
        if main is None or main.get("_index_sampler_state") is not None or main.get("_sampler_iter_state") is not None:
            return state
        k = main.get("_sampler_iter_yielded")
        if self._dispatched:
            # accelerate's dispatcher reads the underlying loader on rank 0 only: the other
            # ranks' records hold no count to continue from
            raise MalformedState(
                "statekit.accelerate: this loader state holds no position a dispatched loader can continue from "
                "(accelerate's own record of a batch sampler without state); save it from statekit's loader",
                variant="MalformedState")
        return _with_main(state, dict(main, _sampler_iter_state={"batches_yielded": k}))

    def _total(self) -> int:
        return int(self._statekit._native.global_batch)
