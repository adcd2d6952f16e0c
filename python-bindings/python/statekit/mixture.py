"""Weighted mixtures of sources: one deterministic order over many datasets (``statekit.data.Mixture``).

A mixture's order is a pure function of its definition (the sources' lengths, the weights, a
seed, the sources read ``once``, the length, weight changes) and the position: ``locate(i)``
says which source and which of its samples position ``i`` is, and ``positions(i)`` how many
samples each source has given before it, both in O(1) (one block of at most a few dozen
positions for usual weights), with no index array. Proportions are exact: over any prefix, each
source's count is within one block's share of its weight. A source repeats (reshuffled each
time it runs out) unless it is read ``once``, in which case it leaves the mixture when used up and
the other weights are renormalized.

Read a mixture through ``ShardedBatchSampler(len(m), ..., mixture=m)`` (sequential: the order
is the mixture's own): rank sharding, ``state_dict``, elastic resume and ``statekit.accelerate``
work as for any dataset, and the sampler's state records the mixture's definition, so that a
state is refused, by field (``mixture.weights``, ...), against another mixture.
"""

from __future__ import annotations

import json
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from . import _native
from .errors import UsageError

__all__ = ["Mixture"]


class Mixture:
    """A weighted mixture of sources of lengths ``sizes``, ``weights`` one per source (any
    positive scale). ``once``: the indices of the sources read once (the others repeat);
    ``length``: the mixture's number of samples, required unless every source is read once
    (then it is their total). ``seed`` (an int in [0, 2^64 - 1]) orders the interleaving and
    every source's permutations.

    ``Mixture.of(datasets, weights, ...)`` makes one over map-style datasets that is itself a
    map-style dataset (a torch ``Dataset`` where torch is installed): item ``i`` is
    ``datasets[s][j]`` for ``(s, j) = locate(i)``."""

    _datasets: Optional[Tuple[Any, ...]] = None

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], *, seed: int = 0,
                 once: Sequence[int] = (), length: Optional[int] = None) -> None:
        self._native = _native.Mixture(list(sizes), list(weights), seed, list(once), length, [])
        self._datasets = None

    @classmethod
    def of(cls, datasets: Sequence[Any], weights: Sequence[float], *, seed: int = 0, once: Sequence[int] = (),
           length: Optional[int] = None) -> "Mixture":
        """A mixture of the map-style ``datasets`` (each with ``len`` and ``__getitem__``),
        which is itself a map-style dataset: ``m[i]`` is ``datasets[s][j]`` for
        ``(s, j) = m.locate(i)``. Their lengths are taken now: they must not change."""
        datasets = tuple(datasets)
        sizes = []
        for k, d in enumerate(datasets):
            try:
                sizes.append(len(d))
            except TypeError:
                raise UsageError(f"Mixture.of: dataset {k} ({type(d).__name__}) has no length; a mixture reads "
                                 f"map-style datasets") from None
        native = _native.Mixture(sizes, list(weights), seed, list(once), length, [])
        return _made(native, datasets)

    # --- the definition --------------------------------------------------------------------

    @property
    def spec(self) -> Dict[str, Any]:
        """The definition as a loader state records it (``dataload``'s ``MixtureSpec``)."""
        spec: Dict[str, Any] = json.loads(self._native.spec_json())
        return spec

    def spec_json(self) -> str:
        return self._native.spec_json()

    @property
    def sizes(self) -> List[int]:
        return list(self.spec["sizes"])

    @property
    def weights(self) -> List[float]:
        return list(self.spec["weights"])

    @property
    def seed(self) -> int:
        return int(self.spec["seed"])

    @property
    def once(self) -> List[int]:
        return list(self.spec["once"])

    @property
    def changes(self) -> List[Tuple[int, List[float]]]:
        """The weight changes: ``(at, weights)``, new weights from position ``at`` on."""
        return [(int(c["at"]), list(c["weights"])) for c in self.spec.get("changes", [])]

    @property
    def datasets(self) -> Optional[Tuple[Any, ...]]:
        """The datasets of a mixture made by ``Mixture.of``, else None."""
        return self._datasets

    def reweighted(self, at: int, weights: Sequence[float]) -> "Mixture":
        """The same mixture with ``weights`` from position ``at`` on (a curriculum): every
        position before ``at`` is as it was, so a run that reached ``at`` at most goes on from
        its saved state with the new weights (a state saved past ``at`` is refused, by
        ``mixture.changes``: the positions it read would have changed)."""
        return _made(_native_of(self.spec, [(at, list(weights))]), self._datasets)

    # --- the order -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._native)

    @property
    def sources(self) -> int:
        return int(self._native.sources)

    def locate(self, i: int) -> Tuple[int, int]:
        """``(source, index)``: which source position ``i`` of the order reads, and which of
        its samples. A ``ValueError`` past the end."""
        return self._native.locate(i)

    def locate_many(self, indices: Sequence[int]) -> Tuple[List[int], List[int]]:
        """``locate`` of every position of ``indices``, as two lists (sources, indices); the
        positions of one block share its work."""
        return self._native.locate_many(indices)

    def positions(self, i: int) -> List[int]:
        """How many samples each source has given before position ``i`` (``0 <= i <= len``)."""
        return self._native.positions(i)

    def block_at(self, i: int) -> int:
        """The block size at position ``i``: over any prefix, each source's count is within one
        block's share of its weight."""
        return int(self._native.block_at(i))

    def __repr__(self) -> str:
        s = self.spec
        extra = f", changes={self.changes}" if s.get("changes") else ""
        return (f"{type(self).__name__}(sizes={s['sizes']}, weights={s['weights']}, seed={s['seed']}, "
                f"once={s['once']}, length={len(self)}{extra})")

    def __reduce__(self) -> Any:
        return (_rebuild, (self.spec, self._datasets))


