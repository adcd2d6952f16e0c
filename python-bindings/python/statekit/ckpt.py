"""Checkpoint operations as functions: read any checkpoint ``ckpt`` reads, without torch and
without executing a pickle; write safetensors and per-rank DCP folders.

Every function releases the GIL while it reads, writes or copies. Results are small objects
(the paths written, tensor counts, bytes), never printed output; each one's ``document`` is the
JSON document ``ckpt ... --json`` prints for the same call (``statekit.inspect/2``,
``statekit.verify/1``, ``statekit.outcome/2``), which the results are read from.

A destination is written by one process at a time, as with ``ckpt``: a call whose destination
another process is writing raises :class:`~statekit.errors.DestinationLocked` at once (its
``pid`` is the writer's), and a lock left by a killed process is taken over. The ranks of a
torch.distributed job write one destination together, so they must all name it; ranks given
different ones raise :class:`~statekit.errors.DestinationsDiffer` before anything is written.
Processes of a torchrun job that did not initialize a process group are each on their own:
call the operation on one rank only, or initialize the group so that all ranks share it.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from ._dist import LocalCollective, TorchCollective, job_collective
from .errors import UsageError

__all__ = [
    "CheckpointInfo",
    "TensorSpec",
    "Outcome",
    "VerifyReport",
    "LoadedStateDict",
    "inspect",
    "verify",
    "split",
    "merge",
    "convert",
    "reshard",
    "load",
    "save",
    "save_sharded",
]

PathLike = Union[str, "os.PathLike[str]"]
Size = Union[int, str]

# safetensors dtype name -> numpy dtype; bf16 and the fp8/fp4 kinds have no numpy dtype and come
# back as raw unsigned integers of their width (the dtype is named in `LoadedStateDict.dtypes`).
_NUMPY = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "U16": np.uint16,
    "F16": np.float16,
    "I32": np.int32,
    "U32": np.uint32,
    "F32": np.float32,
    "F64": np.float64,
    "I64": np.int64,
    "U64": np.uint64,
    "C64": np.complex64,
    "C128": np.complex128,
}
_RAW = {"BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8, "F8_E4M3FNUZ": np.uint8, "F8_E5M2FNUZ": np.uint8}
_TORCH = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
    "C128": "complex128",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    format: str
    root: str
    files: List[str]
    tensors: List[TensorSpec]
    metadata: Dict[str, str]
    values: Dict[str, Any]
    world_size: Optional[int]
    zero_stage: Optional[int]
    total_bytes: int
    #: An accelerate ``save_state`` folder's components, as ``ckpt inspect --json`` gives them.
    components: Optional[Dict[str, Any]] = None
    #: For each torch file (by path), the globals its pickle names, as written, allowed or not.
    globals: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    #: A Megatron-Core checkpoint's run and model, as ``ckpt inspect --json`` gives them
    #: (``layout``, ``iteration``, ``tensor_parallel``, ``pipeline_parallel``, ``num_layers``,
    #: ``hidden_size``, ``ffn_hidden_size``, ``num_attention_heads``, ``num_query_groups``,
    #: ``swiglu``, ``tied_embeddings``, ``optimizer``; ``None`` where the checkpoint does not
    #: tell; for a mixture-of-experts run also ``num_experts``, ``moe_router_topk`` and
    #: ``expert_parallel``, absent for a dense one); ``None`` for any other format.
    megatron: Optional[Dict[str, Any]] = None
    #: The ``statekit.inspect/2`` document, as ``ckpt inspect --json`` prints it.
    document: Optional[Dict[str, Any]] = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What an operation wrote: the files (index last), tensor count and tensor bytes."""

    files: List[str]
    tensors: int
    bytes: int
    values: List[str] = dataclasses.field(default_factory=list)
    aliases: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    world_size: Optional[int] = None
    #: The ``statekit.outcome/2`` document, as ``ckpt OP --json`` prints it (``None`` for
    #: :func:`save`, which the CLI has no command for).
    document: Optional[Dict[str, Any]] = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    path: str
    format: Optional[str]
    files: int
    tensors: int
    problems: List[str]
    warnings: List[str]
    checksums_ok: int
    valid: bool
    #: The ``statekit.verify/1`` document, as ``ckpt verify --json`` prints it.
    document: Optional[Dict[str, Any]] = dataclasses.field(default=None, compare=False, repr=False)

    def __bool__(self) -> bool:
        return self.valid


