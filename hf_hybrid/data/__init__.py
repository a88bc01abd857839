"""Synthetic data the package generates itself (no downloads): recall tasks and toy languages."""
from .recall import RecallVocab, make_mqar_dataset, mqar_example
from .language import LANGUAGE_PRESETS, SyntheticLanguage, make_language_dataset, oracle_loss_by_position
from .needle import RULER_TASKS, NeedleTask, NeedleVocab, make_needle_dataset, needle_example

__all__ = [
    "RecallVocab",
    "make_mqar_dataset",
    "mqar_example",
    "LANGUAGE_PRESETS",
    "SyntheticLanguage",
    "make_language_dataset",
    "oracle_loss_by_position",
    "RULER_TASKS",
    "NeedleTask",
    "NeedleVocab",
    "make_needle_dataset",
    "needle_example",
]
