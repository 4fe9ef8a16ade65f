"""The delta rule, parallel form: the whole sequence as one T×T mixing matrix.

With the UT transform over the whole sequence (``wy.py``), ``T = (I + A)⁻¹ diag(β)``:

    U' = T (V − (K ⊙ e^b) h_0)                      pseudo-values
    O  = scale · (Q ⊙ e^b) h_0 + M (V − (K ⊙ e^b) h_0),   M = scale · tril(Q Kᵀ ⊙ Γ) T
    h_T = e^{b_T} h_0 + (K ⊙ e^{b_T − b})ᵀ U'

M is the delta rule's effective causal attention matrix (lower triangular, T×T):
row t says how much each value v_s contributes to o_t once every later write has
corrected it. Cost O(T²K + T³) per head; the chunk form is the fast path.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._chunk import block_terms, with_initial_state
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from .wy import ut_transform
from ..step import delta_rule_step


def delta_rule_parallel(q, k, v, beta, g, h0, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    """Whole-sequence UT transform on head-first tensors; returns ``(o, h_T)``."""
    q_decayed, k_decayed, scores, seq_decay, b = block_terms(q, k, g, scale)
    w, u = ut_transform(k, v, beta, b)
    if h0 is not None:
        u = u - w @ h0
    return with_initial_state(scores @ u, k_decayed.transpose(-1, -2) @ u, h0, q_decayed, seq_decay, scale)


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_DELTA_RULE = OpSpec("parallel_delta_rule", Rule.DELTA, Form.PARALLEL, torch=delta_rule_parallel, step=delta_rule_step)


#: The public function moved to api.py (its old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.delta_rule.api", "parallel_delta_rule")
