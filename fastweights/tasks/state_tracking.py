"""State tracking: word problems over finite groups (parity, sums mod m, permutation groups).

A word problem over a group G: read elements ``x_1, x_2, …`` of G one token at a time and
say, at every position t, which element the running product ``x_1 · x_2 ⋯ x_t`` is. The
tasks of the state-tracking literature are all of this form:

=============  ====================  =====================================================
task           group                 tokens and labels
=============  ====================  =====================================================
``parity``     Z_2                   bits; the label is the parity of the bits so far
``mod3``       Z_3                   digits 0..2; the label is their sum mod 3
``mod5``       Z_5                   digits 0..4; the label is their sum mod 5
``S3``         symmetric group S_3   its 6 permutations; the label is the running product
``A4``, ``S4`` alternating/symmetric 12 / 24 permutations of 4 points
``A5``, ``S5`` alternating/symmetric 60 / 120 permutations of 5 points
=============  ====================  =====================================================

Why these: a linear RNN whose per-token transition matrices have only non-negative real
eigenvalues cannot solve parity at every length in finite precision; eigenvalues in
[−1, 1] (DeltaNet with β ∈ [0, 2], a Householder *reflection* at β = 2) can
(Grazzi et al. 2025, "Unlocking State-Tracking in Linear RNNs Through Negative
Eigenvalues", arXiv 2411.12537). Z_3 and the non-abelian groups need transitions that
are not symmetric (rotations): a product of n_h Householder steps per token
(DeltaProduct, Siems et al. 2025, arXiv 2502.10297). A5 and S5 are not solvable groups:
their word problems are NC¹-complete (Barrington 1989), beyond what a constant-depth
parallel circuit computes (Merrill et al. 2024, "The Illusion of State in State-Space
Models", arXiv 2404.08819).

Labels are given at every position (the "sequence-to-sequence" form of Deletang et al. 2023,
arXiv 2207.02098), so one training sequence of length L teaches every prefix length 1..L;
a model trained on lengths ≤ L is tested on longer sequences (length generalisation).
Inputs and labels share one id space ``[0, vocab_size)``: element i of the group is token i
and label i.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..config import check_int

__all__ = ["TASKS", "GroupWordProblem", "StateTrackingBatch", "make_state_tracking_task"]


@dataclass
class StateTrackingBatch:
    """``inputs`` and ``targets``: LongTensors ``[B, T]``; ``targets[b, t]`` is the running product
    of ``inputs[b, :t + 1]`` (an element index)."""

    inputs: torch.Tensor
    targets: torch.Tensor


def _compose(p: Tuple[int, ...], q: Tuple[int, ...]) -> Tuple[int, ...]:
    """The permutation "first p, then q": i ↦ q[p[i]]."""
    return tuple(q[i] for i in p)


def _is_even(p: Tuple[int, ...]) -> bool:
    inversions = sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j])
    return inversions % 2 == 0


def _permutation_table(n: int, alternating: bool) -> Tuple[torch.Tensor, List[Tuple[int, ...]]]:
    """The multiplication table of S_n (or A_n): ``table[a, b]`` is the index of "a, then b";
    element 0 is the identity (permutations in lexicographic order)."""
    elements = [p for p in itertools.permutations(range(n)) if not alternating or _is_even(p)]
    index = {p: i for i, p in enumerate(elements)}
    table = torch.tensor([[index[_compose(a, b)] for b in elements] for a in elements], dtype=torch.long)
    return table, elements


def _cyclic_table(m: int) -> torch.Tensor:
    """Z_m under addition: ``table[a, b] = (a + b) mod m``; 0 is the identity."""
    r = torch.arange(m)
    return (r[:, None] + r[None, :]) % m


#: task name -> (group, a one-line description); see the module docstring.
TASKS: Dict[str, str] = {
    "parity": "Z_2: the parity of the bits so far",
    "mod3": "Z_3: the sum of the digits so far, mod 3",
    "mod5": "Z_5: the sum of the digits so far, mod 5",
    "S3": "S_3: the running product of permutations of 3 points",
    "A4": "A_4: the running product of even permutations of 4 points",
    "S4": "S_4: the running product of permutations of 4 points",
    "A5": "A_5: the running product of even permutations of 5 points",
    "S5": "S_5: the running product of permutations of 5 points",
}


class GroupWordProblem:
    """The word problem over a finite group given by its multiplication table.

    Args:
        name: the task's name (one of :data:`TASKS` for the built-in ones).
        table: LongTensor ``[n, n]``, ``table[a, b]`` = the index of the product "a, then b";
            index 0 must be the identity.

    Attributes:
        vocab_size: ``n`` (inputs and labels are both element indices).
        abelian: whether the group is commutative.
    """

    def __init__(self, name: str, table: torch.Tensor) -> None:
        if table.dim() != 2 or table.shape[0] != table.shape[1] or table.dtype != torch.long:
            raise ValueError(f"GroupWordProblem: `table` must be a square LongTensor, got {tuple(table.shape)} {table.dtype}")
        n = table.shape[0]
        ident = torch.arange(n)
        if not (torch.equal(table[0], ident) and torch.equal(table[:, 0], ident)):
            raise ValueError("GroupWordProblem: element 0 of `table` must be the identity")
        self.name, self.table, self.vocab_size = name, table, n
        self.abelian = bool(torch.equal(table, table.T))

    def running_product(self, inputs: torch.Tensor) -> torch.Tensor:
        """Labels ``[B, T]`` for ``inputs`` ``[B, T]``: the index of ``x_1 ⋯ x_t`` at every t."""
        if inputs.dim() != 2:
            raise ValueError(f"{self.name}: `inputs` must be [B, T], got {tuple(inputs.shape)}")
        out = torch.empty_like(inputs)
        state = torch.zeros(inputs.shape[0], dtype=torch.long)
        for t in range(inputs.shape[1]):
            state = self.table[state, inputs[:, t]]
            out[:, t] = state
        return out

    def sample(self, batch_size: int, length: int, generator: Optional[torch.Generator] = None) -> StateTrackingBatch:
        """``batch_size`` sequences of ``length`` elements drawn uniformly, with their labels."""
        for arg, value in (("batch_size", batch_size), ("length", length)):
            check_int(f"{self.name}.sample", arg, value)
        inputs = torch.randint(0, self.vocab_size, (batch_size, length), generator=generator)
        return StateTrackingBatch(inputs, self.running_product(inputs))

    def __repr__(self) -> str:
        return f"GroupWordProblem({self.name!r}, order {self.vocab_size}, {'abelian' if self.abelian else 'non-abelian'})"


def make_state_tracking_task(name: str) -> GroupWordProblem:
    """The built-in task ``name`` (one of :data:`TASKS`); a ``ValueError`` naming ``task`` otherwise."""
    if name == "parity":
        return GroupWordProblem(name, _cyclic_table(2))
    if name in ("mod3", "mod5"):
        return GroupWordProblem(name, _cyclic_table(int(name[3:])))
    if name in ("S3", "A4", "S4", "A5", "S5"):
        return GroupWordProblem(name, _permutation_table(int(name[1]), alternating=name[0] == "A")[0])
    raise ValueError(f"unknown `task` {name!r}; expected one of {', '.join(TASKS)}")
