"""The delta rule, chunk form: the WY/UT algorithm (Yang et al. 2024; seed 001, ch. 7).

For chunks of C tokens with incoming state h (DESIGN.md, "The chunk form"):

    A = tril(diag(β) K Kᵀ, −1)       C×C, strictly lower          } one batched
    T = (I + A)⁻¹ diag(β)            forward substitution          } computation
    W = T K,  U = T V                the WY / UT representation    } over all chunks
    U' = U − W h                     pseudo-values given the state  ]
    O  = scale·Q h + tril(scale·Q Kᵀ) U'                             ] T/C sequential
    h ← h + Kᵀ U'                                                   ] steps

The gated rule multiplies in the cumulative decays (``wy.py`` derives them). One
solver serves both; ``g=None`` is the plain rule.

This file is the fast path for training. Regrouped by the incoming state, the last
three lines are ``h ← M h + Kᵀ U`` with ``M = e^{b_C} I − K̄ᵀ W`` and
``O = (scale·Q_b − P W) h + P U``: everything except one K×K by K×V matmul per
chunk runs as batched matmuls over all chunks (``_chunk.state_scan``).
:class:`ChunkDeltaRuleFunction` carries a hand-derived backward (``README.md`` in
this folder, step by step) that keeps only the inputs and the T/C states entering
the chunks, not autograd's graph of the loop. ``textbook.py`` holds the plain
implementation (row-by-row forward substitution, a per-chunk loop, autograd) that
``benchmarks/chunk_speed.py`` measures this one against.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from .._chunk import block_terms, from_chunks, read_write_backward, reverse_cumsum, state_scan, state_scan_backward, to_chunks
from .._frontend import run_op
from ..feature_maps import FeatureMapLike
from ..triton import chunk_op_triton, select_backend
from .wy import ut_factors


def _intra_chunk(qc, kc, vc, bc, gc, scale):
    """Every per-chunk quantity that does not need the state, for all chunks at once.

    Returns ``(terms, transition, q_hat)``: ``terms`` are the forward pieces the
    backward reuses, ``transition`` is ``M = e^{b_C} I − K̄ᵀ W`` ``[N, H, NC, K, K]``
    and ``q_hat = scale·Q_b − P W`` ``[N, H, NC, C, K]``.
    """
    q_decayed, k_decayed, scores, chunk_decay, b = block_terms(qc, kc, gc, scale)
    inverse, s, gamma = ut_factors(kc, bc, b)
    k_b = kc if b is None else kc * torch.exp(b).unsqueeze(-1)  # K ⊙ e^b
    beta_ = bc.unsqueeze(-1)
    w = inverse @ (beta_ * k_b)  # W = (I + A)⁻¹ diag(β) (K ⊙ e^b)
    u = inverse @ (beta_ * vc)  # U = (I + A)⁻¹ diag(β) V
    transition = k_decayed.transpose(-1, -2) @ w
    transition.neg_().diagonal(dim1=-2, dim2=-1).add_(1.0 if chunk_decay is None else chunk_decay.unsqueeze(-1))
    q_hat = scale * q_decayed - scores @ w
    terms = dict(
        q_decayed=q_decayed, k_decayed=k_decayed, scores=scores, chunk_decay=chunk_decay, b=b,
        inverse=inverse, s=s, gamma=gamma, k_b=k_b, w=w, u=u,
    )
    return terms, transition, q_hat


def chunk_delta_rule_fwd(qc, kc, vc, bc, gc, h0, scale) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward on chunked head-first tensors ``[N, H, NC, C, D]``.

    Returns ``(o [N, H, NC, C, V], h_T [N, H, K, V], states [N, H, NC, K, V])``;
    ``states[:, :, c]`` is the state entering chunk c.
    """
    terms, transition, q_hat = _intra_chunk(qc, kc, vc, bc, gc, scale)
    inject = terms["k_decayed"].transpose(-1, -2) @ terms["u"]  # K̄ᵀ U
    states, h_final = state_scan(transition, inject, h0)  # the only loop: h ← M h + K̄ᵀ U
    o = torch.matmul(q_hat, states).add_(terms["scores"] @ terms["u"])  # O = Q̂ h + P U
    return o, h_final, states