class _MixtureDataset:
    """The map-style dataset side of ``Mixture.of`` (mixed into a torch ``Dataset`` where torch
    is installed)."""

    _datasets: Tuple[Any, ...]
    _native: Any

    def __len__(self) -> int:
        return len(self._native)

    def __getitem__(self, i: int) -> Any:
        n = len(self._native)
        try:
            k = operator.index(i)
        except TypeError:
            raise TypeError(f"mixture indices must be integers, not {type(i).__name__}") from None
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"index {i} is out of range for a mixture of {n}")
        s, j = self._native.locate(k)
        return self._datasets[s][j]

    def __getitems__(self, indices: Sequence[int]) -> List[Any]:
        """The items at ``indices``, each source's read together (its own ``__getitems__`` when
        it has one): what torch's ``DataLoader`` asks a batch of."""
        n = len(self._native)
        idx = []
        for i in indices:
            k = operator.index(i)
            if k < 0:
                k += n
            if not 0 <= k < n:
                raise IndexError(f"index {i} is out of range for a mixture of {n}")
            idx.append(k)
        sources, samples = self._native.locate_many(idx)
        rows: Dict[int, List[int]] = {}
        for row, s in enumerate(sources):
            rows.setdefault(s, []).append(row)
        out: List[Any] = [None] * len(idx)
        for s, where in rows.items():
            ds = self._datasets[s]
            wanted = [samples[r] for r in where]
            many = getattr(ds, "__getitems__", None)
            items = many(wanted) if callable(many) else [ds[j] for j in wanted]
            for r, item in zip(where, items, strict=False):
                out[r] = item
        return out

    def get_batch(self, indices: Sequence[int]) -> Any:
        """For a mixture of ``TokenDataset``s of one block size: the windows at ``indices`` as
        two ``int64`` arrays ``len(indices) × block_size`` (inputs, targets), read by Rust with
        the GIL released, each source's windows in one batch, as ``TokenDataset.get_batch``."""
        from ._datasets import TokenDataset

        if not all(isinstance(d, TokenDataset) for d in self._datasets):
            raise UsageError("Mixture.get_batch reads mixtures of `TokenDataset`s; use `__getitems__` (what torch's "
                             "DataLoader calls) for other datasets")
        import numpy as np

        n = len(self._native)
        idx = [k + n if k < 0 else k for k in map(operator.index, indices)]
        block = self._datasets[0].block_size
        inputs = np.empty((len(idx), block), np.int64)
        targets = np.empty((len(idx), block), np.int64)
        self._native.read_tokens_into([d._src for d in self._datasets], idx, inputs, targets)
        return inputs, targets


_DATASET_CLASS: Optional[type[Mixture]] = None


def _dataset_class() -> type[Mixture]:
    """``Mixture`` with the dataset side, over torch's ``Dataset`` when torch is installed
    (imported on the first ``Mixture.of``, not with the package)."""
    global _DATASET_CLASS
    if _DATASET_CLASS is None:
        bases: Tuple[type, ...] = (_MixtureDataset, Mixture)
        try:
            from torch.utils.data import Dataset

            bases += (Dataset,)
        except ImportError:
            pass
        # A subclass of `Mixture` (one of its bases), which `type()`'s signature cannot say.
        _DATASET_CLASS = cast("type[Mixture]", type("Mixture", bases, {"__module__": __name__,
                                                                       "__doc__": Mixture.__doc__,
                                                                       "__qualname__": "Mixture"}))
    return _DATASET_CLASS


def _made(native: Any, datasets: Optional[Tuple[Any, ...]]) -> Mixture:
    cls = Mixture if datasets is None else _dataset_class()
    obj = cls.__new__(cls)
    obj._native = native
    obj._datasets = datasets
    return obj


def _native_of(spec: Dict[str, Any], extra: Sequence[Tuple[int, Sequence[float]]] = ()) -> Any:
    changes = [(c["at"], c["weights"]) for c in spec.get("changes", [])] + list(extra)
    return _native.Mixture(spec["sizes"], spec["weights"], spec["seed"], spec["once"], spec["length"], changes)


def _rebuild(spec: Dict[str, Any], datasets: Optional[Tuple[Any, ...]]) -> Mixture:
    return _made(_native_of(spec), datasets)
