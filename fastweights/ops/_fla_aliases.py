"""flash-linear-attention's names for our ops, with fla's exact signatures (positional order included).

``fused_recurrent_delta_rule`` and ``fused_recurrent_gated_delta_rule`` are the recurrent
forms (``fused_recurrent_gated_delta_rule`` with ``gk``/``gv``: ``recurrent_kda``),
``fused_recurrent_linear_attn`` the recurrent and ``fused_chunk_linear_attn`` the
chunk form of linear attention (with fla's defaults: ``normalize=True``, ε = 1e-10, the
normalized state as fla's tuple ``(S, z)``). ``_fla_compat.py`` lists every fla argument
the ops accept, ignore or refuse.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ._checks import state_dtype
from ._fla_compat import refuse_or_ignore
from .delta_rule import recurrent_delta_rule
from .gated_delta_rule import recurrent_gated_delta_rule
from .kda.api import recurrent_kda_as
from .linear_attn import chunk_linear_attn, recurrent_linear_attn

__all__ = ["fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule", "fused_recurrent_linear_attn",
           "fused_chunk_linear_attn"]


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Alias of :func:`~fastweights.ops.recurrent_delta_rule` with fla's signature
    (``beta=None`` means β = 1)."""
    return recurrent_delta_rule(
        q, k, v, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Alias of :func:`~fastweights.ops.recurrent_gated_delta_rule` with fla's signature.

    Note fla's positional order ``(q, k, v, g, gk, gv, beta, ...)``: pass ``beta`` by
    name. With ``gk`` [B, T, HV, K] and/or ``gv`` [B, T, HV, V] (per-channel log decays) it is
    :func:`~fastweights.ops.recurrent_kda` instead: h ← diag(exp(gk)) h diag(exp(gv)), then the
    delta write. ``g`` together with ``gk`` is refused (one key-side gate: pass
    ``gk + g[..., None]``); ``g`` with ``gv`` alone is the key-side gate broadcast over K.
    """
    if gk is not None or gv is not None:
        op = "fused_recurrent_gated_delta_rule"
        if g is not None and gk is not None:
            raise ValueError(
                f"{op}: got both `g` (per head) and `gk` (per key channel); pass one key-side log decay, "
                f"e.g. gk + g[..., None] [B, T, HV, K]"
            )
        if use_gate_in_kernel:
            raise ValueError(f"{op}: `use_gate_in_kernel=True` computes a per-head `g`; it cannot be combined "
                             f"with `gk`/`gv` (compute the gate first, or use chunk_kda's per-channel gate)")
        if g is not None:
            if not isinstance(g, torch.Tensor) or g.dim() != 3:
                raise ValueError(f"{op}: `g` must be a per-head log decay [B, T, HV], got {getattr(g, 'shape', g)!r}")
            gk = g.unsqueeze(-1).expand(*g.shape, q.shape[-1])
        return recurrent_kda_as(op)(  # its errors name this function, not recurrent_kda
            q, k, v, beta=beta, gk=gk, gv=gv, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, **kwargs,
        )
    return recurrent_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        gk=gk, gv=gv, state_v_first=state_v_first, **kwargs,
    )


FlaLinearState = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None]


def _linear_attn_alias(op: str, form, q, k, v, scale, initial_state: FlaLinearState, output_final_state,
                       normalize, cu_seqlens, reverse=False):
    """Run our linear attention with fla's state convention: with ``normalize`` the state
    is the tuple ``(S [N, H, K, V], z [N, 1, H, K])``; a bare S means z = 0."""
    refuse_or_ignore(op, {"reverse": reverse})
    h0 = initial_state
    if normalize and initial_state is not None:
        if isinstance(initial_state, (tuple, list)):
            if len(initial_state) != 2:
                raise ValueError(f"{op}: `initial_state` must be S or the tuple (S, z), got {len(initial_state)} items")
            s0, z0 = initial_state
        else:
            s0, z0 = initial_state, None
        if not isinstance(s0, torch.Tensor) or s0.dim() != 4:
            raise ValueError(f"{op}: `initial_state` S must be a [N, H, K, V] tensor, got {getattr(s0, 'shape', s0)!r}")
        z_col = s0.new_zeros(s0.shape[:3] + (1,)) if z0 is None else z0.reshape(s0.shape[0], s0.shape[1], s0.shape[2], 1)
        h0 = torch.cat([s0, z_col.to(s0.dtype)], dim=-1)
    if isinstance(h0, torch.Tensor) and h0.dtype in (torch.float16, torch.bfloat16) and h0.dtype != state_dtype(q.dtype):
        h0 = h0.to(state_dtype(q.dtype))
    o, h = form(q, k, v, scale=scale, initial_state=h0, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, normalize=normalize, eps=1e-10)
    if h is not None and normalize:
        n, nh, dk = h.shape[:3]
        h = (h[..., :-1], h[..., -1].reshape(n, 1, nh, dk))
    return o, h


def fused_recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: FlaLinearState = None,
    output_final_state: bool = False,
    reverse: bool = False,
    normalize: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
):
    """Alias of :func:`~fastweights.ops.recurrent_linear_attn` with fla's signature and
    state convention (``normalize`` default False, ε = 1e-10, state ``(S, z)`` when
    normalized). ``reverse=True`` is refused."""
    return _linear_attn_alias("fused_recurrent_linear_attn", recurrent_linear_attn, q, k, v, scale,
                              initial_state, output_final_state, normalize, cu_seqlens, reverse)


def fused_chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: FlaLinearState = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: Optional[torch.LongTensor] = None,
):
    """Alias of :func:`~fastweights.ops.chunk_linear_attn` with fla's signature and state
    convention (``normalize`` default **True**, as in fla; ε = 1e-10; state ``(S, z)``
    when normalized)."""
    return _linear_attn_alias("fused_chunk_linear_attn", chunk_linear_attn, q, k, v, scale,
                              initial_state, output_final_state, normalize, cu_seqlens)
