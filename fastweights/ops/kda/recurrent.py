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

import dataclasses
import functools
from typing import Optional, Tuple

import torch

from .._fla_compat import accepts_state_v_first
from .._spec import Form, OpSpec, Rule
from ..step import kda_step, kda_update
from .fla import kda_form




def kda_recurrence(q, k, v, beta, gk, h0, scale, chunk_size=None, gv=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA on head-first tensors ``[N, H, T, D]`` (``gk [N, H, T, K]``); returns ``(o, h_T)``."""
    n, nh, t_len, dk = k.shape
    h = h0 if h0 is not None else k.new_zeros(n, nh, dk, v.shape[-1])
    outputs = []
    for t in range(t_len):
        o_t, h = kda_update(q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], gk[:, :, t], h, scale,
                          None if gv is None else gv[:, :, t])
        outputs.append(o_t)
    return torch.stack(outputs, dim=2), h


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_KDA = OpSpec("recurrent_kda", Rule.DELTA, Form.RECURRENT, torch=kda_recurrence, step=kda_step)

recurrent_kda = kda_form(RECURRENT_KDA, gv_supported=True, doc="""
    Kimi Delta Attention, one token at a time: the reference form (module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (HV a multiple of H: grouped value heads).
        g: ``[B, T, HV, K]``, the per-key-channel log decay, α_t = exp(g_t) ∈ (0, 1]
            (``g <= 0``; fla's name). ``gk=`` is the same argument under
            ``fused_recurrent_gated_delta_rule``'s name; give one. ``None``: no decay.
        beta: ``[B, T, HV]`` write strengths in [0, 1] ([0, 2] with ``allow_neg_eigval``);
            ``None``: β = 1.
        scale: ``None`` means ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` fp32 (fp64 for fp64 inputs).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: ``qk_norm="l2"`` (fla's spelling).
        use_gate_in_kernel, A_log, dt_bias, lower_bound: ``g`` is the raw gate input and the
            decay is ``−exp(A_log)·softplus(g + dt_bias)`` (``A_log [HV]``, ``dt_bias [HV·K]``), or
            ``lower_bound·sigmoid(exp(A_log)·(g + dt_bias))`` with a ``lower_bound`` (fla's formulas).
        use_beta_sigmoid_in_kernel, allow_neg_eigval: β = sigmoid(beta) (×2 with allow_neg_eigval).
        cu_seqlens, cu_seqlens_cpu, max_seqlen: N packed sequences (B = 1), as in
            :func:`~fastweights.ops.recurrent_delta_rule`.
        gv: ``[B, T, HV, V]`` per-value-channel log decay (h ← diag(α) h diag(exp(gv)) before
            the write); only this form (and its aliases) accepts it.
        chunk_size: unused here (every form takes the same arguments).
        qk_norm: ``None``, ``"l2"`` or ``"sum"``.
        **kwargs: fla's hints (``safe_gate``, ``disable_recompute``, ``use_graph``, ...,
            ignored), ``state_v_first``; see :mod:`fastweights.ops.kda.fla`.

    Returns:
        ``(o [B, T, HV, V] in the input dtype, final_state [N, HV, K, V] or None)``.

    Example::

        >>> B, T, H, K, V = 2, 100, 4, 32, 48
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K))   # per-channel log decays
        >>> o, h = recurrent_kda(q, k, v, g, torch.rand(B, T, H), use_qk_l2norm_in_kernel=True,
        ...                      output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([2, 100, 4, 48]), torch.Size([2, 4, 32, 48]))
""")


@accepts_state_v_first
def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[torch.LongTensor] = None,
    **kwargs,
):
    """Alias of :func:`~fastweights.ops.recurrent_kda` with fla 0.6.0's signature and positional
    order ``(q, k, v, g, beta, A_log, dt_bias, scale, ...)``; ``state_v_first`` as in fla."""
    return recurrent_kda_as("fused_recurrent_kda")(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, **kwargs,
    )


@functools.lru_cache(maxsize=None)
def recurrent_kda_as(alias: str):
    """:func:`recurrent_kda` under an alias's name (``fused_recurrent_kda``, ``fused_recurrent_gated_delta_rule``
    with ``gk``/``gv``), so that its errors name the function the caller called."""
    return kda_form(dataclasses.replace(RECURRENT_KDA, name=alias), gv_supported=True, doc=recurrent_kda.__doc__)
