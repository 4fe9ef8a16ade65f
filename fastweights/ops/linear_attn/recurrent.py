"""Linear attention (the sum rule), recurrent form: the float64 ground truth.

Per head, with the state h stored K×V (the transpose of the papers' S = Σ v kᵀ,
which is V×K; we read hᵀq where the papers read S q):

    h_t = α_t h_{t−1} + φ(k_t) v_tᵀ           (Schlag et al. 2021)
    o_t = scale · h_tᵀ φ(q_t)                 (read after the write)

and, with ``normalize=True``, the normalizer of Katharopoulos et al. 2020,
``z_t = α_t z_{t−1} + φ(k_t)``, ``o_t ← o_t / (scale · φ(q_t)ᵀ z_t + eps)``.
α_t = exp(g_t) is an optional decay (``g=None`` means α = 1).
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..step import linear_attn_step, scan_tokens, sum_update


def linear_attn_recurrence(q, k, v, beta, g, h0, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token sum rule on head-first tensors ``[N, H, T, D]``; returns ``(o, h_T)``."""
    n, nh, t_len, dk = k.shape
    h = h0 if h0 is not None else k.new_zeros(n, nh, dk, v.shape[-1])
    return scan_tokens(sum_update, h, scale, q, k, v, g)


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_LINEAR_ATTN = OpSpec("recurrent_linear_attn", Rule.SUM, Form.RECURRENT, torch=linear_attn_recurrence, step=linear_attn_step)


#: The public function moved to api.py (its old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.linear_attn.api", "recurrent_linear_attn")
