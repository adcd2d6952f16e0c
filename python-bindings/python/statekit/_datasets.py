"""Map-style datasets over ``dataload``'s sources (re-exported by ``statekit.data``).

Items that are views of a file (token windows, Arrow columns) view a private memory map of it.
A file that a concurrent writer truncates after it was opened is refused
(:class:`~statekit.errors.DataError`, "the file changed while opened") the next time a view is
made or a batch is read, instead of a read past its end killing the process with ``SIGBUS``.
A view already handed out cannot be guarded: reading it after its file shrank under it still
faults. Do not truncate or rewrite data files while a dataset over them is in use; copy them
out with ``get_batch`` (which reads with ``pread`` for token files) if they may change."""

from __future__ import annotations

import json
import mmap
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import numpy as np

from . import _native

if TYPE_CHECKING:
    from typing_extensions import Buffer

PathLike = Union[str, "os.PathLike[str]"]


def _indices(indices: Sequence[int], n: int) -> List[int]:
    out = []
    for i in indices:
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} is out of range for a dataset of {n}")
        out.append(i)
    return out


def _map_regular(path: str) -> mmap.mmap:
    """A private (copy-on-write) map of the regular file ``path``, opened by ``dataload``
    (through ``_native``): a FIFO or a device put in its place is refused by name, never waited
    on or read without end."""
    fd = _native.open_regular(path)
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def _whole(m: mmap.mmap, path: str) -> mmap.mmap:
    """``m`` once its file is checked to be no shorter than the map (``mmap.size()`` is the
    file's size now): reading a map past the end of its file kills the process."""
    _native.check_mapped(path, m.size(), len(m))
    return m


class _Base:
    _args: Tuple[Any, ...]

    if TYPE_CHECKING:
        def _item(self, i: int) -> Any: ...  # each dataset's own

    def __len__(self) -> int:
        return len(self._src)  # type: ignore[attr-defined]

    @property
    def fingerprint(self) -> str:
        """Identity of the files (names, sizes, rows): give it to ``ShardedBatchSampler`` so that
        a state saved over other data is refused."""
        return str(self._src.fingerprint)  # type: ignore[attr-defined]

    def __getitem__(self, i: int) -> Any:
        return self._item(_indices([i], len(self))[0])

    def __getstate__(self) -> Dict[str, Any]:
        # The native source and the memory maps are reopened in the receiving process
        # (DataLoader workers started with `spawn` get the dataset pickled).
        return {"args": self._args}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(*state["args"])  # type: ignore[misc]  # unpickling re-initializes


