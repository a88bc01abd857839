"""Training past one GPU: parameter sharding (FSDP2, DeepSpeed ZeRO-3) and context parallelism.

- :func:`shard_decoder_layers` (fsdp.py): FSDP2's ``fully_shard`` over each DecoderLayer, then the
  root (embeddings, final norm, LM head), on any DeviceMesh (CUDA with NCCL, CPU with gloo).
- :func:`gather_whole_decoder_layers` (zero3.py): makes each DecoderLayer one ZeRO-3 gather unit,
  so the mixers' custom ops, which read their projections' weights directly, see full parameters.
- :func:`context_parallel` (context_parallel.py): one sequence split over the ranks of a process
  group (:class:`ContextParallelGroup`), each mixer exchanging what its math needs at the borders.
- :func:`init_data_context_mesh` / :class:`DataContextMesh` (mesh.py): context parallelism composed
  with data parallelism on a ``("dp", "cp")`` mesh, FSDP2 over its flattening or plain gradient sums.
"""
from .context_parallel import ContextParallelGroup, context_parallel
from .fsdp import shard_decoder_layers
from .mesh import DataContextMesh, init_data_context_mesh
from .zero3 import gather_whole_decoder_layers

__all__ = [
    "ContextParallelGroup", "DataContextMesh", "context_parallel", "init_data_context_mesh", "shard_decoder_layers",
    "gather_whole_decoder_layers",
]
