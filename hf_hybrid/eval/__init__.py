"""Evaluation helpers usable with any causal LM (hf-hybrid or plain transformers models)."""
from .memory import cache_nbytes, cache_nbytes_at_context
from .recall import recall_accuracy
from .needle import NeedleGrid, needle_accuracy, needle_grid, needle_scores
from .positions import PositionLoss, per_token_loss, perplexity_by_length

__all__ = [
    "cache_nbytes",
    "cache_nbytes_at_context",
    "recall_accuracy",
    "NeedleGrid",
    "needle_accuracy",
    "needle_grid",
    "needle_scores",
    "PositionLoss",
    "per_token_loss",
    "perplexity_by_length",
]
