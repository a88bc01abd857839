"""The context-parallel group (which ranks hold which part of the sequence), its differentiable
all-gather and the helpers every mixer's exchange shares."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...layers.loss import shifted_labels
from ..gradients import all_reduce_coalesced, model_gradients


@dataclass(frozen=True)
class ContextParallelGroup:
    """The ranks one sequence is split over, and this process's place among them."""

    group: dist.ProcessGroup
    rank: int
    world_size: int

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> ContextParallelGroup:
        group = group or dist.group.WORLD
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    @classmethod
    def from_mesh(cls, mesh, mesh_dim: str | int | None = None) -> ContextParallelGroup:
        """The group of one dimension of a DeviceMesh (the only one of a 1-D mesh)."""
        return cls.from_group(mesh.get_group(mesh_dim) if mesh_dim is not None else mesh.get_group())

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous part of ``tensor`` along ``dim`` (the sequence)."""
        length = tensor.shape[dim]
        if length % self.world_size:
            raise ValueError(
                f"context parallelism: the sequence length {length} must divide evenly over {self.world_size} ranks; "
                "pad the rows (labels -100) to a multiple."
            )
        return tensor.chunk(self.world_size, dim)[self.rank].contiguous()

    def shard_labels(self, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The targets of this rank's tokens: ``labels`` shifted left over the whole sequence, then
        split (pass them as ``shift_labels``)."""
        return self.shard(shifted_labels(labels, ignore_index))

    def count_targets(self, shift_labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The group's number of counted targets (pass it as ``num_items_in_batch``)."""
        count = (shift_labels != ignore_index).sum()
        dist.all_reduce(count, group=self.group)
        return count

    def all_reduce_gradients(self, model: nn.Module) -> None:
        """Sum every parameter's gradient over the group (each rank holds its shard's part), in a
        few collectives over flat buckets (gradients.py) rather than one per parameter."""
        all_reduce_coalesced(model_gradients(model), group=self.group)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order, differentiable."""
        return _AllGather.apply(tensor, dim, self)

    def from_previous_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """[ranks, ...] every rank's ``tensor`` stacked (differentiable), for mixers that combine
        the earlier shards' values. Every rank uses every entry (with zero weights where it must
        not), so each rank's backward reaches the same collectives."""
        return self.all_gather(tensor.unsqueeze(0), 0)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, cp):
        ctx.dim, ctx.cp = dim, cp
        parts = [torch.empty_like(tensor) for _ in range(cp.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=cp.group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's use of this rank's part contributes to its gradient: sum, keep the own slice.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.cp.group)
        return grad.chunk(ctx.cp.world_size, ctx.dim)[ctx.cp.rank], None, None



def window_mask(start: int, seq: int, held: int, window: int | None, device) -> torch.Tensor:
    """[1, 1, seq, held + seq] bool: query start + i sees key start - held + j when it is not later
    and (with ``window``) fewer than ``window`` positions back (the token itself counts)."""
    query = torch.arange(start, start + seq, device=device)[:, None]
    key = torch.arange(start - held, start + seq, device=device)[None, :]
    visible = key <= query
    if window is not None:
        visible = visible & (query - key < window)
    return visible[None, None]



def previous_rank_only(cp: ContextParallelGroup, device) -> torch.Tensor:
    """[ranks] weights picking the previous rank's entry of from_previous_ranks (all zero on rank 0)."""
    weights = torch.zeros(cp.world_size, device=device)
    if cp.rank > 0:
        weights[cp.rank - 1] = 1
    return weights


def keep_in_graph(out: torch.Tensor, tensors) -> torch.Tensor:
    """``out``, with gathered tensors a rank does not use joined to its graph at zero weight: every
    rank's backward must reach the same collectives (the all-gathers' gradient sums)."""
    for tensor in tensors:
        out = out + 0.0 * tensor.sum()
    return out


def check_plain(mixer, context, cache_layer) -> None:
    if cache_layer is not None or context.past_length or context.key_valid is not None:
        raise ValueError(
            f"context parallelism ({type(mixer).__name__}): training forwards only, without a cache, "
            "padding or attention_mask zeros (split unpadded rows; mask targets with -100 instead)."
        )

