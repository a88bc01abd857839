"""Evaluation helpers usable with any causal LM (hf-hybrid or plain transformers models)."""
from .memory import cache_nbytes, cache_nbytes_at_context
from .recall import recall_accuracy

__all__ = ["cache_nbytes", "cache_nbytes_at_context", "recall_accuracy"]
