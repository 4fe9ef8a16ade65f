"""Multi-query associative recall, MQAR (Arora et al. 2023, "Zoology"), written from the paper's description.

A sequence first lists D key-value pairs, then asks for every key again, each
at a position drawn with a power-law preference for short gaps; at each asked
key the model must predict the value that followed that key in the list. Only
the keys are repeated: the answer never appears in the input (Zoology's
generator), so nothing after a query can leak its value to later positions::

    k₁ v₁ k₂ v₂ … k_D v_D │ 0 0 k₂ 0 0 0 k₁ 0 0 0 … k_D 0
    └──── context ───────┘ └──── queries at power-law gaps ──┘

The parameters are the paper's: ``vocab_size``, ``num_kv_pairs`` (D),
``seq_len`` (T), and the power-law exponent ``power_a`` (α): a query slot at
distance j ≥ 1 (counted in slots of two tokens after the context) is drawn with
probability ∝ j^{α−1}, without replacement, so most queries sit close to the
context and a few far from it.

Tokens: 0 is the filler; keys are drawn without replacement from
``[1, vocab_size // 2)`` and values, also without replacement, from
``[vocab_size // 2, vocab_size)``, so a key never looks like a value and no two
keys share a value.

``sample`` returns ``inputs [B, T]`` and ``targets [B, T]``: the targets are
``IGNORE`` (−100) everywhere except where the input is an asked key, where the
target is its value (the loss is on the answers only). Every sequence asks
every key once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..config import check_int
from .recall import IGNORE

__all__ = ["MQAR", "MQARBatch"]


class MQARBatch(NamedTuple):
    inputs: torch.Tensor    # [B, T] token ids
    targets: torch.Tensor   # [B, T] the value after each asked key, IGNORE elsewhere
    keys: torch.Tensor      # [B, D] the keys, in context order
    values: torch.Tensor    # [B, D] their values
    slots: torch.Tensor     # [B, D] query slot (1-based distance in pairs after the context) of key i


@dataclass
class MQAR:
    """The task's parameters (see the module docstring); ``sample`` draws batches.

    Args:
        vocab_size: token ids are ``0 .. vocab_size − 1`` (half keys, half values; each half
            must hold D distinct ids).
        seq_len: T, the length of ``inputs``; needs ``T ≥ 4·D`` (the context and one
            slot of two tokens per query).
        num_kv_pairs: D, pairs in the context, each asked once.
        power_a: α in (0, 1], the power-law exponent of the query gaps (0.01 in the paper).
    """

    vocab_size: int = 8192
    seq_len: int = 64
    num_kv_pairs: int = 4
    power_a: float = 0.01

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_kv_pairs"):
            value = getattr(self, name)
            check_int("MQAR", name, value)
        if self.vocab_size // 2 - 1 < self.num_kv_pairs or self.vocab_size - self.vocab_size // 2 < self.num_kv_pairs:
            raise ValueError(f"MQAR: `vocab_size`={self.vocab_size} has {self.vocab_size // 2 - 1} key ids, fewer than "
                             f"`num_kv_pairs`={self.num_kv_pairs}")
        if self.seq_len < 4 * self.num_kv_pairs:
            raise ValueError(f"MQAR: `seq_len`={self.seq_len} is too short for {self.num_kv_pairs} pairs and their "
                             f"queries (needs >= 4·num_kv_pairs = {4 * self.num_kv_pairs})")
        if not 0 < self.power_a <= 1:
            raise ValueError(f"MQAR: `power_a` must be in (0, 1], got {self.power_a!r}")

    @property
    def num_slots(self) -> int:
        """Query slots of two tokens after the context (the last token of a sequence is a target only)."""
        return (self.seq_len + 1 - 2 * self.num_kv_pairs) // 2

    def gap_probabilities(self) -> torch.Tensor:
        """P(slot j) ∝ j^{α−1}, j = 1 .. num_slots (before drawing without replacement)."""
        j = torch.arange(1, self.num_slots + 1, dtype=torch.float64)
        p = j ** (self.power_a - 1)
        return p / p.sum()

    def sample(self, batch_size: int, generator: Optional[torch.Generator] = None) -> MQARBatch:
        """Draw ``batch_size`` sequences (deterministic given the generator's state)."""
        check_int("MQAR.sample", "batch_size", batch_size)
        b, d, t = batch_size, self.num_kv_pairs, self.seq_len
        half = self.vocab_size // 2
        keys = 1 + torch.rand(b, half - 1, generator=generator).argsort(dim=1)[:, :d]     # distinct keys
        values = half + torch.rand(b, self.vocab_size - half, generator=generator).argsort(dim=1)[:, :d]  # distinct
        weights = self.gap_probabilities().to(torch.float32).expand(b, -1)
        slots = 1 + torch.multinomial(weights, d, replacement=False, generator=generator)  # [B, D], distinct
        tokens = torch.zeros(b, t + 1, dtype=torch.long)
        tokens[:, 0:2 * d:2] = keys
        tokens[:, 1:2 * d:2] = values
        key_pos = 2 * d + 2 * (slots - 1)                                                  # [B, D]
        tokens.scatter_(1, key_pos, keys)  # only the key: the value is the answer, never an input
        inputs = tokens[:, :-1]
        targets = torch.full_like(inputs, IGNORE)
        targets.scatter_(1, key_pos, values)
        return MQARBatch(inputs.contiguous(), targets, keys, values, slots)
