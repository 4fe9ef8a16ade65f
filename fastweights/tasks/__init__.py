"""Data for training and studies, generated or read locally (never downloaded).

- :class:`AssociativeRecall`: associative recall with overwrites (``recall.py``).
- :class:`ByteText`: any text file as byte-level tokens (``text.py``).
"""

from .recall import IGNORE, SEP, AssociativeRecall, RecallBatch, recall_accuracy
from .text import ByteText

__all__ = ["AssociativeRecall", "RecallBatch", "recall_accuracy", "ByteText", "IGNORE", "SEP"]
