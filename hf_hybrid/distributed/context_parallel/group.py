"""The context-parallel group (which ranks hold which chunks of the sequence: ``layout``, see
layout.py), its differentiable all-gather and the helpers every mixer's exchange shares."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...layers.loss import shifted_labels
from ..gradients import all_reduce_coalesced, model_gradients
from . import layout as layouts


@dataclass(frozen=True)
class ContextParallelGroup:
    """The ranks one sequence is split over, and this process's place among them."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    # "balanced": rank r holds chunks r and 2N - 1 - r of 2N (even causal work); "contiguous": chunk r of N (layout.py)
    layout: str = "balanced"

    def __post_init__(self):
        layouts.check_layout(self.layout)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None, layout: str = "balanced") -> ContextParallelGroup:
        group = group or dist.group.WORLD
        return cls(group, dist.get_rank(group), dist.get_world_size(group), layout)

    @classmethod
    def from_mesh(cls, mesh, mesh_dim: str | int | None = None, layout: str = "balanced") -> ContextParallelGroup:
        """The group of one dimension of a DeviceMesh (the only one of a 1-D mesh)."""
        return cls.from_group(mesh.get_group(mesh_dim) if mesh_dim is not None else mesh.get_group(), layout)

    # ------------------------------------------------------------------ layout
    @property
    def num_chunks(self) -> int:
        """How many chunks the sequence is cut into (ranks, or twice that when balanced)."""
        return layouts.num_chunks(self.layout, self.world_size)

    @property
    def chunks(self) -> tuple[int, ...]:
        """The chunk indices this rank holds, in the order its shard concatenates them."""
        return layouts.rank_chunks(self.layout, self.rank, self.world_size)

    def segment_starts(self, shard_len: int) -> list[int]:
        """The true position of the first token of each of this rank's chunks (shard of ``shard_len``)."""
        size = shard_len // len(self.chunks)
        return [chunk * size for chunk in self.chunks]

    def positions(self, shard_len: int, device=None) -> torch.Tensor:
        """[shard_len] the true positions of this rank's tokens."""
        size = shard_len // len(self.chunks)
        return torch.cat([torch.arange(start, start + size, device=device) for start in self.segment_starts(shard_len)])

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of ``tensor`` along ``dim`` (the sequence): its chunks, in order."""
        length = tensor.shape[dim]
        if length % self.num_chunks:
            raise ValueError(
                f"context parallelism: the sequence length {length} must divide evenly into {self.num_chunks} chunks "
                f"({self.world_size} ranks, layout {self.layout!r}); pad the rows (labels -100) to a multiple."
            )
        pieces = tensor.chunk(self.num_chunks, dim)
        return torch.cat([pieces[chunk] for chunk in self.chunks], dim).contiguous()

    def unshard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's shard (e.g. the logits), in sequence order; differentiable."""
        per_chunk = torch.stack(tensor.chunk(len(self.chunks), dim), 0)
        gathered = self.gather_chunks(per_chunk)
        return torch.cat(gathered.unbind(0), dim)

    def gather_chunks(self, tensor: torch.Tensor) -> torch.Tensor:
        """[chunks of the sequence, ...] from this rank's [its chunks, ...] (one entry per chunk it
        holds), in sequence order, differentiable."""
        gathered = self.all_gather(tensor, 0)
        if self.layout == "contiguous":
            return gathered
        return torch.stack([gathered[i] for i in layouts.gathered_order(self.layout, self.world_size)])

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

    def exchange_rows(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """All-to-all along dim 0, differentiable: ``rows`` holds ``send_counts[r]`` rows for each
        rank r in rank order; returns the ``recv_counts[r]`` rows each rank r sent here, in rank
        order. The backward sends each row's gradient back to the rank it came from."""
        return _ExchangeRows.apply(rows, list(send_counts), list(recv_counts), self)


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_counts, recv_counts, cp):
        ctx.send_counts, ctx.recv_counts, ctx.cp = send_counts, recv_counts, cp
        return _all_to_all_rows(rows, send_counts, recv_counts, cp)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_rows(grad, ctx.recv_counts, ctx.send_counts, ctx.cp), None, None, None


def _all_to_all_rows(rows, send_counts, recv_counts, cp):
    received = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), recv_counts, send_counts, group=cp.group)
    return received


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

