"""The gated delta rule, parallel form: one T×T decay-weighted UT transform.

The solver is shared with the plain rule (``delta_rule/parallel.py``); with
``g`` given, A and the causal scores carry Γ[r, i] = exp(b_r − b_i), and the
reads and writes of h_0 carry e^{b_r} and e^{b_T − b_i} (``delta_rule/wy.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._fla_compat import accepts_state_v_first, fla_inputs
from .._dispatch import run
from .._spec import Form, OpSpec, Rule
from ..delta_rule.parallel import delta_rule_parallel
from ..feature_maps import FeatureMapLike
from ..step import gated_delta_rule_step


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_GATED_DELTA_RULE = OpSpec("parallel_gated_delta_rule", Rule.DELTA, Form.PARALLEL, torch=delta_rule_parallel, step=gated_delta_rule_step)


@accepts_state_v_first
def parallel_gated_delta_rule(
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
    """The gated delta rule as one T×T triangular solve (O(T²) memory).

    Equivalent to :func:`~fastweights.ops.recurrent_gated_delta_rule`; same
    arguments and returns (``chunk_size`` is unused).
    """
    q, k, beta, g, initial_state, cu_seqlens = fla_inputs(  # fla's options -> plain inputs
        "parallel_gated_delta_rule", q, k, v, beta, g, initial_state, cu_seqlens, gated=True,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, cu_seqlens_cpu=cu_seqlens_cpu, kwargs=extra,
    )
    return run(PARALLEL_GATED_DELTA_RULE, q, k, v, beta=beta, g=g, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen,
        chunk_size=chunk_size, feature_map=feature_map,
        qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm, requires_beta=True, requires_g=True,
        allow_neg_eigval=allow_neg_eigval,
    )
