"""The diagonal-plus-low-rank (DPLR) delta rule, recurrent form: the float64 ground truth.

The transition of RWKV-7 "Goose" (Peng et al. 2025, arXiv:2503.14456) in fla 0.6.0's
generalized form: per head and token, state h (K×V, read as hᵀq), with a per-key-channel
log decay gk and a low-rank pair a, b ∈ ℝ^K::

    h_t = (diag(e^{gk_t}) + b_t a_tᵀ) h_{t−1} + k_t v_tᵀ
        = diag(e^{gk_t}) h_{t−1} + b_t (a_tᵀ h_{t−1}) + k_t v_tᵀ      (a reads the state before the decay)
    o_t = scale · h_tᵀ q_t

as fla's ``dplr_recurrence``. KDA is the case a = −β e^{gk} ⊙ k, b = k, and v → β v.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._moved import moved_names
from ..step import scan_tokens
from .._spec import Form, OpSpec, Rule


def dplr_step(q, k, v, a, b, gk, h, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token: ``q, k, a, b, gk [..., K]``, ``v [..., V]``, state ``h [..., K, V]`` -> ``(o [..., V], h')``."""
    shape, (dk, dv) = h.shape, h.shape[-2:]
    h = h.reshape(-1, dk, dv)
    read = torch.bmm(a.reshape(-1, 1, dk), h)  # aᵀ h, before the decay
    h = h * torch.exp(gk).reshape(-1, dk, 1)
    h = h + b.reshape(-1, dk, 1) * read + k.reshape(-1, dk, 1) * v.reshape(-1, 1, dv)
    o = torch.bmm(q.reshape(-1, 1, dk), h).mul_(scale)
    return o.view(shape[:-2] + (dv,)), h.view(shape)


def dplr_recurrence(q, k, v, beta, gk, h0, scale, *, a, b) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token on head-first tensors ``[N, H, T, ·]``; returns ``(o, h_T)``."""
    n, nh, t_len, dk = q.shape
    h = h0 if h0 is not None else q.new_zeros(n, nh, dk, v.shape[-1])
    return scan_tokens(dplr_step, h, scale, q, k, v, a, b, gk)


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_DPLR_DELTA_RULE = OpSpec("recurrent_dplr_delta_rule", Rule.DELTA, Form.RECURRENT, torch=dplr_recurrence, step=dplr_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.dplr.api", "recurrent_dplr_delta_rule")
