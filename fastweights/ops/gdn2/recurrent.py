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

from typing import Optional, Tuple

import torch

from .._spec import Form, OpSpec, Rule
from .fla import gdn2_form


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


def gdn2_recurrence(q, k, v, beta, g, h0, scale, chunk_size=None, *, b, w) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token GDN-2 on head-first tensors ``[N, H, T, ·]``; returns ``(o, h_T)`` (``beta`` unused)."""
    n, nh, t_len, dk = k.shape
    h = h0 if h0 is not None else k.new_zeros(n, nh, dk, v.shape[-1])
    outputs = []
    for t in range(t_len):
        o_t, h = gdn2_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], b[:, :, t], w[:, :, t], h, scale)
        outputs.append(o_t)
    return torch.stack(outputs, dim=2), h


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_GDN2 = OpSpec("recurrent_gdn2", Rule.DELTA, Form.RECURRENT, torch=gdn2_recurrence, step=gdn2_step)

recurrent_gdn2 = gdn2_form(RECURRENT_GDN2, doc="""
    Gated DeltaNet-2, one token at a time: the reference form (module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (HV a multiple of H: grouped value heads).
        g: ``[B, T, HV, K]`` per-key-channel log decay (``<= 0``); ``None``: no decay.
        b: ``[B, T, HV, K]`` erase gate in [0, 2]; w: ``[B, T, HV, V]`` write gate in [0, 1].
        scale: ``None`` means ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` fp32 (fp64 for fp64 inputs).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: ``qk_norm="l2"`` (fla's spelling).
        use_gate_in_kernel, A_log, dt_bias, lower_bound: ``g`` is the raw gate input, as in
            :func:`~fastweights.ops.chunk_kda` (:func:`~fastweights.ops.kda_gate`).
        cu_seqlens, cu_seqlens_cpu, max_seqlen: N packed sequences (B = 1).
        chunk_size: unused here (every form takes the same arguments).
        qk_norm: ``None``, ``"l2"`` or ``"sum"``.
        **kwargs: fla's hints (``safe_gate``, ``disable_recompute``, ignored), ``state_v_first``;
            see :mod:`fastweights.ops.gdn2.fla`.

    Returns:
        ``(o [B, T, HV, V] in the input dtype, final_state [N, HV, K, V] or None)``.

    Example::

        >>> B, T, H, K, V = 2, 100, 4, 32, 48
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K))
        >>> b, w = 2 * torch.rand(B, T, H, K), torch.rand(B, T, H, V)
        >>> o, h = recurrent_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True, output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([2, 100, 4, 48]), torch.Size([2, 4, 32, 48]))
""")


def fused_recurrent_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    w: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    lower_bound: Optional[float] = None,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    **kwargs,
):
    """Alias of :func:`~fastweights.ops.recurrent_gdn2` with fla 0.6.0's signature and positional
    order ``(q, k, v, g, b, w, A_log, dt_bias, scale, ...)``; ``state_v_first`` as in fla.
    fla's serving arguments (``ssm_state_indices``, ``num_accepted_tokens``, ``inplace_final_state``,
    ``out``) are refused as unknown keywords."""
    return recurrent_gdn2(
        q, k, v, g, b, w, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
        **kwargs,
    )
