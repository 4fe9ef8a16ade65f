"""Linear attention, chunk form (seed 001, ch. 6, "What chunkwise already means").

Split T into chunks of C tokens. Inside a chunk the work is the parallel form;
across chunks only the state is carried:

    O_[c] = scale · (Q_[c] ⊙ e^b) h_[c] + scale · tril(Q_[c] K_[c]ᵀ ⊙ Γ) V_[c]
    h_[c+1] = e^{b_C} h_[c] + (K_[c] ⊙ e^{b_C − b})ᵀ V_[c]

C = T gives the parallel form, C = 1 the recurrence. All intra-chunk products
are computed for every chunk at once; only :func:`~fastweights.ops._chunk.state_scan`
loops, T/C times (and not at all without decay: the states are then a running
sum over chunks, ``torch.cumsum``). :class:`ChunkLinearAttnFunction` carries a
hand-written backward that keeps the inputs and the T/C chunk-entry states only;
``delta_rule/README.md`` derives it (linear attention is the delta rule's chunk
algebra with W = 0, U = V).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from .._chunk import block_terms, from_chunks, read_write_backward, reverse_cumsum, state_scan, state_scan_backward, to_chunks
from .._frontend import run_op
from ..feature_maps import FeatureMapLike


def chunk_linear_attn_fwd(qc, kc, vc, gc, h0, scale) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward on chunked head-first tensors ``[N, H, NC, C, D]``: ``(o, h_T, states)``."""
    q_decayed, k_decayed, scores, chunk_decay, _ = block_terms(qc, kc, gc, scale)
    inject = k_decayed.transpose(-1, -2) @ vc  # K̄ᵀ V
    states, h_final = state_scan(chunk_decay, inject, h0)  # h ← e^{b_C} h + K̄ᵀ V
    o = torch.matmul(q_decayed, states).mul_(scale).add_(scores @ vc)  # O = scale·Q_b h + P V
    return o, h_final, states


def chunk_linear_attn_bwd(qc, kc, vc, gc, states, do, dh_final, scale):
    """Backward on chunked tensors: ``(dq, dk, dv, dg_or_None, dh0)``."""
    q_decayed, k_decayed, scores, chunk_decay, b = block_terms(qc, kc, gc, scale)
    dh_next, dh0 = state_scan_backward(chunk_decay, scale * (q_decayed.transpose(-1, -2) @ do), dh_final)
    dv = scores.transpose(-1, -2) @ do + k_decayed @ dh_next
    d_chunk_decay = None if b is None else (states * dh_next).sum((-1, -2))
    dq, dk, db = read_write_backward(
        qc, kc, b, scores, q_decayed, k_decayed,
        d_scores=do @ vc.transpose(-1, -2),
        d_q_decayed=scale * (do @ states.transpose(-1, -2)),
        d_k_decayed=vc @ dh_next.transpose(-1, -2),
        d_chunk_decay=d_chunk_decay, chunk_decay=chunk_decay, scale=scale,
    )
    return dq, dk, dv, None if db is None else reverse_cumsum(db), dh0


class ChunkLinearAttnFunction(torch.autograd.Function):
    """Chunkwise linear attention with a hand-written backward.

    ``apply(q, k, v, g, h0, scale, chunk_size) -> (o, h_T)`` on head-first
    compute-dtype tensors ``[N, H, T, D]`` (``g``/``h0`` may be None). Keeps the
    inputs and the T/C chunk-entry states (O(T·(2K + V) + (T/C)·K·V) per head).
    Double backward is not supported (``once_differentiable``).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, chunk_size):
        t_len = q.shape[2]
        qc, kc, vc, gc = (to_chunks(x, chunk_size) for x in (q, k, v, g))
        o, h_final, states = chunk_linear_attn_fwd(qc, kc, vc, gc, h0, scale)
        ctx.save_for_backward(q, k, v, g, states)
        ctx.scale, ctx.chunk_size, ctx.has_h0 = scale, chunk_size, h0 is not None
        return from_chunks(o, t_len), h_final

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dh_final):
        q, k, v, g, states = ctx.saved_tensors
        t_len, c = q.shape[2], ctx.chunk_size
        qc, kc, vc, gc, doc = (to_chunks(x, c) for x in (q, k, v, g, do))
        dq, dk, dv, dg, dh0 = chunk_linear_attn_bwd(qc, kc, vc, gc, states, doc, dh_final, ctx.scale)
        grads = [from_chunks(x, t_len) for x in (dq, dk, dv)]
        grads.append(None if dg is None else from_chunks(dg, t_len))
        return (*grads, dh0 if ctx.has_h0 else None, None, None)


def linear_attn_chunk(q, k, v, beta, g, h0, scale, chunk_size) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise sum rule on head-first tensors ``[N, H, T, D]``; returns ``(o, h_T)``."""
    return ChunkLinearAttnFunction.apply(q, k, v, g, h0, scale, chunk_size)


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    chunk_size: int = 64,
    feature_map: FeatureMapLike = None,
    qk_norm: Optional[str] = None,
    normalize: bool = False,
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal linear attention, chunkwise parallel: the fast path for training.

    Equivalent to :func:`~fastweights.ops.recurrent_linear_attn` (same arguments and
    returns; see its docstring). ``chunk_size`` (C) trades the O(T·C) intra-chunk
    work against T/C sequential state updates; T need not be a multiple of C.
    """
    return run_op(
        "chunk_linear_attn", linear_attn_chunk, q, k, v, g=g, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size, feature_map=feature_map, qk_norm=qk_norm, normalize=normalize, eps=eps,
    )
