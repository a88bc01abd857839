"""Context parallelism composed with data parallelism: a 2-D ``("dp", "cp")`` DeviceMesh.

Each data-parallel rank trains its own rows; each row is split over the ``cp`` ranks of its
data-parallel rank (context_parallel/). The gradient of the global mean loss is then the SUM of
every rank's gradient over the flattened dp x cp group, provided each rank's loss is its share of
that mean: its own targets' summed loss divided by the count of targets over the WHOLE dp x cp
group (``num_items_in_batch = dims.count_targets(shift_labels)``). So:

- FSDP2 (:meth:`DataContextMesh.shard_model`) shards over the flattened dp x cp mesh, as torchtitan
  does, and its reduce-scatter sums over it (gradient divide factor 1): no separate all-reduce.
- Plain data parallelism without FSDP: :meth:`DataContextMesh.all_reduce_gradients` sums every
  gradient over dp x cp in a few bucketed collectives. A reduction that averages instead needs the
  loss scaled by the ranks it averages over, as transformers' Trainer scales by the processes with
  ``average_tokens_across_devices``: torch's ``DistributedDataParallel(model,
  process_group=dims.flat_group)`` averages over dp x cp, so back-propagate ``loss * dp * cp``
  (averaged over dp and summed over cp: ``loss * dp``).

    dims = init_data_context_mesh(dp=2, cp=2, device_type="cuda")    # 4 ranks
    dims.shard_model(model)                                          # or, without FSDP, see below
    ids = rows[dims.dp_rank : dims.dp_rank + 1]                      # this dp rank's row
    targets = dims.cp.shard_labels(ids)
    with context_parallel(model, dims.cp):
        loss = model(input_ids=dims.cp.shard(ids), shift_labels=targets,
                     num_items_in_batch=dims.count_targets(targets), use_cache=False).loss
        loss.backward()
    # without FSDP: dims.all_reduce_gradients(model)

accelerate: ``ParallelismConfig(dp_shard_size=..., cp_size=...)`` builds the same mesh
(``accelerator.torch_device_mesh``, dims ``dp_shard`` and ``cp``, flattened ``dp_cp``) and
:meth:`DataContextMesh.from_accelerate` reads it. Do not pass the model through
``accelerator.prepare`` with ``cp_size > 1``: accelerate then installs torch's own context
parallelism (SDPA ring attention driven by forward hooks on ``self_attn``), which refuses models
whose ``layer_types`` are not all ``full_attention`` (RAT, RATTENTION, SE hybrids) and would not
exchange what our mixers need for the others; shard the model with :meth:`shard_model` instead.
accelerate 1.15 takes a ParallelismConfig on GPUs (or under its FSDP2 / DeepSpeed plugins) and
refuses it in CPU processes (MULTI_CPU); there ``ParallelismConfig(...).build_device_mesh("cpu")``
builds the same mesh without an Accelerator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .context_parallel.group import ContextParallelGroup
from .gradients import BUCKET_BYTES, all_reduce_coalesced, model_gradients


@dataclass(frozen=True)
class DataContextMesh:
    """A DeviceMesh with a data-parallel dimension, a context-parallel dimension and their
    flattening (the group gradients are summed over)."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    cp_dim: str
    flat_dim: str
    flat_mesh: object  # the 1-D mesh of every dp x cp rank (FSDP2 shards over it)

    @classmethod
    def from_accelerate(cls, mesh_or_accelerator) -> DataContextMesh:
        """The mesh accelerate builds from ``ParallelismConfig(dp_shard_size=..., cp_size=...)``:
        pass the Accelerator (its ``torch_device_mesh``) or that DeviceMesh."""
        mesh = getattr(mesh_or_accelerator, "torch_device_mesh", mesh_or_accelerator)
        if mesh is None:
            raise ValueError("DataContextMesh.from_accelerate: the Accelerator has no device mesh; create it with "
                             "Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=..., cp_size=...)).")
        names = tuple(mesh.mesh_dim_names or ())
        if "cp" not in names:
            raise ValueError(f"DataContextMesh.from_accelerate: the mesh has no 'cp' dimension (dims {names}); set cp_size > 1 "
                             "in accelerate's ParallelismConfig.")
        unsupported = [name for name in names if name in ("tp", "sp")]
        if unsupported:
            raise ValueError(f"DataContextMesh.from_accelerate: context parallelism composes with data parallelism only, "
                             f"not with {unsupported}; set tp_size=1 and sp_size=1.")
        dp_dims = [name for name in ("dp_replicate", "dp_shard") if name in names]
        # accelerate orders the dims (dp_replicate, dp_shard, cp) and flattens them into "dp_cp".
        return cls._with_flat(mesh, "cp", "dp_cp", [*dp_dims, "cp"])

    @classmethod
    def _with_flat(cls, mesh, cp_dim, flat_dim, flat_of) -> DataContextMesh:
        # _flatten returns the existing flattening when there is one (accelerate makes "dp_cp");
        # the flat mesh is kept here: slicing a flattened dim from the root is deprecated.
        if flat_of[-1] != cp_dim:
            raise ValueError(f"DataContextMesh: {cp_dim!r} must be the mesh's last flattened dimension, got {flat_of}.")
        return cls(mesh, cp_dim, flat_dim, mesh[tuple(flat_of)]._flatten(flat_dim))

    @property
    def cp(self) -> ContextParallelGroup:
        """This rank's context-parallel group (the ranks its rows are split over)."""
        return ContextParallelGroup.from_group(self.mesh.get_group(self.cp_dim))

    @property
    def dp_rank(self) -> int:
        """Which rows this rank trains: cp is the flattening's last (fastest) dimension."""
        return self.flat_mesh.get_local_rank() // self.mesh.size(self.mesh.mesh_dim_names.index(self.cp_dim))

    @property
    def dp_size(self) -> int:
        return self.flat_mesh.size() // self.mesh.size(self.mesh.mesh_dim_names.index(self.cp_dim))

    @property
    def flat_group(self) -> dist.ProcessGroup:
        return self.flat_mesh.get_group()

    def count_targets(self, shift_labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The number of counted targets over the whole dp x cp group (pass it as
        ``num_items_in_batch``: each rank's loss is then its share of the global mean)."""
        count = (shift_labels != ignore_index).sum()
        dist.all_reduce(count, group=self.flat_group)
        return count

    def all_reduce_gradients(self, model: nn.Module, bucket_bytes: int = BUCKET_BYTES) -> None:
        """Without FSDP: sum every gradient over dp x cp in bucketed collectives (the losses are
        shares of the global mean, so the sum is the global mean's gradient)."""
        all_reduce_coalesced(model_gradients(model), group=self.flat_group, bucket_bytes=bucket_bytes)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global mean loss from this rank's share (for logging; not differentiable)."""
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=self.flat_group)
        return loss

    def shard_model(self, model: nn.Module, mp_policy=None, reshard_after_forward: bool = True) -> nn.Module:
        """FSDP2 over the flattened dp x cp mesh (one unit per DecoderLayer, then the root), its
        reduce-scatter summing the gradients (no division by the number of ranks)."""
        from torch.distributed.fsdp import FSDPModule

        from .fsdp import shard_decoder_layers

        shard_decoder_layers(model, self.flat_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
        return model


def init_data_context_mesh(dp: int, cp: int, device_type: str = "cuda") -> DataContextMesh:
    """A ``("dp", "cp")`` DeviceMesh over ``dp * cp`` ranks (the process group must be up):
    consecutive ranks share a data-parallel rank (ranks ``d * cp .. d * cp + cp - 1`` split the
    rows of data-parallel rank d), and its flattening ``"dp_cp"``."""
    from torch.distributed.device_mesh import init_device_mesh

    for name, size in (("dp", dp), ("cp", cp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"init_data_context_mesh: {name} must be a positive int, got {size!r}.")
    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"init_data_context_mesh: dp x cp = {dp} x {cp} = {dp * cp} ranks, but {world} processes run; "
                         "launch dp * cp processes or change dp / cp.")
    mesh = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
    return DataContextMesh._with_flat(mesh, "cp", "dp_cp", ["dp", "cp"])
