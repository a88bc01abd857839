"""hf_hybrid.kernels: one public function per op, each with backend dispatch (see _backend.py).

Every op has ``<op>/reference.py`` (plain PyTorch, states the math; the test oracle) and, where it
matters, ``<op>/triton.py``. Ops load lazily on first use, so importing this package costs nothing
(and the folder stays inert if Python ever finds it as a top-level ``kernels`` from a checkout's
root, where transformers probes for Hugging Face's own ``kernels`` package).
"""
from __future__ import annotations

import importlib

_OPS = {
    "gated_recurrence": "gated_recurrence",
    "block_end_attention": "chunk_attention",
    "chunk_end_attention": "chunk_attention",
    "forgetting_attention": "forgetting_attention",
    "forgetting_attention_with_cache": "forgetting_attention",
    "residual_linear_attention": "residual_linear_attention",
    "residual_linear_attention_decode": "residual_linear_attention",
    "sliding_window_attention": "residual_linear_attention",
    "span_expanded_attention": "span_expanded_attention",
    "topk_block_attention": "topk_block_attention",
}

__all__ = sorted(_OPS)


def __getattr__(name: str):
    if name in _OPS and __name__ != "kernels":
        return getattr(importlib.import_module(f".{_OPS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
