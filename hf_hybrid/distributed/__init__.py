"""Training past one GPU: parameter sharding (FSDP2, DeepSpeed ZeRO-3) and context parallelism.

- :func:`shard_decoder_layers` (fsdp.py): FSDP2's ``fully_shard`` over each DecoderLayer, then the
  root (embeddings, final norm, LM head), on any DeviceMesh (CUDA with NCCL, CPU with gloo).
- :func:`gather_whole_decoder_layers` (zero3.py): makes each DecoderLayer one ZeRO-3 gather unit,
  so the mixers' custom ops, which read their projections' weights directly, see full parameters.
- :func:`context_parallel` (context_parallel.py): one sequence split over the ranks of a process
  group (:class:`ContextParallelGroup`), each mixer exchanging what its math needs at the borders.
"""
from .context_parallel import ContextParallelGroup, context_parallel
from .fsdp import shard_decoder_layers
from .zero3 import gather_whole_decoder_layers

__all__ = ["ContextParallelGroup", "context_parallel", "shard_decoder_layers", "gather_whole_decoder_layers"]
