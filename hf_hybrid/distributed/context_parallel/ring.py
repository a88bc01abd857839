"""Point-to-point passes around the ring of a context-parallel group: each rank sends tensors to
the next rank (rank + 1, the last to the first) and receives the previous rank's, asynchronously,
so a mixer computes on the block it holds while the next one travels."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .group import ContextParallelGroup


class RingPass:
    """One step's transfer: ``send`` goes to the next rank, tensors shaped like ``send`` come from
    the previous one; ``wait()`` returns them once they have arrived (and ``send`` has left)."""

    def __init__(self, cp: ContextParallelGroup, send: tuple[torch.Tensor, ...]):
        following = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.world_size)
        preceding = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.world_size)
        send = tuple(t.contiguous() for t in send)
        self._received = tuple(torch.empty_like(t) for t in send)
        ops = [dist.P2POp(dist.isend, t, following, cp.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, preceding, cp.group) for t in self._received]
        self._send = send  # kept alive until the transfer is done
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[torch.Tensor, ...]:
        for request in self._requests:
            request.wait()
        self._send = None
        return self._received
