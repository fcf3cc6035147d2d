"""Asynchronous ring exchange over any ``torch.distributed`` process group.

Peers are the group's *global* ranks (``get_process_group_ranks``), so a ring over a
context-parallel group works when that group is not the whole world (CP composed with TP, PP, DP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # dtypes the dK/dV partials may travel in


class RingExchange:
    """Send to the next group member and receive from the previous one, asynchronously.

    Usage per step: ``received = ring.post(tensor)`` starts the transfer, compute overlaps it,
    then ``ring.wait()`` completes it before ``received`` is read. One exchange is in flight at a time.
    """

    def __init__(self, group: dist.ProcessGroup, tag: int = 0):
        members = dist.get_process_group_ranks(group)
        self.group = group
        self.size = len(members)
        self.rank = dist.get_rank(group)
        self.next_peer = members[(self.rank + 1) % self.size]
        self.prev_peer = members[(self.rank - 1) % self.size]
        self.tag = tag  # distinguishes rings that share a group (K/V and dK/dV) on tag-matching backends
        self._pending: list[dist.Work] | None = None

    def post(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Start sending ``tensor`` forward; return the buffer that will hold the one from behind."""
        if self._pending is not None:
            raise RuntimeError("RingExchange.post called while an exchange is still in flight")
        if self.size == 1:  # a ring of one hands the tensor to itself
            self._pending = []
            return tensor
        received = torch.empty_like(tensor) if out is None else out
        ops = [
            dist.P2POp(dist.isend, tensor, self.next_peer, self.group, self.tag),
            dist.P2POp(dist.irecv, received, self.prev_peer, self.group, self.tag),
        ]
        self._pending = dist.batch_isend_irecv(ops)
        return received

    def wait(self) -> None:
        """Block until the exchange posted last has finished (both directions)."""
        if self._pending is None:
            raise RuntimeError("RingExchange.wait called with no exchange in flight")
        for work in self._pending:
            work.wait()
        self._pending = None
