"""``Collective`` over torch.distributed, for ``ckpt.save_sharded`` and the operations run over
a job's ranks (the native writer calls these methods with ``bytes``)."""

from __future__ import annotations

import sys
from typing import Any, List, Optional


class TorchCollective:
    def __init__(self, rank: int, world_size: int, group=None) -> None:  # type: ignore[no-untyped-def]
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def broadcast(self, root: int, data: Optional[bytes]) -> bytes:
        import torch.distributed as dist

        box = [data if self.rank == root else None]
        # torch names the source by its global rank, also within a group.
        src = root if self.group is None else dist.get_global_rank(self.group, root)
        dist.broadcast_object_list(box, src=src, group=self.group)
        return bytes(box[0])  # type: ignore[arg-type]

    def all_gather(self, data: bytes) -> List[bytes]:
        import torch.distributed as dist

        out: List[Optional[bytes]] = [None] * self.world_size
        dist.all_gather_object(out, data, group=self.group)
        return [bytes(x) for x in out]  # type: ignore[arg-type]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)


class LocalCollective:
    """A world of one rank (no process group needed)."""

    rank = 0
    world_size = 1

    def broadcast(self, root: int, data: Optional[bytes]) -> bytes:
        return bytes(data or b"")

    def all_gather(self, data: bytes) -> List[bytes]:
        return [bytes(data)]

    def barrier(self) -> None:
        pass


def job_collective(group: Any) -> Optional[TorchCollective]:
    """The ranks an operation runs over: ``group`` (a torch.distributed process group), or the
    default group when torch.distributed is initialized; ``None`` (this process alone) when
    there is none, or the group has one rank. torch is not imported for this: a job that
    initialized a process group has imported torch.distributed already."""
    dist = sys.modules.get("torch.distributed")
    initialized = dist is not None and dist.is_available() and dist.is_initialized()
    if not initialized:
        if group is not None:
            from .errors import UsageError

            raise UsageError("`group` needs an initialized torch.distributed process group")
        return None
    assert dist is not None
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return None
    return TorchCollective(dist.get_rank(group), world_size, group)
