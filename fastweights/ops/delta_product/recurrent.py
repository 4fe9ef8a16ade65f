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

from .._spec import Form, OpSpec, Rule
from .fla import delta_product_form


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


def delta_product_recurrence(q, k, v, beta, g, h0, scale, chunk_size=None, *, ks, vs, betas):
    """Token-by-token on head-first tensors (``ks [N, H, T, n_h, K]``, ...); returns ``(o, h_T)``."""
    n, nh, t_len, dk = q.shape
    h = h0 if h0 is not None else q.new_zeros(n, nh, dk, vs.shape[-1])
    outputs = []
    for t in range(t_len):
        o_t, h = gated_delta_product_step(q[:, :, t], ks[:, :, t], vs[:, :, t], betas[:, :, t], g[:, :, t], h, scale)
        outputs.append(o_t)
    return torch.stack(outputs, dim=2), h


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_GATED_DELTA_PRODUCT = OpSpec("recurrent_gated_delta_product", Rule.DELTA, Form.RECURRENT,
                                       torch=delta_product_recurrence, step=gated_delta_product_step)

recurrent_gated_delta_product = delta_product_form(RECURRENT_GATED_DELTA_PRODUCT, doc="""
    (Gated) DeltaProduct, one token (n_h Householder steps) at a time: the reference form.

    Args (fla 0.6.0's ``chunk_gated_delta_product`` order):
        q: ``[B, T, H, K]``; k: ``[B, T·n_h, H, K]``; v: ``[B, T·n_h, H, V]`` (token t's
            sub-step j at t·n_h + j).
        g: ``[B, T, H]`` log decay per token (<= 0), ``None``: no decay (DeltaProduct).
        beta: ``[B, T·n_h, H]`` in [0, 1] ([0, 2] with ``allow_neg_eigval``); ``None``: 1.
        num_householder: n_h, Householder steps per token.
        scale: ``None`` means ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32 (fp64 for fp64 inputs).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalize q and every k (fla's formula).
        cu_seqlens, cu_seqlens_cpu, max_seqlen: N packed sequences (B = 1), token offsets.
        allow_neg_eigval: β may lie in [0, 2].
        chunk_size: unused here (every form takes the same arguments).
        qk_norm: ``None``, ``"l2"`` or ``"sum"``.

    Returns:
        ``(o [B, T, H, V] in the input dtype, final_state [N, H, K, V] or None)``.

    Example::

        >>> B, T, H, K, V, n = 2, 100, 4, 32, 48, 2
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T * n, H, K), torch.randn(B, T * n, H, V)
        >>> g, beta = torch.nn.functional.logsigmoid(torch.randn(B, T, H)), 2 * torch.rand(B, T * n, H)
        >>> o, h = recurrent_gated_delta_product(q, k, v, g, beta, n, use_qk_l2norm_in_kernel=True,
        ...                                      allow_neg_eigval=True, output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([2, 100, 4, 48]), torch.Size([2, 4, 32, 48]))
""")
