"""(Gated) DeltaProduct, recurrent form: the float64 ground truth of every DeltaProduct op.

DeltaProduct (Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via
Householder Products", arXiv:2502.10297) writes each token with n_h generalized Householder
steps, each with its own key, value and strength; the gated form decays the state once per
token, before its first step. Per head and token t, state h (K×V, read as hᵀq)::

    h ← exp(g_t) h
    for j = 1 … n_h:   h ← (I − β_{t,j} k_{t,j} k_{t,j}ᵀ) h + β_{t,j} k_{t,j} v_{t,j}ᵀ
    o_t = scale · hᵀ q_t                                           read after the last step

so the token's transition is a product of n_h Householder-like factors (eigenvalues in
[−1, 1] for unit keys and β ∈ [0, 2]: ``allow_neg_eigval``). n_h = 1 is the gated delta rule,
as in fla 0.6.0's ``naive_recurrent_gated_delta_product``.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._moved import moved_names
from ..step import scan_tokens
from .._spec import Form, OpSpec, Rule


def gated_delta_product_step(q, ks, vs, betas, g, h, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token: ``q [..., K]``, ``ks [..., n_h, K]``, ``vs [..., n_h, V]``, ``betas [..., n_h]``,
    ``g [...]`` (log decay), state ``h [..., K, V]`` -> ``(o [..., V], h')``."""
    shape, (dk, dv) = h.shape, h.shape[-2:]
    n_h = ks.shape[-2]
    h = h.reshape(-1, dk, dv) * torch.exp(g).reshape(-1, 1, 1)
    ks, vs, betas = ks.reshape(-1, n_h, dk), vs.reshape(-1, n_h, dv), betas.reshape(-1, n_h)
    for j in range(n_h):
        k = ks[:, j:j + 1]  # [.., 1, K]
        u = (vs[:, j:j + 1] - torch.bmm(k, h)).mul_(betas[:, j, None, None])  # β (v − hᵀk)
        h = torch.addcmul(h, k.transpose(1, 2), u)
    o = torch.bmm(q.reshape(-1, 1, dk), h).mul_(scale)
    return o.view(shape[:-2] + (dv,)), h.view(shape)


def delta_product_recurrence(q, k, v, beta, g, h0, scale, *, ks, vs, betas):
    """Token-by-token on head-first tensors (``ks [N, H, T, n_h, K]``, ...); returns ``(o, h_T)``."""
    n, nh, t_len, dk = q.shape
    h = h0 if h0 is not None else q.new_zeros(n, nh, dk, vs.shape[-1])
    return scan_tokens(gated_delta_product_step, h, scale, q, ks, vs, betas, g)


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_GATED_DELTA_PRODUCT = OpSpec("recurrent_gated_delta_product", Rule.DELTA, Form.RECURRENT,
                                       torch=delta_product_recurrence, step=gated_delta_product_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.delta_product.api", "recurrent_gated_delta_product")