def chunk_delta_rule_bwd(qc, kc, vc, bc, gc, states, do, dh_final, scale):
    """Backward on chunked tensors; README.md in this folder derives every line.

    Returns ``(dq, dk, dv, dbeta, dg_or_None, dh0)`` in the chunked layout.
    """
    terms, transition, q_hat = _intra_chunk(qc, kc, vc, bc, gc, scale)
    scores, k_decayed, w, u, inverse = (terms[n] for n in ("scores", "k_decayed", "w", "u", "inverse"))
    b = terms["b"]

    # 1. The state gradients, backwards over chunks: dh_c = Mᵀ dh_{c+1} + Q̂ᵀ dO_c.
    dh_next, dh0 = state_scan_backward(transition, q_hat.transpose(-1, -2) @ do, dh_final)

    # 2. Through O = scale·Q_b h + P U' and h' = e^{b_C} h + K̄ᵀ U', with U' = U − W h.
    u_prime = u - w @ states
    du = scores.transpose(-1, -2) @ do + k_decayed @ dh_next  # dU' (= dU)
    d_scores = do @ u_prime.transpose(-1, -2)
    d_q_decayed = scale * (do @ states.transpose(-1, -2))
    d_k_decayed = u_prime @ dh_next.transpose(-1, -2)
    d_chunk_decay = None if b is None else (states * dh_next).sum((-1, -2))
    dw = -(du @ states.transpose(-1, -2))

    # 3. Through the UT transform Y = [W | U] = (I + A)⁻¹ diag(β) [K_b | V].
    inverse_t = inverse.transpose(-1, -2)
    dz_w = inverse_t @ dw  # dZ = (I + A)⁻ᵀ dY
    dz_u = inverse_t @ du
    da = (dz_w @ w.transpose(-1, -2)).add_(dz_u @ u.transpose(-1, -2)).neg_().tril_(-1)  # dA = −tril(dZ Yᵀ, −1)
    beta_ = bc.unsqueeze(-1)
    dbeta = (dz_w * terms["k_b"]).sum(-1) + (dz_u * vc).sum(-1) + (da * terms["s"]).sum(-1)
    dv = beta_ * dz_u
    dk_b = beta_ * dz_w
    ds = beta_ * da  # dS, with A = diag(β) S and S = K Kᵀ ⊙ Γ_strict
    d_kk = ds * terms["gamma"]

    # 4. Through the shared terms P, Q_b, K̄, e^{b_C}; then K_b and S's K Kᵀ.
    dq, dk, db = read_write_backward(
        qc, kc, b, scores, terms["q_decayed"], k_decayed, d_scores, d_q_decayed, d_k_decayed,
        d_chunk_decay, terms["chunk_decay"], scale,
    )
    dk = dk + d_kk @ kc + d_kk.transpose(-1, -2) @ kc
    if b is None:
        return dq, dk + dk_b, dv, dbeta, None, dh0
    dk = dk + dk_b * torch.exp(b).unsqueeze(-1)
    db = db + (dk_b * terms["k_b"]).sum(-1) + (ds * terms["s"]).sum(-1) - (ds * terms["s"]).sum(-2)
    return dq, dk, dv, dbeta, reverse_cumsum(db), dh0


class ChunkDeltaRuleFunction(torch.autograd.Function):
    """The (gated) delta rule's chunk form with a hand-written backward.

    ``apply(q, k, v, beta, g, h0, scale, chunk_size) -> (o, h_T)`` on head-first
    compute-dtype tensors ``[N, H, T, D]`` (``g``/``h0`` may be None; ``g=None`` is
    the plain rule). Gradients reach q, k, v, beta, g and h0, and the cotangent of
    h_T is honoured.

    Memory kept for the backward: the inputs (O(T·(2K + V)) per head) and the
    T/C states entering the chunks (O((T/C)·K·V)); the backward recomputes the
    intra-chunk terms (O(T·C + T·(K + V)) transient, plus (T/C)·K·K for M).
    Double backward is not supported (``once_differentiable``): use the
    recurrent or parallel form, which keep plain autograd, for higher derivatives.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, g, h0, scale, chunk_size):
        t_len = q.shape[2]
        qc, kc, vc, bc, gc = (to_chunks(x, chunk_size) for x in (q, k, v, beta, g))
        o, h_final, states = chunk_delta_rule_fwd(qc, kc, vc, bc, gc, h0, scale)
        ctx.save_for_backward(q, k, v, beta, g, states)
        ctx.scale, ctx.chunk_size, ctx.has_h0 = scale, chunk_size, h0 is not None
        return from_chunks(o, t_len), h_final

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dh_final):
        q, k, v, beta, g, states = ctx.saved_tensors
        t_len, c = q.shape[2], ctx.chunk_size
        qc, kc, vc, bc, gc, doc = (to_chunks(x, c) for x in (q, k, v, beta, g, do))
        dq, dk, dv, dbeta, dg, dh0 = chunk_delta_rule_bwd(qc, kc, vc, bc, gc, states, doc, dh_final, ctx.scale)
        grads = [from_chunks(x, t_len) for x in (dq, dk, dv, dbeta)]
        grads.append(None if dg is None else from_chunks(dg, t_len))
        return (*grads, dh0 if ctx.has_h0 else None, None, None)


def delta_rule_chunk(q, k, v, beta, g, h0, scale, chunk_size) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise (gated) delta rule on head-first tensors ``[N, H, T, D]``; returns ``(o, h_T)``."""
    return ChunkDeltaRuleFunction.apply(q, k, v, beta, g, h0, scale, chunk_size)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    chunk_size: int = 64,
    qk_norm: Optional[str] = None,
    feature_map: FeatureMapLike = None,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The delta rule, chunkwise parallel: the fast path for training.

    Equivalent to :func:`~fastweights.ops.recurrent_delta_rule` (same arguments
    and returns; see its docstring), to ~1e-12 relative in float64. Unlike
    flash-linear-attention's kernel it accepts fp32 and fp64 as well as bf16/fp16
    (low precision is computed in fp32) and runs on any device.

    Args beyond the reference's:
        chunk_size: C, tokens per chunk (T need not be a multiple of C). The
            intra-chunk work is O(T·C·(K+V) + T·C²); the sequential loop has T/C steps.
        backend: ``"auto"`` (Triton kernels for CUDA tensors when ``fastweights[triton]``
            is installed, PyTorch otherwise), ``"torch"`` or ``"triton"``
            (``fastweights/ops/triton/``: fp32/bf16/fp16, K, V <= 256, chunk size 64).
    """
    kwargs = dict(
        beta=beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size, feature_map=feature_map,
        qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm,
    )
    if select_backend("chunk_delta_rule", backend, q, v, chunk_size=chunk_size, feature_map=feature_map) == "triton":
        return chunk_op_triton("chunk_delta_rule", q, k, v, **kwargs)
    return run_op("chunk_delta_rule", delta_rule_chunk, q, k, v, **kwargs, requires_beta=True)
