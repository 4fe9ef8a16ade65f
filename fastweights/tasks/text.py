"""Byte-level text: any file is a dataset, the vocabulary is the 256 byte values.

No tokenizer, no download. The last ``val_fraction`` of the bytes is held out for
evaluation; training windows are drawn uniformly from the rest.

A file is memory-mapped, never read whole: its tokens are a read-only ``uint8`` view of
the file's pages (:func:`read_bytes`), and a batch converts only its own windows to
int64. Memory therefore grows with what is read (the OS pages the file in and out), not
with the file: ``benchmarks/data_memory.py`` measures it.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from ..config import check_int

VOCAB_SIZE = 256


def read_bytes(source, what: str = "data") -> Tuple[torch.Tensor, str]:
    """(a file's bytes as ``uint8`` tokens ``[N]``, its name); ``source`` may be the bytes themselves.

    A file is memory-mapped (``torch.from_file``, a private read-only use of the mapping):
    nothing is read until a slice of it is used, so a 600 MB file costs no 600 MB of RAM.
    Convert the slices you use with ``.long()``.
    """
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
        if not data:  # frombuffer refuses an empty buffer
            return torch.zeros(0, dtype=torch.uint8), "<bytes>"
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), "<bytes>"
    name = os.fspath(source)
    if not os.path.isfile(name):
        raise ValueError(f"ByteText: {what} file {name!r} does not exist (or is not a file)")
    size = os.path.getsize(name)
    if size == 0:
        return torch.zeros(0, dtype=torch.uint8), name
    return torch.from_file(name, shared=False, size=size, dtype=torch.uint8), name


class ByteText:
    """Windows of ``seq_len + 1`` bytes of a file, as (inputs, targets) ``[B, seq_len]`` pairs.

    Args:
        source: a file path, or the ``bytes`` themselves.
        seq_len: tokens per training window.
        val_fraction: share of the bytes (at the end) held out for evaluation.
        val_source: a separate held-out file (or bytes); then all of ``source`` is for training.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, source, seq_len: int, val_fraction: float = 0.1, val_source=None) -> None:
        check_int("ByteText", "seq_len", seq_len)
        if not 0 < val_fraction < 1:
            raise ValueError(f"ByteText: `val_fraction` must be in (0, 1), got {val_fraction!r}")
        tokens, name = read_bytes(source, "data")
        if val_source is not None:
            val, val_name = read_bytes(val_source, "held-out data")
            for what, t, n in (("data", tokens, name), ("held-out data", val, val_name)):
                if len(t) < seq_len + 1:
                    raise ValueError(f"ByteText: {what} file {n!r} has {len(t)} bytes, fewer than one window of "
                                     f"seq_len + 1 = {seq_len + 1}; use a longer file or a smaller --seq-len")
            self.name, self.seq_len, self.train, self.val = name, seq_len, tokens, val
            return
        if len(tokens) == 0:
            raise ValueError(f"ByteText: data file {name!r} is empty; it needs at least {2 * (seq_len + 1)} bytes")
        n_val = max(seq_len + 1, int(len(tokens) * val_fraction))
        if len(tokens) - n_val < seq_len + 1:
            raise ValueError(
                f"ByteText: data file {name!r} has {len(tokens)} bytes, too few for windows of "
                f"seq_len + 1 = {seq_len + 1} in both the training and the held-out part "
                f"(needs at least {2 * (seq_len + 1)}); use a longer file or a smaller --seq-len"
            )
        self.name, self.seq_len = name, seq_len
        self.train, self.val = tokens[:-n_val], tokens[-n_val:]

    def sample(self, batch_size: int, generator: Optional[torch.Generator] = None, split: str = "train") -> Tuple[torch.Tensor, torch.Tensor]:
        """Random windows: ``(inputs [B, seq_len], targets [B, seq_len])``, targets shifted by one."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - self.seq_len, (batch_size,), generator=generator)
        windows = data[starts[:, None] + torch.arange(self.seq_len + 1)].long()  # only these bytes are read
        return windows[:, :-1], windows[:, 1:]

    @staticmethod
    def encode(text: str):
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