class LoadedStateDict(dict):  # type: ignore[type-arg]
    """The tensors of a checkpoint by name; ``dtypes`` names each one's dtype (``"BF16"``, ...),
    which matters where numpy has none and the array holds the raw bits."""

    dtypes: Dict[str, str]
    format: str


def _size(v: Optional[Size]) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, str):
        return _native.parse_size(v)
    return int(v)


def _outcome(text: str) -> Outcome:
    d = json.loads(text)
    return Outcome(
        files=d["files"],
        tensors=d["tensors"],
        bytes=d["bytes"],
        values=d["values"],
        aliases=[tuple(a) for a in d["aliases"]],
        world_size=d["world_size"],
        document=d,
    )


def _info(ck: "_native.Checkpoint") -> Dict[str, Any]:
    info: Dict[str, Any] = json.loads(ck.info_json())
    return info


def _allow(allow_globals: Optional[Sequence[str]]) -> Optional[List[str]]:
    if allow_globals is None:
        return None
    if isinstance(allow_globals, str):
        raise UsageError("`allow_globals` is a list of patterns, not one string")
    return [str(p) for p in allow_globals]


def inspect(path: PathLike, *, tag: Optional[str] = None, allow_globals: Optional[Sequence[str]] = None, as_stored: bool = False) -> CheckpointInfo:
    """What ``ckpt inspect`` shows: format, files, tensors, metadata, values, for torch files
    the globals each one's pickle names (``globals``, by file), and for a Megatron-Core
    checkpoint its run and model (``megatron``). ``allow_globals`` and ``as_stored`` as in
    :func:`load`. An ``hf://`` safetensors model that is not in the Hugging Face cache is read
    on the Hub by its headers (range requests); nothing is downloaded."""
    ck = _native.Checkpoint(os.fspath(path), tag, _allow(allow_globals), as_stored=as_stored, headers_only=True)
    d = _info(ck)
    return CheckpointInfo(
        format=d["format"],
        root=d["path"],
        files=[f["path"] for f in d["files"]],
        tensors=[TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), t["bytes"]) for t in d["tensors"]],
        metadata=d["metadata"],
        values=d["values"],
        world_size=d["world_size"],
        zero_stage=d["zero_stage"],
        total_bytes=d["totals"]["bytes"],
        components=d.get("components"),
        globals={f["path"]: f["globals"] for f in d["files"] if f.get("globals")},
        megatron=d.get("megatron"),
        document=d,
    )


def verify(path: PathLike, *, allow_globals: Optional[Sequence[str]] = None, as_stored: bool = False, headers_only: bool = False) -> VerifyReport:
    """``ckpt verify``: every defect a reader would trip on (``report.problems``).
    ``allow_globals`` and ``as_stored`` as in :func:`load`. ``headers_only``: ``ckpt verify
    --headers-only``, the headers and indexes alone (an ``hf://`` model is then read by range
    requests, not downloaded)."""
    d = json.loads(_native.verify(os.fspath(path), allow_globals=_allow(allow_globals), as_stored=as_stored, headers_only=headers_only))
    fields = ("path", "format", "files", "tensors", "problems", "warnings", "checksums_ok", "valid")
    return VerifyReport(**{k: d[k] for k in fields}, document=d)