class TokenDataset(_Base):
    """Fixed-length windows over token files (nanoGPT ``.bin``, ``.npy``; a file, a folder or a
    glob). Item ``i`` is ``(input, target)``: numpy views of ``block_size`` tokens and the same
    shifted by one, over a private memory map of the file (no copy; ``torch.from_numpy`` gives a
    tensor over the same memory). ``get_batch(indices)`` collates windows into two ``int64``
    arrays of ``len(indices) × block_size``, read by Rust with the GIL released."""

    def __init__(self, path: PathLike, block_size: int, *, dtype: str = "uint16") -> None:
        self._args = (path, block_size)
        self._dtype_name = dtype
        self._src = _native.TokenSource(os.fspath(path), int(block_size), dtype)
        self.block_size = int(block_size)
        self._files = self._src.files()
        self._maps: Dict[int, mmap.mmap] = {}

    def __getstate__(self) -> Dict[str, Any]:
        return {"args": self._args, "dtype": self._dtype_name}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(*state["args"], dtype=state["dtype"])  # type: ignore[misc]  # unpickling re-initializes

    def _map(self, k: int) -> mmap.mmap:
        m = self._maps.get(k)
        if m is None:
            m = self._maps[k] = _map_regular(self._files[k][0])
        return _whole(m, self._files[k][0])

    def _item(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        k, offset = self._src.locate(i)
        window = np.frombuffer(self._map(k), dtype=self._files[k][2], count=self.block_size + 1, offset=offset)
        return window[:-1], window[1:]

    def get_batch(self, indices: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
        idx = _indices(indices, len(self))
        inputs = np.empty((len(idx), self.block_size), np.int64)
        targets = np.empty((len(idx), self.block_size), np.int64)
        # numpy's stubs give arrays `__buffer__` only from Python 3.12 on
        self._src.read_batch_into(idx, cast("Buffer", inputs), cast("Buffer", targets))
        return inputs, targets


def _columns(raw: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for name, v in raw.items():
        if isinstance(v, tuple):
            data, dtype, valid = v
            values = np.frombuffer(data, dtype=dtype)
            out[name] = values if valid is None else np.ma.MaskedArray(values, mask=~np.asarray(valid, dtype=bool))
        else:
            out[name] = v
    return out


class _TableDataset(_Base):
    _kind = ""

    def __init__(self, path: PathLike, *, columns: Optional[Sequence[str]] = None) -> None:
        self._args = (path,)
        self._columns = None if columns is None else list(columns)
        self._src = _native.TableSource(self._kind, os.fspath(path), self._columns)
        self._files = self._src.files()
        self._maps: Dict[int, mmap.mmap] = {}

    def _map(self, k: int) -> mmap.mmap:
        m = self._maps.get(k)
        if m is None:
            m = self._maps[k] = _map_regular(self._files[k])
        return _whole(m, self._files[k])

    def __getstate__(self) -> Dict[str, Any]:
        return {"args": self._args, "columns": self._columns}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(*state["args"], columns=state["columns"])  # type: ignore[misc]  # unpickling re-initializes

    def __getitem__(self, i: Union[int, slice]) -> Any:
        """Row ``i`` (a dict of scalars), or for a slice the rows it selects as ``get_batch``
        gives them (a slice with step 1 of an Arrow dataset: views of the map, see there)."""
        if isinstance(i, slice):
            return self.get_batch(range(*i.indices(len(self))))
        return super().__getitem__(i)

    def _item(self, i: int) -> Dict[str, Any]:
        return {k: v[0] for k, v in self.get_batch([i]).items()}

    def get_batch(self, indices: Sequence[int]) -> Dict[str, Any]:
        """The rows at ``indices`` as a dict of columns: numeric columns as numpy arrays (masked
        arrays where a column has nulls), strings as lists.

        Arrow IPC: when ``indices`` are consecutive ascending rows of one record batch, numeric
        columns without nulls whose values lie in the (uncompressed) file are numpy views of a private memory map of the file (``mmap.ACCESS_COPY``: no copy, and
        writes never reach the file). Other columns and other index lists are copied."""
        idx = _indices(indices, len(self))
        if idx and self._files and all(b == a + 1 for a, b in zip(idx, idx[1:], strict=False)):
            raw = self._src.read_range(idx[0], len(idx))
            if raw is not None:
                return self._viewed(raw, len(idx))
        return _columns(self._src.read_batch(idx))

    def _viewed(self, raw: Dict[str, Any], n: int) -> Dict[str, Any]:
        out = {}
        for name, v in raw.items():
            if isinstance(v, tuple) and len(v) == 4 and v[0] == "map":
                _, k, offset, dtype = v
                out[name] = np.frombuffer(self._map(k), dtype=dtype, count=n, offset=offset)
            else:
                out.update(_columns({name: v}))
        return out


class ArrowDataset(_TableDataset):
    """Rows of Arrow IPC files or streams (a file, a folder or a glob)."""

    _kind = "arrow"


class ParquetDataset(_TableDataset):
    """Rows of Parquet files, through a row-group index and a bounded cache."""

    _kind = "parquet"


class JsonlDataset(_Base):
    """Records of ``.jsonl`` / ``.jsonl.zst`` files, through a persisted line index. Items are
    the parsed records (``raw=True``: the JSON text)."""

    def __init__(self, path: PathLike, *, raw: bool = False) -> None:
        self._args = (path,)
        self._raw = raw
        self._src = _native.JsonlSource(os.fspath(path))

    def __getstate__(self) -> Dict[str, Any]:
        return {"args": self._args, "raw": self._raw}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(*state["args"], raw=state["raw"])  # type: ignore[misc]  # unpickling re-initializes

    def _item(self, i: int) -> Any:
        return self.get_batch([i])[0]

    def get_batch(self, indices: Sequence[int]) -> List[Any]:
        idx = _indices(indices, len(self))
        texts = self._src.read_batch(idx)
        if self._raw:
            return texts
        out = []
        for i, t in zip(idx, texts, strict=False):
            try:
                out.append(json.loads(t))
            except (ValueError, RecursionError) as e:
                # The index checked the record is JSON (UTF-8, nesting within 128 levels); what
                # is left is what Python's parser refuses (an integer past its digit limit).
                raise self._src.not_json(i, str(e)) from None
        return out


__all__ = ["TokenDataset", "ArrowDataset", "ParquetDataset", "JsonlDataset"]
