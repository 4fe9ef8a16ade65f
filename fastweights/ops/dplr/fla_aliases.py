"""fla 0.6.0's DPLR and RWKV-7 names with fla's signatures (positional order included):
``fused_recurrent_dplr_delta_rule`` (the recurrent form), ``chunk_rwkv7`` (the chunk form,
``r`` for q and ``w`` for gk, scale 1.0 by default as in fla) and ``fused_recurrent_rwkv7``
(the recurrent form, ``output_final_state=True`` by default as in fla)."""

from __future__ import annotations

from typing import Optional

import torch

from .api import chunk_dplr_delta_rule, recurrent_dplr_delta_rule

__all__ = ["fused_recurrent_dplr_delta_rule", "chunk_rwkv7", "fused_recurrent_rwkv7"]


def _refuse_reverse(op: str, reverse: bool) -> None:
    if reverse:
        raise ValueError(f"{op}: `reverse`=True is not supported: reverse-time scans are not supported")


def fused_recurrent_dplr_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    gk: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
):
    """Alias of :func:`~fastweights.ops.recurrent_dplr_delta_rule` with fla's signature."""
    _refuse_reverse("fused_recurrent_dplr_delta_rule", reverse)
    return recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens)


def chunk_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float = 1.0,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    safe_gate: bool = False,
    chunk_size: Optional[int] = None,
    disable_recompute: bool = False,
    cp_context=None,
    lower_bound: Optional[float] = None,
):
    """Alias of :func:`~fastweights.ops.chunk_dplr_delta_rule` with fla's ``chunk_rwkv7`` signature:
    ``r`` is q, ``w`` is the log decay gk [B, T, H, K]."""
    return chunk_dplr_delta_rule(r, k, v, a, b, w, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                                 safe_gate, chunk_size, disable_recompute, lower_bound=lower_bound, cp_context=cp_context)


def fused_recurrent_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = True,
    cu_seqlens: Optional[torch.LongTensor] = None,
):
    """Alias of :func:`~fastweights.ops.recurrent_dplr_delta_rule` with fla's ``fused_recurrent_rwkv7``
    signature (``r`` is q, ``w`` the log decay)."""
    return recurrent_dplr_delta_rule(r, k, v, a, b, w, scale, initial_state, output_final_state, cu_seqlens)
