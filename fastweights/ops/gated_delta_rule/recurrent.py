"""The gated delta rule, recurrent form (reference).

    h_t = α_t (I − β_t k_t k_tᵀ) h_{t−1} + β_t k_t v_tᵀ,   α_t = exp(g_t) ≤ 1
    o_t = scale · h_tᵀ q_t

The decay fades every association a little (the "fading-memory solver
choice"), the delta step corrects only along k_t. The solver is shared with the
plain rule: :func:`fastweights.ops.delta_rule.recurrent.delta_rule_recurrence`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._fla_compat import accepts_state_v_first, fla_inputs
from .._dispatch import run
from .._spec import Form, OpSpec, Rule
from ..delta_rule.recurrent import delta_rule_recurrence
from ..feature_maps import FeatureMapLike
from ..step import gated_delta_rule_step


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_GATED_DELTA_RULE = OpSpec("recurrent_gated_delta_rule", Rule.DELTA, Form.RECURRENT,
                                    torch=delta_rule_recurrence, low_products=True, step=gated_delta_rule_step)


@accepts_state_v_first
def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    chunk_size: Optional[int] = None,
    qk_norm: Optional[str] = None,
    feature_map: FeatureMapLike = None,
    use_qk_l2norm_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    *,
    use_beta_sigmoid_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    max_seqlen: Optional[int] = None,
    **extra,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule (Gated DeltaNet), one token at a time: the reference form.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        g: ``[B, T, H]`` log decays, α_t = exp(g_t) (g ≤ 0 keeps α ≤ 1); ``None``: no decay.
        beta: ``[B, T, H]`` write strengths in (0, 1); ``None``: β = 1.
        scale, initial_state, output_final_state, cu_seqlens, chunk_size, qk_norm,
        feature_map, use_qk_l2norm_in_kernel, cu_seqlens_cpu, max_seqlen: as in
        :func:`~fastweights.ops.recurrent_delta_rule`.
        use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel, A_log, dt_bias,
        cu_seqlens_cpu, **extra: flash-linear-attention's options, with fla's meaning
            (β = sigmoid(beta), ×2 with ``allow_neg_eigval``; g = −exp(A_log)·softplus(g + dt_bias));
            ``v`` may have HV = r·H heads (grouped value heads; the state is then
            ``[N, HV, K, V]``). :mod:`fastweights.ops._fla_compat` lists every fla argument
            we accept, ignore or refuse.

    Returns:
        ``(o [B, T, H, V], final_state [N, H, K, V] or None)``.

    Note the argument order ``(q, k, v, g, beta)``, as in flash-linear-attention.
    """
    q, k, beta, g, initial_state, cu_seqlens = fla_inputs(  # fla's options -> plain inputs
        "recurrent_gated_delta_rule", q, k, v, beta, g, initial_state, cu_seqlens, gated=True,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, cu_seqlens_cpu=cu_seqlens_cpu, kwargs=extra,
    )
    return run(RECURRENT_GATED_DELTA_RULE, q, k, v, beta=beta, g=g, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen,
        chunk_size=chunk_size, feature_map=feature_map,
        qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm, requires_beta=True, requires_g=True,
        allow_neg_eigval=allow_neg_eigval,
    )
