"""The exceptions of statekit, mirroring the Rust error enums.

``StatekitError`` is the root. Under it, one class per enum (``CheckpointError`` for
``ckpt::Error``, ``DataloadError`` for ``dataload::DataloadError``, ``CollectiveError``) and
groups of their variants (``InvalidCheckpoint`` for every defect of a checkpoint file,
``UnsafePickle`` for a pickle global that was refused, ``StateMismatch`` for a loader state
saved with other settings, ...). Every error whose cause is the operating system is also the
matching builtin: a missing file is a ``FileNotFoundError``, a permission problem a
``PermissionError`` (and both are ``OSError``).

Each exception has ``.variant``, the name of the Rust variant it came from.
"""

from __future__ import annotations

import errno as _errno
from typing import Any, Dict, Optional, Type


class StatekitError(Exception):
    """Root of every statekit error."""

    variant: str = ""

    def __init__(self, message: str = "", *, variant: str = "", **fields: Any) -> None:
        super().__init__(message)
        self.variant = variant
        for k, v in fields.items():
            setattr(self, k, v)


class UsageError(StatekitError, ValueError):
    """A call the bindings refuse before doing anything (a bad argument)."""


# ckpt::Error
class CheckpointError(StatekitError):
    """An error of ``ckpt``."""


class InvalidCheckpoint(CheckpointError):
    """The checkpoint is defective: a reader would trip on it (``verify`` reports these)."""


class UnsafePickle(InvalidCheckpoint):
    """A pickle asked for a global outside torch's weights-only set; nothing was executed.

    ``global_name`` is the global that was refused. For a torch file opened with
    ``allow_globals``, ``globals`` lists it and the file's other globals that are not allowed
    either: what ``allow_globals`` would need to read the file as data."""

    global_name: str
    globals: list[str]


class BadPickle(InvalidCheckpoint):
    """A pickle that does not parse, or exceeds its memory budget."""


class ChecksumMismatch(InvalidCheckpoint):
    """A file does not match its `SHA256SUMS` entry."""


class NotACheckpoint(CheckpointError):
    """The path is no checkpoint format ``ckpt`` reads."""


class BadOutput(CheckpointError, ValueError):
    """The output or the options of an operation are refused (it is a source, a bad size)."""


class BadOption(BadOutput):
    """An option that cannot be carried out as given (every ``Misuse`` of the Rust library):
    options that do not combine (``to="dcp"`` with ``dtype``), a value out of range, an option
    that does not apply to the source's format (``as_stored`` for a file that is not Megatron's),
    an ``allow_globals`` pattern that is not a dotted name, a prefix ending in ``.*`` or ``*``."""


class DestinationLocked(CheckpointError):
    """Another process is writing the same destination now: it holds the destination's lock
    file (``lock``, beside the destination). ``pid`` is that process's id (``None`` if it had
    not written it yet). Nothing was written; the call can be made again once it is done. A lock
    file left by a process that was killed is taken over, never refused."""

    path: str
    lock: str
    pid: Optional[int]


class DestinationsDiffer(BadOutput):
    """The ranks of a job were given different destinations for one operation (``rank`` named
    ``other`` where rank 0 named ``path``): they would each commit their own output, none of
    them whole. Raised on that rank; the others raise ``ShardedSaveError`` naming it."""

    path: str
    rank: int
    other: str


class HubError(CheckpointError):
    """A ``hf://`` source that cannot be had: a malformed address, a file missing from the
    cache while ``HF_HUB_OFFLINE=1``, a repository, revision or file the Hub does not have, a
    request the Hub refused for want of a token (``status`` 401 or 403: set ``HF_TOKEN``), a
    request that failed on the way (a timeout, a closed connection: run again to resume), or a
    download whose bytes do not match the Hub's ETag. ``repo`` and ``file`` name what it was
    about where the error knows them."""


class ShardedSaveError(CheckpointError):
    """``save_sharded`` failed on a rank, or the collective of a job's ranks did.

    A failed ``save_sharded`` raises the same exception on every rank: a ``ShardedSaveError``
    that is also the class of what failed (a ``BadOutput`` for a tensor that cannot be saved, an
    ``InvalidCheckpoint``, a ``DestinationLocked``, ...), with ``rank`` the rank it blames,
    ``path`` the folder and ``cause`` the Rust variant of what failed (``variant`` is
    ``ShardedSave``). An I/O failure is a ``ShardedSaveError`` whose ``cause`` is ``Io``: only
    its rank saw the ``OSError``, so no rank raises one."""

    rank: int
    path: str
    cause: str


# dataload::DataloadError
class DataloadError(StatekitError):
    """An error of ``dataload``."""


class InvalidConfiguration(DataloadError, ValueError):
    """A sampler or loader configuration accelerate would refuse, or out of range values."""


class StateError(DataloadError):
    """A loader state that cannot be loaded."""


