"""The delta rule, parallel form: the whole sequence as one T×T mixing matrix.

With the UT transform over the whole sequence (``wy.py``), ``T = (I + A)⁻¹ diag(β)``:

    U' = T (V − (K ⊙ e^b) h_0)                      pseudo-values
    O  = scale · (Q ⊙ e^b) h_0 + M (V − (K ⊙ e^b) h_0),   M = scale · tril(Q Kᵀ ⊙ Γ) T
    h_T = e^{b_T} h_0 + (K ⊙ e^{b_T − b})ᵀ U'

M is the delta rule's effective causal attention matrix (lower triangular, T×T):
row t says how much each value v_s contributes to o_t once every later write has
corrected it. Cost O(T²K + T³) per head; the chunk form is the fast path.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._chunk import block_terms
from .._fla_compat import fla_inputs
from .._dispatch import run
from .._spec import Form, OpSpec, Rule
from ..feature_maps import FeatureMapLike
from .wy import ut_transform
from ..step import delta_rule_step


def delta_rule_parallel(q, k, v, beta, g, h0, scale, chunk_size=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Whole-sequence UT transform on head-first tensors; returns ``(o, h_T)``."""
    q_decayed, k_decayed, scores, seq_decay, b = block_terms(q, k, g, scale)
    w, u = ut_transform(k, v, beta, b)
    if h0 is not None:
        u = u - w @ h0
    o = scores @ u
    h = k_decayed.transpose(-1, -2) @ u
    if h0 is not None:
        o = o + scale * (q_decayed @ h0)
        h = h + (h0 if seq_decay is None else h0 * seq_decay[..., None, None])
    return o, h


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_DELTA_RULE = OpSpec("parallel_delta_rule", Rule.DELTA, Form.PARALLEL, torch=delta_rule_parallel, step=delta_rule_step)


def parallel_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    max_seqlen: Optional[int] = None,
    **extra,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The delta rule as one T×T triangular solve and mixing matrix.

    Equivalent to :func:`~fastweights.ops.recurrent_delta_rule` (same arguments,
    same returns; ``chunk_size`` is unused). O(T²) memory: for short sequences
    and for reading the maths; :func:`chunk_delta_rule` is the fast path.
    """
    q, k, beta, _, initial_state, cu_seqlens = fla_inputs(  # fla's options -> plain inputs
        "parallel_delta_rule", q, k, v, beta, None, initial_state, cu_seqlens, gated=False, cu_seqlens_cpu=cu_seqlens_cpu, kwargs=extra,
    )
    return run(PARALLEL_DELTA_RULE, q, k, v, beta=beta, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen,
        chunk_size=chunk_size, feature_map=feature_map,
        qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm, requires_beta=True,
        allow_neg_eigval=allow_neg_eigval,
    )
