"""Linear attention, parallel form: one masked T×T product, no state in the loop.

    O = scale · tril(Q Kᵀ ⊙ Γ) V + scale · (Q ⊙ e^b) h_0          (Schlag et al. 2021)
    h_T = e^{b_T} h_0 + (K ⊙ e^{b_T − b})ᵀ V

with b the cumulative log decay and Γ[t, s] = exp(b_t − b_s) (``_chunk.py``). It
equals :func:`~fastweights.ops.recurrent_linear_attn` by associativity of the
matrix product; costs O(T²) time and memory.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._chunk import block_terms, with_initial_state
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..step import linear_attn_step


def linear_attn_parallel(q, k, v, beta, g, h0, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    """Whole-sequence masked product on head-first tensors; returns ``(o, h_T)``."""
    q_decayed, k_decayed, scores, seq_decay, _ = block_terms(q, k, g, scale)
    return with_initial_state(scores @ v, k_decayed.transpose(-1, -2) @ v, h0, q_decayed, seq_decay, scale)


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_LINEAR_ATTN = OpSpec("parallel_linear_attn", Rule.SUM, Form.PARALLEL, torch=linear_attn_parallel, step=linear_attn_step)


#: The public function moved to api.py (its old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.linear_attn.api", "parallel_linear_attn")
