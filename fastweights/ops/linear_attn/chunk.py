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

from .._chunk import ChunkDecay, flat_chunks, read_write_backward, reverse_cumsum, state_scan, state_scan_backward, unflat_chunks
from .._frontend import run_op
from ..feature_maps import FeatureMapLike


def _terms(q, k, g, scale):
    """``(decay, P, Q_b, K̄)`` for flattened chunks ``[Bt, C, ·]``: P = scale·(Q Kᵀ ⊙ Γ)."""
    decay = ChunkDecay(g, k.shape[-2], k.device, k.dtype)
    scores = decay.mask_(q @ k.transpose(-1, -2)).mul_(scale)
    return decay, scores, decay.rows(q, decay.read), decay.rows(k, decay.to_end)


def chunk_linear_attn_fwd(q, k, v, g, h0, scale, n, nh):
    """Forward on flattened chunks ``[Bt, C, ·]``: ``(o [Bt, C, V], h_T [N·H, K, V], states [NC, N·H, K, V])``."""
    dk, dv = k.shape[-1], v.shape[-1]
    decay, scores, q_decayed, k_decayed = _terms(q, k, g, scale)
    nc = q.shape[0] // (n * nh)
    inject = (k_decayed.transpose(-1, -2) @ v).reshape(nc, n * nh, dk, dv)  # K̄ᵀ V
    last = None if decay.last is None else decay.last.reshape(nc, n * nh)
    states, h_final = state_scan(last, inject, h0)  # h ← e^{b_C} h + K̄ᵀ V
    o = torch.baddbmm(scores @ v, q_decayed, states.reshape(-1, dk, dv), alpha=scale)  # O = P V + scale·Q_b h
    return o, h_final, states


def chunk_linear_attn_bwd(q, k, v, g, states, do, dh_final, scale):
    """Backward on flattened chunks: ``(dq, dk, dv, dg_or_None, dh0)``; ``delta_rule/README.md`` derives it."""
    dk, dv = k.shape[-1], v.shape[-1]
    decay, scores, q_decayed, k_decayed = _terms(q, k, g, scale)
    grid = states.shape[:2]
    last = None if decay.last is None else decay.last.reshape(grid)
    inject_grad = (q_decayed.transpose(-1, -2) @ do).mul_(scale).reshape(grid + (dk, dv))  # Q̂ᵀ dO
    dh_next, dh0 = state_scan_backward(last, inject_grad, dh_final)
    states, dh_next = states.reshape(-1, dk, dv), dh_next.reshape(-1, dk, dv)
    dv_ = torch.baddbmm(scores.transpose(-1, -2) @ do, k_decayed, dh_next)
    d_last = None if decay.b is None else (states * dh_next).sum((-1, -2))
    dq, dk_, db = read_write_backward(
        q, k, decay, scores, q_decayed, k_decayed,
        d_scores=do @ v.transpose(-1, -2),
        d_q_decayed=(do @ states.transpose(-1, -2)).mul_(scale),
        d_k_decayed=v @ dh_next.transpose(-1, -2),
        d_last=d_last, scale=scale,
    )
    return dq, dk_, dv_, None if db is None else reverse_cumsum(db), dh0


class ChunkLinearAttnFunction(torch.autograd.Function):
    """Chunkwise linear attention with a hand-written backward.

    ``apply(q, k, v, g, h0, scale, chunk_size) -> (o, h_T)`` on head-first
    compute-dtype tensors ``[N, H, T, D]`` (``g``/``h0`` may be None). Keeps the
    inputs and the T/C chunk-entry states (O(T·(2K + V) + (T/C)·K·V) per head).
    Double backward is not supported (``once_differentiable``).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, chunk_size):
        n, nh, t_len, dk = k.shape
        dv = v.shape[-1]
        qc, kc, vc, gc = (flat_chunks(x, chunk_size) for x in (q, k, v, g))
        h0_ = None if h0 is None else h0.reshape(n * nh, dk, dv)
        o, h_final, states = chunk_linear_attn_fwd(qc, kc, vc, gc, h0_, scale, n, nh)
        ctx.save_for_backward(qc, kc, vc, gc, states)
        ctx.scale, ctx.chunk_size, ctx.has_h0, ctx.shape = scale, chunk_size, h0 is not None, (n, nh, t_len)
        return unflat_chunks(o, n, nh, t_len), h_final.reshape(n, nh, dk, dv)

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dh_final):
        qc, kc, vc, gc, states = ctx.saved_tensors
        n, nh, t_len = ctx.shape
        doc = flat_chunks(do, ctx.chunk_size)
        dh_final = dh_final.reshape(states.shape[1], *dh_final.shape[-2:])
        dq, dk, dv, dg, dh0 = chunk_linear_attn_bwd(qc, kc, vc, gc, states, doc, dh_final, ctx.scale)
        grads = [unflat_chunks(x, n, nh, t_len) for x in (dq, dk, dv)]
        grads.append(None if dg is None else unflat_chunks(dg, n, nh, t_len))
        dh0 = dh0.reshape(n, nh, *dh0.shape[-2:]) if ctx.has_h0 else None
        return (*grads, dh0, None, None)


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

    Training differentiates through :class:`ChunkLinearAttnFunction`, a
    hand-written backward that keeps the inputs and the T/C chunk-entry states
    only (``delta_rule/README.md``, with W = 0 and U = V); double backward is not
    supported (use the recurrent or parallel form).
    """
    return run_op(
        "chunk_linear_attn", linear_attn_chunk, q, k, v, g=g, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size, feature_map=feature_map, qk_norm=qk_norm, normalize=normalize, eps=eps,
    )
