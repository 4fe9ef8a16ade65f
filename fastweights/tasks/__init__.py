"""Data for training and studies, generated or read locally (never downloaded).

- :class:`AssociativeRecall`: associative recall with overwrites (``recall.py``).
- :class:`ByteText`: any text file as byte-level tokens (``text.py``).
- :class:`RetrievalTask`: Schlag et al. (2021) retrieval settings 1 and 2 (``retrieval.py``).
- :class:`MQAR`: multi-query associative recall, Arora et al. (2023) (``mqar.py``).
- :class:`GroupWordProblem`: state tracking, word problems over finite groups: parity, sums mod m,
  S3, A4, S4, A5, S5 (``state_tracking.py``).
- :func:`make_task`: the training loop's data source for a training config (``adapters.py``).
"""

from .recall import IGNORE, SEP, AssociativeRecall, RecallBatch, recall_accuracy
from .text import ByteText
from .retrieval import RetrievalBatch, RetrievalTask
from .mqar import MQAR, MQARBatch
from .state_tracking import GroupWordProblem, StateTrackingBatch, make_state_tracking_task
from .adapters import RecallData, TextData, make_task, step_generator

__all__ = ["AssociativeRecall", "RecallBatch", "recall_accuracy", "ByteText", "IGNORE", "SEP",
           "RetrievalTask", "RetrievalBatch", "MQAR", "MQARBatch", "RecallData", "TextData", "make_task",
           "step_generator", "GroupWordProblem", "StateTrackingBatch", "make_state_tracking_task"]
