"""hf_hybrid.kernels: one public function per op, each with backend dispatch (see _backend.py).

Every op has ``<op>/reference.py`` (plain PyTorch, states the math; the test oracle) and, where it
matters, ``<op>/triton.py`` (Triton itself is imported only when a Triton backend runs).
"""
from __future__ import annotations

# Python finds this folder as a top-level `kernels` when run from a checkout's root (`python -m
# benchmarks.X`, PYTHONPATH=$PWD). That name is Hugging Face's kernel-hub package, which transformers
# imports where it is installed (a dependency of newer releases): hand the name over to it then, and
# otherwise stay an empty shell.
if __name__ == "kernels":
    from ._top_level_name import hand_over_to_the_hub_package

    hand_over_to_the_hub_package(__file__)
else:
    from .causal_conv1d import causal_conv1d, causal_conv1d_step
    from .chunk_attention import block_end_attention, chunk_end_attention
    from .forgetting_attention import forgetting_attention, forgetting_attention_with_cache
    from .gated_recurrence import gated_recurrence
    from .linear_cross_entropy import linear_cross_entropy
    from .mamba2_mixer import mamba2_mixer
    from .residual_linear_attention import residual_linear_attention, residual_linear_attention_decode, sliding_window_attention
    from .span_expanded_attention import span_expanded_attention
    from .ssd_scan import mamba2_decode_step, ssd_scan, ssd_step
    from .topk_block_attention import topk_block_attention
    from .window_attention import window_attention

__all__ = [
    "block_end_attention",
    "causal_conv1d",
    "causal_conv1d_step",
    "chunk_end_attention",
    "forgetting_attention",
    "forgetting_attention_with_cache",
    "gated_recurrence",
    "linear_cross_entropy",
    "mamba2_decode_step",
    "mamba2_mixer",
    "residual_linear_attention",
    "residual_linear_attention_decode",
    "sliding_window_attention",
    "span_expanded_attention",
    "ssd_scan",
    "ssd_step",
    "topk_block_attention",
    "window_attention",
]
