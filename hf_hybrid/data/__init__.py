"""Synthetic data the package generates itself (no downloads): recall tasks and toy languages."""
from .recall import RecallVocab, make_mqar_dataset, mqar_example

__all__ = ["RecallVocab", "make_mqar_dataset", "mqar_example"]
