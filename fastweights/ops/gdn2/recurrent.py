"""Gated DeltaNet-2 (GDN-2), recurrent form: the float64 ground truth of every GDN-2 op.

GDN-2 splits KDA's write strength β in two gates: an erase gate ``b`` per key channel
and a write gate ``w`` per value channel. Per head and token, state h stored K×V (read
as hᵀq), α_t = exp(g_t) ∈ (0, 1]^K::

    h'  = diag(α_t) h_{t−1}                          decay each key channel
    u_t = w_t ⊙ v_t − h'ᵀ (b_t ⊙ k_t)                 the gated write minus the gated read
    h_t = h' + k_t u_tᵀ
        = (I − k_t (b_t ⊙ k_t)ᵀ) diag(α_t) h_{t−1} + k_t (w_t ⊙ v_t)ᵀ
    o_t = scale · h_tᵀ q_t

as in fla 0.6.0's ``naive_recurrent_gdn2``. ``b = w = β`` (every channel) is Kimi Delta
Attention (Kimi Team 2025, arXiv:2510.26692); with unit keys and b ∈ [0, 2] the
transition I − k (b ⊙ k)ᵀ has its eigenvalues in [−1, 1].
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._moved import moved_names
from ..step import scan_tokens
from .._spec import Form, OpSpec, Rule


def gdn2_step(q, k, v, g, b, w, h, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of GDN-2: ``q, k, g, b [..., K]``, ``v, w [..., V]``, state ``h [..., K, V]``
    -> ``(o [..., V], h')``. :func:`gdn2_recurrence` runs it token by token; a layer's decoding
    step calls it on checked compute-dtype tensors."""
    shape, (dk, dv) = h.shape, h.shape[-2:]
    h = h.reshape(-1, dk, dv) * torch.exp(g).reshape(-1, dk, 1)  # diag(α) h
    erase = torch.bmm((b * k).reshape(-1, 1, dk), h)  # (b ⊙ k)ᵀ h', [.., 1, V]
    u = (w * v).reshape(-1, 1, dv) - erase
    h = torch.addcmul(h, k.reshape(-1, dk, 1), u)
    o = torch.bmm(q.reshape(-1, 1, dk), h).mul_(scale)
    return o.view(shape[:-2] + (dv,)), h.view(shape)


def gdn2_recurrence(q, k, v, beta, g, h0, scale, *, b, w) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token GDN-2 on head-first tensors ``[N, H, T, ·]``; returns ``(o, h_T)`` (``beta`` unused)."""
    n, nh, t_len, dk = k.shape
    h = h0 if h0 is not None else k.new_zeros(n, nh, dk, v.shape[-1])
    return scan_tokens(gdn2_step, h, scale, q, k, v, g, b, w)


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_GDN2 = OpSpec("recurrent_gdn2", Rule.DELTA, Form.RECURRENT, torch=gdn2_recurrence, step=gdn2_step)


#: The public functions moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.gdn2.api", "recurrent_gdn2", "fused_recurrent_gdn2")