def split(
    src: PathLike,
    out_dir: PathLike,
    *,
    max_shard_size: Size = "5GB",
    tag: Optional[str] = None,
    checksums: bool = False,
    allow_expanded: bool = False,
    allow_globals: Optional[Sequence[str]] = None,
    as_stored: bool = False,
    group: Any = None,
) -> Outcome:
    """``ckpt split``: huggingface_hub's sharded safetensors layout in ``out_dir``.

    Called from every rank of a torch.distributed job (the default process group when one is
    initialized, or ``group``), it is one operation over all of them: each rank writes its
    share of the output (whole files, or byte ranges of one file) and rank 0 commits once all
    are durable; the bytes are those one process writes. Every rank must call it with the same
    arguments. ``Outcome.document["ranks"]`` lists each rank's share.
    """
    size = _size(max_shard_size)
    assert size is not None
    return _outcome(
        _native.split(
            os.fspath(src),
            os.fspath(out_dir),
            size,
            tag=tag,
            checksums=checksums,
            allow_expanded=allow_expanded,
            allow_globals=_allow(allow_globals),
            as_stored=as_stored,
            comm=job_collective(group),
        )
    )


def merge(
    src: PathLike,
    out: PathLike,
    *,
    max_shard_size: Optional[Size] = None,
    optimizer: bool = False,
    tag: Optional[str] = None,
    checksums: bool = False,
    allow_expanded: bool = False,
    model: Optional[int] = None,
    allow_globals: Optional[Sequence[str]] = None,
    as_stored: bool = False,
    group: Any = None,
) -> Outcome:
    """``ckpt merge``: one safetensors state dict from any layout (DCP, ZeRO, Megatron, shards);
    for an accelerate ``save_state`` folder, its model ``model`` (default 0). A Megatron-Core
    checkpoint merges to the model megatron holds on one rank, or with ``as_stored=True`` to
    its tensors under their stored keys (as :func:`load`).

    Called from every rank of a torch.distributed job (the default process group when one is
    initialized, or ``group``), it is one operation over all of them: each rank writes its
    share of the output (whole files, or byte ranges of one file) and rank 0 commits once all
    are durable; the bytes are those one process writes. Every rank must call it with the same
    arguments. ``Outcome.document["ranks"]`` lists each rank's share.
    """
    return _outcome(
        _native.merge(
            os.fspath(src),
            os.fspath(out),
            tag=tag,
            max_shard_size=_size(max_shard_size),
            optimizer=optimizer,
            checksums=checksums,
            allow_expanded=allow_expanded,
            model=model,
            allow_globals=_allow(allow_globals),
            as_stored=as_stored,
            comm=job_collective(group),
        )
    )


def convert(
    src: PathLike,
    out: PathLike,
    *,
    to: Optional[str] = None,
    dtype: Optional[str] = None,
    max_shard_size: Optional[Size] = None,
    dedupe: bool = False,
    world_size: Optional[int] = None,
    arch: Optional[str] = None,
    vocab_size: Optional[int] = None,
    tensor_parallel: Optional[int] = None,
    pipeline_parallel: Optional[int] = None,
    expert_parallel: Optional[int] = None,
    tag: Optional[str] = None,
    checksums: bool = False,
    allow_expanded: bool = False,
    allow_globals: Optional[Sequence[str]] = None,
    as_stored: bool = False,
    group: Any = None,
) -> Outcome:
    """``ckpt convert``: to safetensors, torch (``.bin``/``.pt``), DCP (``to="dcp"``) or a
    Hugging Face model folder (``to="hf"``, of a Megatron checkpoint: ``config.json`` and
    safetensors under the Hub's names; ``arch`` names the family instead of the one recognized
    from the saved ``args``, ``vocab_size`` keeps the vocabulary's first rows), a Megatron-LM
    ``torch_dist`` run folder (``to="megatron"``, of a Megatron checkpoint or a Hugging Face
    folder), or Megatron-LM's legacy per-rank files (``to="megatron-legacy"``, cut for
    ``tensor_parallel``, ``pipeline_parallel`` and ``expert_parallel`` ranks, each 1 by default).
    ``allow_globals`` and ``as_stored`` as in :func:`load`.

    Called from every rank of a torch.distributed job (the default process group when one is
    initialized, or ``group``), it is one operation over all of them: each rank writes its
    share of the output (whole files, or byte ranges of one file) and rank 0 commits once all
    are durable; the bytes are those one process writes. Every rank must call it with the same
    arguments. ``Outcome.document["ranks"]`` lists each rank's share.
    """
    return _outcome(
        _native.convert(
            os.fspath(src),
            os.fspath(out),
            to=to,
            dtype=dtype,
            max_shard_size=_size(max_shard_size),
            dedupe=dedupe,
            world_size=world_size,
            arch=arch,
            vocab_size=vocab_size,
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            expert_parallel=expert_parallel,
            tag=tag,
            checksums=checksums,
            allow_expanded=allow_expanded,
            allow_globals=_allow(allow_globals),
            as_stored=as_stored,
            comm=job_collective(group),
        )
    )