class StateMismatch(StateError):
    """A loader state saved with other settings. ``field`` names the setting; ``saved`` and
    ``current`` are its two values as JSON."""

    field: str
    saved: str
    current: str


class MalformedState(StateError):
    """A loader state that does not parse, or is of another format or version."""


class DataError(DataloadError):
    """A dataset file is defective, or changed under an index."""


class CollectiveError(StatekitError):
    """A collective operation failed."""


class StatekitOSError(StatekitError, OSError):
    """An operating system error; ``filename`` is the path it concerns."""

    def __init__(self, *args: Any) -> None:
        OSError.__init__(self, *args)


class StatekitFileNotFoundError(StatekitOSError, FileNotFoundError):
    pass


class StatekitPermissionError(StatekitOSError, PermissionError):
    pass


class StatekitFileExistsError(StatekitOSError, FileExistsError):
    pass


class StatekitIsADirectoryError(StatekitOSError, IsADirectoryError):
    pass


class StatekitNotADirectoryError(StatekitOSError, NotADirectoryError):
    pass


_IO: Dict[str, Type[StatekitOSError]] = {
    "NotFound": StatekitFileNotFoundError,
    "PermissionDenied": StatekitPermissionError,
    "AlreadyExists": StatekitFileExistsError,
    "IsADirectory": StatekitIsADirectoryError,
    "NotADirectory": StatekitNotADirectoryError,
}

# The classes a `ckpt` error may be: the Rust side names one from the error's kind.
_CKPT: Dict[str, Type[CheckpointError]] = {
    c.__name__: c
    for c in (
        CheckpointError,
        InvalidCheckpoint,
        UnsafePickle,
        BadOption,
        BadPickle,
        ChecksumMismatch,
        NotACheckpoint,
        BadOutput,
        HubError,
        ShardedSaveError,
        DestinationLocked,
        DestinationsDiffer,
    )
}

# The classes a `dataload` error may be, named by the Rust side from the error's kind.
_DATALOAD: Dict[str, Type[StatekitError]] = {
    c.__name__: c
    for c in (DataloadError, InvalidConfiguration, MalformedState, StateMismatch, DataError, CollectiveError)
}


# The class a failed `save_sharded` raises for a cause of each class, made once per process so
# that every rank raises a class of the same name.
_SHARDED: Dict[Type[CheckpointError], Type[CheckpointError]] = {}


def _sharded(base: Type[CheckpointError]) -> Type[CheckpointError]:
    if issubclass(ShardedSaveError, base):
        return ShardedSaveError
    cls = _SHARDED.get(base)
    if cls is None:
        doc = f"A ``save_sharded`` that failed with a ``{base.__name__}`` (see ``ShardedSaveError``)."
        cls = type(f"Sharded{base.__name__}", (ShardedSaveError, base), {"__doc__": doc, "__module__": __name__})
        _SHARDED[base] = cls
    return cls


def _class_for(domain: str, cls: Optional[str]) -> Type[StatekitError]:
    if domain == "bindings":
        return UsageError
    if domain == "ckpt":
        return _CKPT.get(cls or "", CheckpointError)
    return _DATALOAD.get(cls or "", DataloadError)


def _from_native(domain: str, variant: str, message: str, fields: Dict[str, Any]) -> BaseException:
    """Builds the exception for a Rust error (called by ``statekit._native``)."""
    fields = dict(fields)
    cls_name: Optional[str] = fields.pop("class", None)
    if fields.pop("sharded", False):
        return _sharded(_CKPT.get(cls_name or "", CheckpointError))(message, variant=variant, **fields)
    kind: Optional[str] = fields.pop("io_kind", None)
    if kind is not None:
        code = fields.pop("errno", None)
        path = fields.pop("path", None)
        cls: Type[StatekitOSError] = _IO.get(kind, StatekitOSError)
        if code is None:
            code = {"NotFound": _errno.ENOENT, "PermissionDenied": _errno.EACCES}.get(kind, _errno.EIO)
        exc = cls(code, message)
        exc.filename = path
        exc.variant = variant
        return exc
    return _class_for(domain, cls_name)(message, variant=variant, **fields)


__all__ = [
    "StatekitError",
    "UsageError",
    "CheckpointError",
    "InvalidCheckpoint",
    "UnsafePickle",
    "BadOption",
    "BadPickle",
    "ChecksumMismatch",
    "NotACheckpoint",
    "BadOutput",
    "HubError",
    "ShardedSaveError",
    "DestinationLocked",
    "DestinationsDiffer",
    "DataloadError",
    "InvalidConfiguration",
    "StateError",
    "StateMismatch",
    "MalformedState",
    "DataError",
    "CollectiveError",
    "StatekitOSError",
    "StatekitFileNotFoundError",
    "StatekitPermissionError",
    "StatekitFileExistsError",
    "StatekitIsADirectoryError",
    "StatekitNotADirectoryError",
]
