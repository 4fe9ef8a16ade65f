"""Associative recall with overwrites: the latest value written to a key must be returned.

A sequence writes ``n_pairs`` key-value pairs, drawing its keys from only
``n_active_keys`` distinct keys, so most keys are written several times with
different values. After a separator it asks for ``n_queries`` distinct keys; the
right answer is the value written to that key *last*::

    writes                           separator   queries (answers supervised)
    c 3  a 7  c 1  b 2  a 5  c 4     ?           a 5  c 4  b 2

Tokens: 0 is the separator ``?``; keys are 1..n_keys (printed a, b, c, ...);
values are n_keys+1 .. n_keys+n_values (printed 0, 1, 2, ...).

This is what separates the memories (Schlag et al. 2021): the sum rule of linear
attention adds the new value on top of the old one, so an overwritten key reads
back a blend; the delta rule first retrieves the old value and replaces it.
The generator is a plain function of a ``torch.Generator``, reusable by studies
(MQAR is the special case ``n_active_keys == n_pairs``: no overwrites).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..config import check_int

SEP = 0
IGNORE = -100  # target id that the loss and the accuracy skip


@dataclass
class RecallBatch:
    """One batch of the task.

    Fields:
        tokens: ``[B, L]`` full sequences (writes, separator, queries with answers).
        inputs, targets: ``[B, L − 1]`` next-token pairs; targets are ``IGNORE``
            except at the answers.
        overwritten: ``[B, L − 1]`` bool, True at answers whose key was written more than once.
    """

    tokens: torch.Tensor
    inputs: torch.Tensor
    targets: torch.Tensor
    overwritten: torch.Tensor


@dataclass
class AssociativeRecall:
    """The task's sizes; ``sample`` draws batches. See the module docstring.

    Args:
        n_keys: key symbols in the vocabulary.
        n_values: value symbols in the vocabulary.
        n_pairs: writes per sequence.
        n_active_keys: distinct keys a sequence uses (< n_pairs forces overwrites).
        n_queries: distinct keys asked after the separator (<= n_active_keys).
    """

    n_keys: int = 16
    n_values: int = 16
    n_pairs: int = 16
    n_active_keys: int = 6
    n_queries: int = 4

    def __post_init__(self) -> None:
        for name in ("n_keys", "n_values", "n_pairs", "n_active_keys", "n_queries"):
            value = getattr(self, name)
            check_int("AssociativeRecall", name, value)
        if self.n_active_keys > self.n_keys:
            raise ValueError(f"AssociativeRecall: `n_active_keys`={self.n_active_keys} exceeds `n_keys`={self.n_keys}")
        if self.n_active_keys > self.n_pairs:
            raise ValueError(f"AssociativeRecall: `n_active_keys`={self.n_active_keys} exceeds `n_pairs`={self.n_pairs}")
        if self.n_queries > self.n_active_keys:
            raise ValueError(f"AssociativeRecall: `n_queries`={self.n_queries} exceeds `n_active_keys`={self.n_active_keys}")

    @property
    def vocab_size(self) -> int:
        return 1 + self.n_keys + self.n_values

    @property
    def seq_len(self) -> int:
        """Length of a full sequence ``tokens`` (inputs are one shorter)."""
        return 2 * self.n_pairs + 1 + 2 * self.n_queries

    def key_token(self, i: torch.Tensor) -> torch.Tensor:
        return 1 + i

    def value_token(self, j: torch.Tensor) -> torch.Tensor:
        return 1 + self.n_keys + j

    def sample(self, batch_size: int, generator: Optional[torch.Generator] = None) -> RecallBatch:
        """Draw ``batch_size`` sequences (deterministic given the generator's state)."""
        B, P, A, Q = batch_size, self.n_pairs, self.n_active_keys, self.n_queries
        rows = torch.arange(B)
        active = torch.rand(B, self.n_keys, generator=generator).argsort(dim=1)[:, :A]  # [B, A] distinct keys
        # Every active key is written at least once, the remaining writes overwrite; shuffled.
        slots = torch.cat([torch.arange(A).expand(B, A), torch.randint(0, A, (B, P - A), generator=generator)], dim=1)
        slots = slots.gather(1, torch.rand(B, P, generator=generator).argsort(dim=1))
        keys = active.gather(1, slots)                                    # [B, P]
        values = torch.randint(0, self.n_values, (B, P), generator=generator)
        latest = torch.zeros(B, self.n_keys, dtype=torch.long)
        times = torch.zeros(B, self.n_keys, dtype=torch.long)
        for p in range(P):  # later writes replace earlier ones
            latest[rows, keys[:, p]] = values[:, p]
            times[rows, keys[:, p]] += 1
        asked = active.gather(1, torch.rand(B, A, generator=generator).argsort(dim=1)[:, :Q])  # [B, Q] distinct
        answers = latest.gather(1, asked)
        writes = torch.stack([self.key_token(keys), self.value_token(values)], dim=2).reshape(B, 2 * P)
        queries = torch.stack([self.key_token(asked), self.value_token(answers)], dim=2).reshape(B, 2 * Q)
        tokens = torch.cat([writes, torch.full((B, 1), SEP), queries], dim=1)
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        is_answer = torch.zeros_like(targets, dtype=torch.bool)
        answer_pos = 2 * P + 1 + 2 * torch.arange(Q)  # in targets (tokens shifted by one): each answer
        is_answer[:, answer_pos] = True
        targets[~is_answer] = IGNORE
        overwritten = torch.zeros_like(is_answer)
        overwritten[:, answer_pos] = times.gather(1, asked) > 1
        return RecallBatch(tokens, inputs, targets, overwritten)

    # -- readable text ----------------------------------------------------------------------
    def _key_name(self, i: int) -> str:
        return chr(ord("a") + i) if self.n_keys <= 26 else f"k{i}"

    def decode(self, ids) -> str:
        """Token ids -> ``"c 3 a 7 ? a 7"``."""
        out = []
        for t in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            if t == SEP:
                out.append("?")
            elif 1 <= t <= self.n_keys:
                out.append(self._key_name(t - 1))
            elif t < self.vocab_size:
                out.append(str(t - 1 - self.n_keys))
            else:
                out.append(f"<{t}>")
        return " ".join(out)

    def encode(self, text: str) -> List[int]:
        """``"c 3 a 7 ? a"`` -> token ids (the inverse of :meth:`decode`)."""
        keys = {self._key_name(i): 1 + i for i in range(self.n_keys)}
        ids = []
        for word in text.split():
            if word == "?":
                ids.append(SEP)
            elif word in keys:
                ids.append(keys[word])
            elif word.isdigit() and int(word) < self.n_values:
                ids.append(1 + self.n_keys + int(word))
            else:
                raise ValueError(
                    f"AssociativeRecall.encode: `text` has the word {word!r}; expected '?', a key "
                    f"({self._key_name(0)}..{self._key_name(self.n_keys - 1)}) or a value (0..{self.n_values - 1})"
                )
        return ids


def recall_accuracy(logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor] = None) -> Tuple[int, int]:
    """(correct, counted) argmax predictions at positions whose target is not ``IGNORE`` (and ``mask``)."""
    keep = targets != IGNORE
    if mask is not None:
        keep = keep & mask
    correct = (logits.argmax(-1) == targets) & keep
    return int(correct.sum()), int(keep.sum())
