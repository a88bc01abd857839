"""Gradient reductions in a few large collectives: the gradients are copied into flat buckets (one
dtype and device per bucket, up to ``bucket_bytes`` each), each bucket is reduced once, and the
results are copied back. One collective per parameter costs a launch and a latency per tensor (a
model has hundreds of small ones: norms, biases, gates); a bucket pays them once."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 64 * 1024 * 1024


def gradient_buckets(tensors: Iterable[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by (dtype, device) in their order, each group cut into runs of at most
    ``bucket_bytes`` (a tensor larger than that is a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"gradient_buckets: bucket_bytes must be positive, got {bucket_bytes}.")
    open_buckets: dict[tuple, tuple[list[torch.Tensor], int]] = {}
    buckets = []
    for tensor in tensors:
        key = (tensor.dtype, tensor.device)
        bucket, size = open_buckets.get(key, ([], 0))
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(tensor)
        open_buckets[key] = (bucket, size + nbytes)
    buckets.extend(bucket for bucket, _ in open_buckets.values() if bucket)
    return buckets


def all_reduce_coalesced(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None,
                         op=dist.ReduceOp.SUM, bucket_bytes: int = BUCKET_BYTES) -> None:
    """All-reduce every tensor of ``tensors`` in place over ``group``, one collective per bucket."""
    for bucket in gradient_buckets(tensors, bucket_bytes):
        if len(bucket) == 1:
            dist.all_reduce(bucket[0], op=op, group=group)
            continue
        flat = torch.cat([tensor.reshape(-1) for tensor in bucket])
        dist.all_reduce(flat, op=op, group=group)
        for tensor, part in zip(bucket, flat.split([tensor.numel() for tensor in bucket])):
            tensor.copy_(part.view_as(tensor))


def model_gradients(model: nn.Module) -> list[torch.Tensor]:
    """The gradients of ``model``'s parameters that have one, each parameter once (tied weights)."""
    return [param.grad for param in model.parameters() if param.grad is not None]
