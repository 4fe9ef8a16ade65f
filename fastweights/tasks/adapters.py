"""The data behind the training loop's interface: ``sample(B, generator, split)``, ``encode``, ``decode``.

:func:`make_task` picks the source a training config names (the recall task, or a text
file as bytes); :func:`step_generator` makes the batch of step s a pure function of
(seed, s), so a resumed run draws the batches an uninterrupted one would.
"""

from __future__ import annotations

import torch

from .recall import AssociativeRecall
from .text import ByteText

__all__ = ["RecallData", "TextData", "make_task", "step_generator"]


class RecallData:
    """The recall task behind the interface the loop uses: ``sample(B, generator, split)``."""

    tokenizer = "recall"

    def __init__(self, config) -> None:
        self.task = AssociativeRecall(config.recall_keys, config.recall_values, config.recall_pairs,
                                      config.recall_active_keys, config.recall_queries)
        self.vocab_size, self.seq_len = self.task.vocab_size, self.task.seq_len - 1

    def sample(self, batch_size, generator, split="train"):
        b = self.task.sample(batch_size, generator)
        return b.inputs, b.targets

    def encode(self, text):
        return self.task.encode(text)

    def decode(self, ids):
        return self.task.decode(ids)


class TextData(ByteText):
    tokenizer = "bytes"


def make_task(config):
    """The data source of ``config.data``: recall, or a text file as bytes (held out: the
    file ``config.val_data``, or the last 10% of ``config.data``)."""
    if config.data == "recall":
        return RecallData(config)
    return TextData(config.data, config.seq_len, val_source=config.val_data)


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """The generator of one batch: a pure function of (seed, step, stream)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + stream * 7_919 + step) % (2**63 - 1))

