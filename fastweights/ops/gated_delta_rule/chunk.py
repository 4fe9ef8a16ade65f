"""The gated delta rule, chunk form: the WY/UT algorithm with cumulative decays.

Inside a chunk, with b_r = g_1 + ... + g_r and Γ[r, i] = exp(b_r − b_i):

    A  = tril(diag(β) (K Kᵀ ⊙ Γ), −1),   T = (I + A)⁻¹ diag(β)
    W  = T (K ⊙ e^b),  U = T V,   U' = U − W h
    O  = scale · (Q ⊙ e^b) h + scale · tril(Q Kᵀ ⊙ Γ) U'
    h ← e^{b_C} h + (K ⊙ e^{b_C − b})ᵀ U'

``delta_rule/wy.py`` derives these lines from the recurrence; the solver is the
plain rule's (``delta_rule/chunk.py``) with g given.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._dispatch import run
from .._fla_compat import accepts_state_v_first, fla_inputs
from .._spec import Form, OpSpec, Rule
from ..delta_rule.chunk import CHUNK_DELTA_RULE
from ..feature_maps import FeatureMapLike
from ..step import gated_delta_rule_step

#: The gated delta rule's chunk op: the plain rule's solvers and kernels, with g given.
CHUNK_GATED_DELTA_RULE = OpSpec(
    "chunk_gated_delta_rule", Rule.DELTA, Form.CHUNK, torch=CHUNK_DELTA_RULE.torch, cpu=CHUNK_DELTA_RULE.cpu,
    triton=True, low_products=True, reads_bf16_inputs=True, single_backward=True, fused_finite_check=True,
    step=gated_delta_rule_step,
)


@accepts_state_v_first
def chunk_gated_delta_rule(
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
    backend: str = "auto",
    allow_neg_eigval: bool = False,
    *,
    use_beta_sigmoid_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    max_seqlen: Optional[int] = None,
    cp_group=None,
    return_intermediate_states: bool = False,
    state_block_size: Optional[int] = None,
    state_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    **extra,
) -> Tuple[Optional[torch.Tensor], ...]:
    """The gated delta rule, chunkwise parallel: the fast path for training.

    Equivalent to :func:`~fastweights.ops.recurrent_gated_delta_rule` (same
    arguments and returns), called as ``(q, k, v, g, beta, ...)`` like
    flash-linear-attention. ``chunk_size``, ``backend`` and ``cp_group`` (context
    parallelism) as in :func:`chunk_delta_rule`, and so are the serving options
    ``return_intermediate_states``, ``state_block_size``, ``state_indices`` and ``has_initial_state``.
    """
    q, k, beta, g, initial_state, cu_seqlens = fla_inputs(  # fla's options -> plain inputs
        "chunk_gated_delta_rule", q, k, v, beta, g, initial_state, cu_seqlens, gated=True,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, cu_seqlens_cpu=cu_seqlens_cpu, kwargs=extra,
    )
    kwargs = dict(
        beta=beta, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size, feature_map=feature_map,
        qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm, requires_g=True,
        allow_neg_eigval=allow_neg_eigval,
    )
    return run(CHUNK_GATED_DELTA_RULE, q, k, v, backend=backend, requires_beta=True, cu_seqlens_cpu=cu_seqlens_cpu,
               max_seqlen=max_seqlen, cp_group=cp_group, return_intermediate_states=return_intermediate_states,
               state_block_size=state_block_size, state_indices=state_indices, has_initial_state=has_initial_state,
               **kwargs)