def reshard(
    src: PathLike,
    out: PathLike,
    world_size: int,
    *,
    tag: Optional[str] = None,
    checksums: bool = False,
    allow_expanded: bool = False,
    as_stored: bool = False,
    group: Any = None,
) -> Outcome:
    """``ckpt reshard``: a DCP or ZeRO checkpoint laid out for another world size.
    ``as_stored`` as in :func:`load`.

    Called from every rank of a torch.distributed job (the default process group when one is
    initialized, or ``group``), it is one operation over all of them: each rank writes its
    share of the output (whole files, or byte ranges of one file) and rank 0 commits once all
    are durable; the bytes are those one process writes. Every rank must call it with the same
    arguments. ``Outcome.document["ranks"]`` lists each rank's share.
    """
    return _outcome(
        _native.reshard(
            os.fspath(src),
            os.fspath(out),
            int(world_size),
            tag=tag,
            checksums=checksums,
            allow_expanded=allow_expanded,
            as_stored=as_stored,
            comm=job_collective(group),
        )
    )


def load(
    path: PathLike,
    *,
    framework: str = "numpy",
    device: str = "cpu",
    tag: Optional[str] = None,
    allow_globals: Optional[Sequence[str]] = None,
    allow_expanded: bool = False,
    as_stored: bool = False,
) -> LoadedStateDict:
    """Every tensor of the checkpoint at ``path`` (safetensors file or sharded folder, torch
    ``.bin``/``.pt``, DCP folder, DeepSpeed ZeRO folder, Megatron-Core checkpoint, ``hf://``),
    whole.

    ``allow_globals`` (torch files) names globals beyond torch's weights-only list to read as
    inert data: each a dotted name (``"omegaconf.dictconfig.DictConfig"``), a prefix ending in
    ``.*`` (``"omegaconf.*"``) or ``"*"``. Nothing is imported or called: an object becomes a
    record of its class and state, every tensor reachable through it is returned under its
    path (``state_dict.layer.weight``, ``obj.state.attr``), numpy arrays as tensors. A file
    naming a global that is not allowed raises :class:`~statekit.errors.UnsafePickle`, whose
    ``globals`` lists what is missing.

    A Megatron-Core checkpoint (a ``torch_dist`` folder, or its run or iteration folder; a
    legacy per-rank save) is read as the model megatron holds on one rank (tensor and
    pipeline parallel pieces joined, layers under their global numbers, ``_extra_state`` left
    out). ``as_stored=True`` (``torch_dist`` only) gives instead every stored tensor under its
    stored key and global shape (stacked layers, TransformerEngine's norm names, the
    optimizer's tensors), as torch's ``dcp_to_torch_save`` gives them; for any other format it
    is refused (:class:`~statekit.errors.BadOption`).

    Tensors whose bytes lie contiguous in one file (safetensors, torch's zip records) view a
    private (copy-on-write) memory map of it: nothing is copied, and writing to the array never
    touches the file. Others (DCP chunks, ZeRO partitions, strided views) are read into fresh
    arrays with the GIL released. ``framework="torch"`` returns torch tensors (torch is only
    imported then); with numpy, bf16 and fp8 come back as ``uint16``/``uint8`` bit patterns,
    their dtype named in ``result.dtypes``.

    A broadcast view (a tensor whose strides read its storage many times over, ``expand``'s
    stride 0) is refused (:class:`~statekit.errors.InvalidCheckpoint`) unless
    ``allow_expanded=True``, as ``ckpt`` refuses it without ``--allow-expanded``: loading it
    whole allocates the view's size, which a file of a few bytes can make 16 GiB.

    The memory maps are private copies of the files as they were: do not truncate a file
    while its arrays are in use (reading a map past the new end of its file faults).
    """
    if framework not in ("numpy", "np", "torch", "pt"):
        raise UsageError(f"`framework` is `numpy` or `torch`, not `{framework}`")
    use_torch = framework in ("torch", "pt")
    if not use_torch and device != "cpu":
        raise UsageError("numpy arrays live on the CPU: `device` must be `cpu` with `framework=\"numpy\"`")
    torch: Any = None
    if use_torch:
        import torch as torch_module

        torch = torch_module
    ck = _native.Checkpoint(os.fspath(path), tag, _allow(allow_globals), as_stored=as_stored)
    if not allow_expanded:
        ck.refuse_expanded()
    info = _info(ck)
    maps: Dict[str, mmap.mmap] = {}

    def mapping(path: str) -> mmap.mmap:
        from ._datasets import _map_regular, _whole

        m = maps.get(path)
        if m is None:
            m = maps[path] = _map_regular(path)
        return _whole(m, path)

    reads: List[Tuple[int, Any]] = []
    out = LoadedStateDict()
    out.dtypes = {}
    out.format = info["format"]
    for i, t in enumerate(info["tensors"]):
        name, dt, shape, nbytes = t["name"], t["dtype"], tuple(t["shape"]), t["bytes"]
        out.dtypes[name] = dt
        if use_torch:
            tdt = getattr(torch, _TORCH.get(dt, ""), None)
            if tdt is None:
                raise UsageError(f"tensor `{name}`: torch has no dtype for `{dt}`")
            if nbytes == 0:
                value = torch.empty(shape, dtype=tdt)
            elif t["mappable"]:
                value = torch.frombuffer(mapping(t["file"]), dtype=tdt, count=nbytes // tdt.itemsize, offset=t["offset"]).reshape(shape)
            else:
                value = torch.empty(shape, dtype=tdt)
                reads.append((i, _torch_bytes(value)))
        else:
            ndt = _NUMPY.get(dt) or _RAW.get(dt)
            if ndt is None:
                raise UsageError(f"tensor `{name}`: numpy has no dtype for `{dt}`")
            itemsize = np.dtype(ndt).itemsize
            if nbytes == 0:
                value = np.empty(shape, dtype=ndt)
            elif t["mappable"]:
                value = np.frombuffer(mapping(t["file"]), dtype=ndt, count=nbytes // itemsize, offset=t["offset"]).reshape(shape)
            else:
                value = np.empty(shape, dtype=ndt)
                reads.append((i, value))
        out[name] = value
    # One native call for every tensor that is gathered (chunks, partitions, strided views,
    # casts): the files are opened once, and the GIL is released for the whole read.
    ck.read_many_into(reads)
    if use_torch and device != "cpu":
        for name in out:
            out[name] = out[name].to(device)
    return out


def _torch_module() -> Any:
    import sys

    return sys.modules.get("torch")


def _np_dtype_name(a: np.ndarray) -> str:
    for name, t in _NUMPY.items():
        if a.dtype == np.dtype(t):
            return name
    raise UsageError(f"numpy dtype `{a.dtype}` has no safetensors dtype")


def _torch_bytes(t: Any) -> np.ndarray:
    """A C-contiguous CPU torch tensor's memory as a flat ``uint8`` numpy array (no copy): torch
    tensors have no buffer protocol, and numpy has no bf16 or fp8."""
    import torch

    flat: np.ndarray = t.reshape(-1).view(torch.uint8).numpy()
    return flat


def _buffer(value: Any, name: str) -> Tuple[str, Tuple[int, ...], Any]:
    """(dtype name, shape, data) of ``value``: ``data`` a C-contiguous little-endian CPU buffer
    (a copy, or a view when ``value`` already is one), which Rust reads through the buffer
    protocol."""
    torch = _torch_module()
    if torch is not None and isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            # torch raises NotImplementedError deep inside (`is_contiguous`, `data_ptr`).
            raise UsageError(
                f"tensor `{name}` is sparse (`{value.layout}`): safetensors stores dense tensors only; "
                f"hint: save `{name}.to_dense()`, or its indices and values as tensors of their own"
            )
        if value.is_quantized or getattr(value, "is_nested", False):
            kind = "quantized" if value.is_quantized else "nested"
            raise UsageError(f"tensor `{name}` is {kind}: safetensors stores plain dense tensors only")
        if value.device.type != "cpu":
            raise UsageError(f"tensor `{name}` is on `{value.device}`: move it to the CPU first")
        t = value.detach().resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        names = {v: k for k, v in _TORCH.items()}
        dt = names.get(str(t.dtype).replace("torch.", ""))
        if dt is None:
            raise UsageError(f"tensor `{name}`: dtype `{t.dtype}` has no safetensors dtype")
        return dt, tuple(t.shape), _torch_bytes(t)
    if isinstance(value, np.ndarray):
        a = value
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        a = np.ascontiguousarray(a)
        return _np_dtype_name(a), tuple(a.shape), a
    raise UsageError(f"`{name}` is a `{type(value).__name__}`, not a numpy array or a torch tensor")


def _alias_key(value: Any) -> Optional[Tuple[Any, ...]]:
    torch = _torch_module()
    if torch is not None and isinstance(value, torch.Tensor) and value.layout == torch.strided and value.numel() > 0:
        return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, np.ndarray) and value.size > 0:
        return (value.__array_interface__["data"][0], value.shape, value.strides, value.dtype.str)
    return None


def save(state_dict: Mapping[str, Any], path: PathLike, *, max_shard_size: Optional[Size] = None, metadata: Optional[Mapping[str, str]] = None) -> Outcome:
    """Writes ``state_dict`` (numpy arrays or CPU torch tensors, any strides) as safetensors:
    one file at ``path``, or with ``max_shard_size`` huggingface_hub's sharded layout in the
    folder ``path``; atomically (temporaries beside the targets, fsynced, renamed, index last).

    The tensors go in the order the state dict gives them, through ``ckpt split``'s planner and
    writer: the files are those ``huggingface_hub.save_torch_state_dict(state_dict, path,
    max_shard_size=...)`` writes, every file's ``__metadata__`` starting with ``format: pt``
    (``metadata`` follows it in a single file, and goes in the index of a sharded one).

    Tied weights are handled as ``safetensors.torch.save_model`` does: exact aliases (same
    storage, offset, shape and strides) are written once, under the first of their names in
    sorted order, and ``Outcome.aliases`` lists the ``(dropped, kept)`` pairs. Other views
    into one storage are each written as their own contiguous copy.
    """
    for name in state_dict:
        if not isinstance(name, str):
            raise UsageError(f"state dict keys must be strings, not {name!r}")
    aliases: List[Tuple[str, str]] = []
    seen: Dict[Tuple[Any, ...], str] = {}
    for name in sorted(state_dict):
        key = _alias_key(state_dict[name])
        if key is not None and key in seen:
            aliases.append((name, seen[key]))
        elif key is not None:
            seen[key] = name
    dropped = {a for a, _ in aliases}
    entries = []
    for name, value in state_dict.items():
        if name in dropped:
            continue
        dt, shape, data = _buffer(value, name)
        entries.append((name, dt, list(shape), data))
    meta = None if metadata is None else {str(k): str(v) for k, v in metadata.items()}
    files = _native.save_safetensors(entries, os.fspath(path), _size(max_shard_size), meta)
    return Outcome(files=files, tensors=len(entries), bytes=sum(e[3].nbytes for e in entries), aliases=aliases)


def _holds_containers(obj: Any) -> bool:
    return any(isinstance(v, (Mapping, list, tuple)) or hasattr(v, "shape") for v in obj)


def _flatten(obj: Any, prefix: Tuple[Any, ...], out: List[Tuple[Tuple[Any, ...], Any]]) -> None:
    # As DCP flattens a state dict: mappings and lists that hold tensors or containers are
    # walked; a list of plain values is one value.
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, prefix + (str(k),), out)
    elif isinstance(obj, (list, tuple)) and _holds_containers(obj):
        for i, v in enumerate(obj):
            _flatten(v, prefix + (i,), out)
    else:
        out.append((prefix, obj))


