"""Kimi Delta Attention (KDA), recurrent form: the float64 ground truth of every KDA op.

The gated delta rule with one decay per key channel (Kimi Team 2025, "Kimi Linear",
arXiv:2510.26692). Per head and token, state h stored K×V (the transpose of the papers'
W = Σ v kᵀ, read as hᵀq), α_t = exp(gk_t) ∈ (0, 1]^K::

    h'  = diag(α_t) h_{t−1}                                 decay each key channel
    h_t = h' + β_t k_t (v_t − h'ᵀ k_t)ᵀ                      the delta write, on the decayed state
        = (I − β_t k_t k_tᵀ) diag(α_t) h_{t−1} + β_t k_t v_tᵀ
    o_t = scale · h_tᵀ q_t                                  read after the write

The decay comes first and the correction is computed against the decayed state, as in
fla's ``naive_recurrent_kda`` and transformers' ``recurrent_kimi_delta_attention``. With
a per-key-channel decay the order matters: ``diag(α)(I − β k kᵀ)`` is a different rule,
because diag(α) and k kᵀ do not commute (for a scalar α, Gated DeltaNet, they do).

With ``gv`` (fla's per-value-channel decay) the decay is ``diag(α_t) h diag(exp(gv_t))``
before the write; only this form has it (README.md in this folder says why).
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..step import kda_step, kda_update, scan_tokens


def kda_recurrence(q, k, v, beta, gk, h0, scale, gv=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA on head-first tensors ``[N, H, T, D]`` (``gk [N, H, T, K]``); returns ``(o, h_T)``."""
    n, nh, t_len, dk = k.shape
    h = h0 if h0 is not None else k.new_zeros(n, nh, dk, v.shape[-1])
    if gv is None:
        return scan_tokens(kda_update, h, scale, q, k, v, beta, gk)
    return scan_tokens(lambda q, k, v, beta, gk, gv, h, scale: kda_update(q, k, v, beta, gk, h, scale, gv), h, scale,
                       q, k, v, beta, gk, gv)


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_KDA = OpSpec("recurrent_kda", Rule.DELTA, Form.RECURRENT, torch=kda_recurrence, step=kda_step)


#: The public functions moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.kda.api", "recurrent_kda", "fused_recurrent_kda", "recurrent_kda_as")
