"""The gated delta rule's public ops: each maps its arguments and hands its :class:`~.._spec.OpSpec` down.

The forms' specs are in ``recurrent.py``, ``parallel.py``, ``chunk.py`` (the solvers are the plain
rule's, with g given); a call descends from here through fla's options
(:func:`~.._fla_compat.run_fla`) to the one dispatcher and the form's solver, each module once
(docs/design.md, "The path of a call").
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._fla_compat import run_fla
from .._forms import accepts_state_v_first
from ..feature_maps import FeatureMapLike
from .chunk import CHUNK_GATED_DELTA_RULE
from .parallel import PARALLEL_GATED_DELTA_RULE
from .recurrent import RECURRENT_GATED_DELTA_RULE

__all__ = ["recurrent_gated_delta_rule", "parallel_gated_delta_rule", "chunk_gated_delta_rule"]


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
        scale, initial_state, output_final_state, cu_seqlens, qk_norm,
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
    return run_fla(RECURRENT_GATED_DELTA_RULE, q, k, v, beta, g, initial_state, cu_seqlens, gated=True, qk_norm=qk_norm,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                   cu_seqlens_cpu=cu_seqlens_cpu, extra=extra, scale=scale, output_final_state=output_final_state,
                   max_seqlen=max_seqlen, feature_map=feature_map)


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
    arguments and returns.
    """
    return run_fla(PARALLEL_GATED_DELTA_RULE, q, k, v, beta, g, initial_state, cu_seqlens, gated=True, qk_norm=qk_norm,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                   cu_seqlens_cpu=cu_seqlens_cpu, extra=extra, scale=scale, output_final_state=output_final_state,
                   max_seqlen=max_seqlen, feature_map=feature_map)


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
    return run_fla(CHUNK_GATED_DELTA_RULE, q, k, v, beta, g, initial_state, cu_seqlens, gated=True, qk_norm=qk_norm,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                   cu_seqlens_cpu=cu_seqlens_cpu, extra=extra, scale=scale, output_final_state=output_final_state,
                   max_seqlen=max_seqlen, feature_map=feature_map,
                   chunk_size=chunk_size, backend=backend, cp_group=cp_group,
                   return_intermediate_states=return_intermediate_states, state_block_size=state_block_size,
                   state_indices=state_indices, has_initial_state=has_initial_state)
