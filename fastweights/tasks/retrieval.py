"""Synthetic associative retrieval, settings 1 and 2 of Schlag et al. (2021, §6.1).

A sequence writes key-value pairs into a memory, then asks for the value of keys
it wrote. Keys and values are symbols (ids), not vectors: a model learns their
embeddings, so what it must learn is keys that its memory can keep apart.

- Setting 1 (capacity, Schlag et al. 2021): a pool of S unique keys; each sequence
  writes every one of the S keys exactly once, in random order, each with its own
  value (values drawn *without* replacement, as in the paper, so a read cannot be
  right by sharing a value with another key), then queries stored keys. S grows until the memory can no longer hold S
  associations (the paper's thresholds: S ≈ 60 for linear attention at
  d_dot = 64; 128/256/384 for DPFP ν = 1/2/3).
- Setting 2 (update, Schlag et al. 2021): keys are drawn *with replacement* from a
  pool of S keys (the paper: 20 keys, 40 pairs), so keys are re-assigned; the
  answer to a query is the value written to that key *last*.

Batches are plain integer tensors::

    keys    [B, L]   key id written at step t            (0 .. S−1)
    values  [B, L]   value id written at step t          (0 .. num_values−1)
    queries [B, Q]   key ids asked after the L writes    (distinct, all written)
    targets [B, Q]   the (latest) value of each queried key
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..config import check_int

__all__ = ["RetrievalTask", "RetrievalBatch"]


class RetrievalBatch(NamedTuple):
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    targets: torch.Tensor


@dataclass
class RetrievalTask:
    """One setting of the task.

    Args:
        setting: 1 (each of the S keys written once, values without replacement) or 2
            (keys and values drawn with replacement).
        num_keys: S, the pool of unique keys.
        num_values: the value vocabulary (default: S; setting 1 needs at least S).
        num_pairs: L, writes per sequence; setting 1 requires L = S (the default);
            setting 2 defaults to 2S (the paper's 40 pairs over 20 keys).
        num_queries: Q distinct written keys asked per sequence (the paper asks 1;
            asking more reads the same final memory, so it adds training signal
            without changing what the memory must hold).
    """

    setting: int = 1
    num_keys: int = 20
    num_values: Optional[int] = None
    num_pairs: Optional[int] = None
    num_queries: int = 1

    def __post_init__(self) -> None:
        if self.setting not in (1, 2):
            raise ValueError(f"RetrievalTask: `setting` must be 1 or 2, got {self.setting!r}")
        for name in ("num_keys", "num_values", "num_pairs", "num_queries"):
            value = getattr(self, name)
            if value is None and name in ("num_values", "num_pairs"):
                continue
            check_int("RetrievalTask", name, value)
        if self.num_values is None:
            self.num_values = self.num_keys
        if self.num_pairs is None:
            self.num_pairs = self.num_keys if self.setting == 1 else 2 * self.num_keys
        if self.setting == 1 and self.num_pairs != self.num_keys:
            raise ValueError(f"RetrievalTask: setting 1 writes each key once, so `num_pairs` must equal "
                             f"`num_keys`={self.num_keys}, got {self.num_pairs}")
        if self.setting == 1 and self.num_values < self.num_keys:
            raise ValueError(f"RetrievalTask: setting 1 draws the S values without replacement, so `num_values` "
                             f"must be >= `num_keys`={self.num_keys}, got {self.num_values}")
        most = self.num_keys if self.setting == 1 else min(self.num_keys, self.num_pairs)
        if self.num_queries > most:
            raise ValueError(f"RetrievalTask: `num_queries`={self.num_queries} exceeds the {most} distinct keys "
                             f"a sequence can write")

    def sample(self, batch_size: int, generator: Optional[torch.Generator] = None) -> RetrievalBatch:
        """Draw ``batch_size`` sequences (deterministic given the generator's state)."""
        check_int("RetrievalTask.sample", "batch_size", batch_size)
        b, s, n, q = batch_size, self.num_keys, self.num_pairs, self.num_queries
        if self.setting == 1:
            values = torch.rand(b, self.num_values, generator=generator).argsort(dim=1)[:, :n]  # no repeats
            keys = torch.rand(b, s, generator=generator).argsort(dim=1)  # a permutation: each key once
            position = keys.argsort(dim=1)  # position[b, key] = the step that wrote it
            queries = torch.rand(b, s, generator=generator).argsort(dim=1)[:, :q]
            targets = values.gather(1, position.gather(1, queries))
            return RetrievalBatch(keys, values, queries, targets)
        values = torch.randint(0, self.num_values, (b, n), generator=generator)
        keys = torch.randint(0, s, (b, n), generator=generator)
        # A sequence must write at least Q distinct keys; redraw the (rare) ones that do not.
        for _ in range(1000):
            short = torch.tensor([len(set(row)) < q for row in keys.tolist()])
            if not bool(short.any()):
                break
            keys[short] = torch.randint(0, s, (int(short.sum()), n), generator=generator)
        else:  # pragma: no cover - only for sizes where Q distinct keys are nearly impossible
            raise ValueError(f"RetrievalTask.sample: sequences of {n} writes over {s} keys rarely hold "
                             f"`num_queries`={q} distinct keys; lower num_queries or raise num_pairs")
        # latest[b, key] = the last value written to key (-1: never written), by a scan over the writes.
        latest = torch.full((b, s), -1, dtype=torch.long)
        rows = torch.arange(b)
        for t in range(n):
            latest[rows, keys[:, t]] = values[:, t]
        written = latest >= 0
        # Draw Q distinct written keys: random scores, unwritten keys pushed last.
        scores = torch.rand(b, s, generator=generator) + (~written).to(torch.float32) * 2.0
        queries = scores.argsort(dim=1)[:, :q]
        return RetrievalBatch(keys, values, queries, latest.gather(1, queries))
