"""``Collective`` over torch.distributed, for ``ckpt.save_sharded`` (the native writer calls
these methods with ``bytes``)."""

from __future__ import annotations

from typing import List, Optional


class TorchCollective:
    def __init__(self, rank: int, world_size: int, group=None) -> None:  # type: ignore[no-untyped-def]
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def broadcast(self, root: int, data: Optional[bytes]) -> bytes:
        import torch.distributed as dist

        box = [data if self.rank == root else None]
        dist.broadcast_object_list(box, src=root, group=self.group)
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
