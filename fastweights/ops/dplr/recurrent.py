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

from .._spec import Form, OpSpec, Rule
from .fla import dplr_form


def dplr_step(q, k, v, a, b, gk, h, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token: ``q, k, a, b, gk [..., K]``, ``v [..., V]``, state ``h [..., K, V]`` -> ``(o [..., V], h')``."""
    shape, (dk, dv) = h.shape, h.shape[-2:]
    h = h.reshape(-1, dk, dv)
    read = torch.bmm(a.reshape(-1, 1, dk), h)  # aᵀ h, before the decay
    h = h * torch.exp(gk).reshape(-1, dk, 1)
    h = h + b.reshape(-1, dk, 1) * read + k.reshape(-1, dk, 1) * v.reshape(-1, 1, dv)
    o = torch.bmm(q.reshape(-1, 1, dk), h).mul_(scale)
    return o.view(shape[:-2] + (dv,)), h.view(shape)


def dplr_recurrence(q, k, v, beta, gk, h0, scale, chunk_size=None, *, a, b) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token on head-first tensors ``[N, H, T, ·]``; returns ``(o, h_T)``."""
    n, nh, t_len, dk = q.shape
    h = h0 if h0 is not None else q.new_zeros(n, nh, dk, v.shape[-1])
    outputs = []
    for t in range(t_len):
        o_t, h = dplr_step(q[:, :, t], k[:, :, t], v[:, :, t], a[:, :, t], b[:, :, t], gk[:, :, t], h, scale)
        outputs.append(o_t)
    return torch.stack(outputs, dim=2), h


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_DPLR_DELTA_RULE = OpSpec("recurrent_dplr_delta_rule", Rule.DELTA, Form.RECURRENT, torch=dplr_recurrence, step=dplr_step)

recurrent_dplr_delta_rule = dplr_form(RECURRENT_DPLR_DELTA_RULE, needs_floor=False, doc="""
    The DPLR delta rule, one token at a time: the reference form (module docstring).

    Args (fla 0.6.0's ``chunk_dplr_delta_rule`` order):
        q, k, a, b: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        gk: ``[B, T, H, K]`` per-key-channel log decay (<= 0); ``None``: no decay.
        scale: ``None`` means ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32 (fp64 for fp64 inputs).
        output_final_state: also return the state after the last token.
        cu_seqlens, cu_seqlens_cpu, max_seqlen: N packed sequences (B = 1).
        chunk_size: unused here (every form takes the same arguments).
        safe_gate, disable_recompute, lower_bound: fla's kernel hints, ignored.

    Returns:
        ``(o [B, T, H, V] in the input dtype, final_state [N, H, K, V] or None)``.
""")