def save_sharded(state_dict: Mapping[str, Any], dir: PathLike, *, rank: int, world_size: int, group: Any = None) -> Outcome:
    """Writes a torch.distributed.checkpoint (DCP) folder from every rank of a running job:
    each rank its own ``__{rank}_0.distcp`` from memory, rank 0 committing ``.metadata`` after
    the descriptors' all-gather (``ckpt::save_sharded``), so ``dcp.load``, ``accelerate
    merge-weights`` and ``ckpt merge`` read it. Every rank calls it with the same ``dir``.

    ``state_dict`` is nested dicts and lists of tensors and plain values. A DTensor sharded on
    dim 0 (FSDP2's ``Shard(0)``) contributes its local rows; a plain tensor is replicated (DDP)
    and written by rank 0 alone, as are plain values. The collective is torch.distributed's
    default group (or ``group``); with ``world_size=1`` no process group is needed.
    """
    world_size = _native.check_int("world_size", world_size, 1, 2**20)
    rank = _native.check_int("rank", rank, 0, world_size - 1)
    torch = _torch_module()
    if world_size == 1 and rank == 0:
        comm: Any = LocalCollective()
    else:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise UsageError("save_sharded on several ranks needs an initialized torch.distributed process group")
        if dist.get_rank(group) != rank or dist.get_world_size(group) != world_size:
            raise UsageError(
                f"rank {rank} of {world_size} disagrees with torch.distributed (rank {dist.get_rank(group)} of {dist.get_world_size(group)})"
            )
        comm = TorchCollective(rank, world_size, group)
    leaves: List[Tuple[Tuple[Any, ...], Any]] = []
    _flatten(state_dict, (), leaves)
    tensors = []
    values = []
    dtensor_cls: Any = None
    if torch is not None:
        try:
            from torch.distributed.tensor import DTensor

            dtensor_cls = DTensor
        except ImportError:
            dtensor_cls = None
    for parts, v in leaves:
        name = ".".join(str(p) for p in parts)
        if dtensor_cls is not None and isinstance(v, dtensor_cls):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
            if any(o != 0 for o in offset[1:]):
                raise UsageError(f"`{name}`: only DTensors sharded on dim 0 are supported")
            local = v.to_local()
            dt, _, data = _buffer(local.cpu(), name)
            tensors.append((list(parts), dt, list(v.shape), int(offset[0]) if len(offset) else 0, data))
        elif (torch is not None and isinstance(v, torch.Tensor)) or isinstance(v, np.ndarray):
            if rank != 0:
                continue
            dt, shape, data = _buffer(v.cpu() if torch is not None and isinstance(v, torch.Tensor) else v, name)
            tensors.append((list(parts), dt, list(shape), 0, data))
        elif rank == 0:
            values.append((list(parts), v))
    return _outcome(_native.save_sharded(os.fspath(dir), tensors, values, comm))
