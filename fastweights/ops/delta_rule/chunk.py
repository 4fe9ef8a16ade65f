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

from .._chunk import (
    ChunkDecay, decay_pair_grad, flat_chunks, read_write_backward, reverse_cumsum, state_scan,
    state_scan_backward, unflat_chunks,
)
from .._frontend import run_op
from ..feature_maps import FeatureMapLike
from ..triton import chunk_op_triton, select_backend
from .wy import unit_lower_inverse


class _Chunks:
    """Every per-chunk quantity that does not need the state, for all chunks at once.

    Inputs are flattened chunks ``[Bt, C, ·]`` (Bt = NC·N·H, chunk-major). Glossary (README.md):
    ``scores`` P = scale·(Q Kᵀ ⊙ Γ); ``s`` S = K Kᵀ ⊙ Γ strictly lower, A = diag(β) S;
    ``inverse`` (I + A)⁻¹ (backward only); ``kv`` [K_b | V] with K_b = K ⊙ e^b;
    ``wu`` [W | U] = (I + A)⁻¹ diag(β) [K_b | V]; ``k_decayed`` K̄ = K ⊙ e^{b_C − b};
    ``q_decayed`` Q_b = Q ⊙ e^b; ``transition`` M = e^{b_C} I − K̄ᵀ W.
    """

    def __init__(self, q, k, kv, beta, g, scale, backward: bool) -> None:
        c, dk = k.shape[-2], k.shape[-1]
        self.decay = decay = ChunkDecay(g, c, k.device, k.dtype)
        self.scores = decay.mask_(q @ k.transpose(-1, -2)).mul_(scale)
        self.s = decay.mask_(k @ k.transpose(-1, -2), diagonal=-1)
        inverse = unit_lower_inverse(beta.unsqueeze(-1) * self.s)  # (I + A)⁻¹
        if backward:  # the backward needs (I + A)⁻¹ itself; the forward only T = (I + A)⁻¹ diag(β)
            self.inverse = inverse
            inverse = inverse * beta.unsqueeze(-2)
        else:
            inverse.mul_(beta.unsqueeze(-2))
        self.wu = inverse @ kv  # [W | U] = T [K_b | V]
        self.w, self.u = self.wu[..., :dk], self.wu[..., dk:]
        self.q_decayed = decay.rows(q, decay.read)
        self.k_decayed = decay.rows(k, decay.to_end)
        eye_k = torch.eye(dk, dtype=k.dtype, device=k.device)
        m = eye_k if decay.last is None else eye_k * decay.last[:, None, None]
        if backward:  # M = e^{b_C} I − K̄ᵀ W
            self.transition = torch.baddbmm(m, self.k_decayed.transpose(-1, -2), self.w, alpha=-1.0)
        else:  # [K̄ᵀ W | K̄ᵀ U] in one product; M and the injection B = K̄ᵀ U are views of it
            mb = self.k_decayed.transpose(-1, -2) @ self.wu
            self.transition = mb[..., :dk].neg_().add_(m)
            self.inject = mb[..., dk:]


def _kv(k, v, decay_g):
    """``[K ⊙ e^b | V]`` in one buffer ``[Bt, C, K + V]``."""
    if decay_g is None:
        return torch.cat([k, v], dim=-1)
    b = decay_g.cumsum(-1)
    return torch.cat([k * torch.exp(b).unsqueeze(-1), v], dim=-1)


def chunk_delta_rule_fwd(q, k, v, beta, g, h0, scale, n, nh):
    """Forward on flattened chunks ``[Bt, C, ·]`` (Bt = NC·N·H, chunk-major), ``h0 [N·H, K, V]`` or None.

    Returns ``(o [Bt, C, V], h_T [N·H, K, V], states [NC, N·H, K, V])``; ``states[c]``
    is the state entering chunk c.
    """
    dk, dv = k.shape[-1], v.shape[-1]
    x = _Chunks(q, k, _kv(k, v, g), beta, g, scale, backward=False)
    nc = q.shape[0] // (n * nh)
    transition = x.transition.reshape(nc, n * nh, dk, dk)
    states, h_final = state_scan(transition, x.inject.reshape(nc, n * nh, dk, dv), h0)  # h ← M h + K̄ᵀ U
    pwu = x.scores @ x.wu  # [P W | P U]
    q_hat = pwu[..., :dk].neg_().add_(x.q_decayed, alpha=scale)  # Q̂ = scale·Q_b − P W
    o = torch.baddbmm(pwu[..., dk:], q_hat, states.reshape(-1, dk, dv))  # O = Q̂ h + P U
    return o, h_final, states


#: Chunk-heads per group in the backward: its transient tensors are O(group·C·(C + K + V)),
#: so the backward's peak memory stops growing with T beyond the saved inputs and states.
BACKWARD_GROUP = 128


def _state_grad_terms(q, k, kv, beta, g, do, scale):
    """One group's ``(terms, Pᵀ dO, Q̂ᵀ dO)``: what the state-gradient loop needs from it."""
    x = _Chunks(q, k, kv, beta, g, scale, backward=True)
    pt_do = x.scores.transpose(-1, -2) @ do
    # Q̂ᵀ dO = scale·Q_bᵀ dO − Wᵀ (Pᵀ dO)
    inject_grad = torch.baddbmm(x.q_decayed.transpose(-1, -2) @ do, x.w.transpose(-1, -2), pt_do, beta=scale, alpha=-1.0)
    return x, pt_do, inject_grad


def _input_grads(x, q, k, v, kv, beta, do, pt_do, states, dh_next, scale):
    """Steps 2-5 of README.md for one group, given its states h and state gradients dh_{c+1}."""
    c, dk = k.shape[-2], k.shape[-1]
    decay, w, u = x.decay, x.w, x.u
    # 2. Through O = scale·Q_b h + P U' and h' = e^{b_C} h + K̄ᵀ U', with U' = U − W h.
    u_prime = torch.baddbmm(u, w, states, alpha=-1.0)
    du = torch.baddbmm(pt_do, x.k_decayed, dh_next)  # dU' (= dU; dW = −dU' hᵀ)
    # 3. Through [W | U] = (I + A)⁻¹ diag(β) [K_b | V]: dZ = (I + A)⁻ᵀ dY. Since dW = −dU hᵀ,
    #    dZ_W = −dZ_U hᵀ and dA = −tril(dZ_W Wᵀ + dZ_U Uᵀ, −1) = −tril(dZ_U U'ᵀ, −1). Stacking
    #    [dO; dZ_U] shares the products with U'ᵀ (dP, −dA) and with hᵀ (dQ_b, −dZ_W).
    stacked = torch.empty(do.shape[0], 2 * c, do.shape[-1], dtype=do.dtype, device=do.device)
    stacked[:, :c] = do
    dz_u = torch.bmm(x.inverse.transpose(-1, -2), du, out=stacked[:, c:])
    with_u = stacked @ u_prime.transpose(-1, -2)  # [dP; −dA]
    with_h = stacked @ states.transpose(-1, -2)  # [dQ_b / scale; −dZ_W]
    d_scores, minus_da = with_u[:, :c], with_u[:, c:].tril_(-1)
    d_q_decayed = with_h[:, :c].mul_(scale)
    minus_dz_w = with_h[:, c:]
    d_k_decayed = u_prime @ dh_next.transpose(-1, -2)
    d_last = None if decay.b is None else (states * dh_next).sum((-1, -2))

    k_b = kv[..., :dk]
    beta_ = beta.unsqueeze(-1)
    dbeta = (dz_u * v).sum(-1) - (minus_dz_w * k_b).sum(-1) - (minus_da * x.s).sum(-1)
    dv = beta_ * dz_u
    minus_dk_b = beta_ * minus_dz_w
    minus_ds = minus_da.mul_(beta_)  # −dS, with A = diag(β) S

    # 4-5. Through the shared terms (P, Q_b, K̄, e^{b_C}), then S = K Kᵀ ⊙ Γ_strict and K_b.
    db = None
    if decay.b is not None:
        db = (minus_dk_b * k_b).sum(-1).neg_() - decay_pair_grad(minus_ds * x.s)
    dq, dk_, db_shared = read_write_backward(
        q, k, decay, x.scores, x.q_decayed, x.k_decayed, d_scores, d_q_decayed, d_k_decayed, d_last, scale
    )
    d_kk = decay.mask_(minus_ds, diagonal=-1)  # −dS ⊙ Γ
    dk_.baddbmm_(d_kk + d_kk.transpose(-1, -2), k, alpha=-1.0)
    dk_.sub_(decay.rows(minus_dk_b, decay.read))
    dg = None if db is None else reverse_cumsum(db + db_shared)
    return dq, dk_, dv, dbeta, dg


def chunk_delta_rule_bwd(q, k, v, beta, g, states, do, dh_final, scale):
    """Backward on flattened chunks; ``README.md`` in this folder derives every line.

    Works through the chunks in groups of :data:`BACKWARD_GROUP` chunk-heads, twice:
    first for the state-gradient loop's inputs (M and Q̂ᵀ dO, kept for all chunks:
    (T/C)·K·(K + V) per head), then, after the loop, for the input gradients.
    With a single group (T·H ≤ 8192 at C = 64) the recomputed terms are reused.

    Returns ``(dq, dk, dv, dbeta, dg_or_None, dh0)``, the first five as ``[Bt, C, ·]``.
    """
    nc, nh, dk, dv = states.shape
    kv = _kv(k, v, g)
    per = max(1, BACKWARD_GROUP // nh)
    groups = [slice(c0 * nh, min(c0 + per, nc) * nh) for c0 in range(0, nc, per)]

    def part(x, sl):
        return None if x is None else x[sl]

    # 1. The state gradients, last chunk first: dh_c = Mᵀ dh_{c+1} + Q̂ᵀ dO_c.
    if len(groups) == 1:
        x, pt_do, inject_grad = _state_grad_terms(q, k, kv, beta, g, do, scale)
        transition = x.transition
    else:
        x = pt_do = None
        transition = q.new_empty(nc * nh, dk, dk)
        inject_grad = q.new_empty(nc * nh, dk, dv)
        for sl in groups:
            xg, _, inject_grad[sl] = _state_grad_terms(q[sl], k[sl], kv[sl], beta[sl], part(g, sl), do[sl], scale)
            transition[sl] = xg.transition
            del xg
    dh_next, dh0 = state_scan_backward(transition.view(nc, nh, dk, dk), inject_grad.view(nc, nh, dk, dv), dh_final)
    del transition, inject_grad
    states, dh_next = states.view(-1, dk, dv), dh_next.view(-1, dk, dv)

    # 2-5. Everything else, one group at a time.
    if x is not None:
        return (*_input_grads(x, q, k, v, kv, beta, do, pt_do, states, dh_next, scale), dh0)
    dq, dk_, dv_, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
    dg = None if g is None else torch.empty_like(g)
    for sl in groups:
        xg, pt_do, _ = _state_grad_terms(q[sl], k[sl], kv[sl], beta[sl], part(g, sl), do[sl], scale)
        grads = _input_grads(xg, q[sl], k[sl], v[sl], kv[sl], beta[sl], do[sl], pt_do, states[sl], dh_next[sl], scale)
        for out, grad in zip((dq, dk_, dv_, dbeta, dg), grads):
            if out is not None:
                out[sl] = grad
        del xg, pt_do, grads
    return dq, dk_, dv_, dbeta, dg, dh0


class ChunkDeltaRuleFunction(torch.autograd.Function):
    """The (gated) delta rule's chunk form with a hand-written backward.

    ``apply(q, k, v, beta, g, h0, scale, chunk_size) -> (o, h_T)`` on head-first
    compute-dtype tensors ``[N, H, T, D]`` (``g``/``h0`` may be None; ``g=None`` is
    the plain rule). Gradients reach q, k, v, beta, g and h0, and the cotangent of
    h_T is honoured.

    Memory kept for the backward: the inputs, chunked (O(T·(2K + V)) per head), and
    the T/C states entering the chunks (O((T/C)·K·V)). The backward recomputes the
    intra-chunk terms (transient O(T·(C + K + V)) per head, plus (T/C)·K² for M).
    Double backward is not supported (``once_differentiable``): use the
    recurrent or parallel form, which keep plain autograd, for higher derivatives.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, g, h0, scale, chunk_size):
        n, nh, t_len, dk = k.shape
        dv = v.shape[-1]
        qc, kc, vc, bc, gc = (flat_chunks(x, chunk_size) for x in (q, k, v, beta, g))
        h0_ = None if h0 is None else h0.reshape(n * nh, dk, dv)
        o, h_final, states = chunk_delta_rule_fwd(qc, kc, vc, bc, gc, h0_, scale, n, nh)
        ctx.save_for_backward(qc, kc, vc, bc, gc, states)
        ctx.scale, ctx.chunk_size, ctx.has_h0, ctx.shape = scale, chunk_size, h0 is not None, (n, nh, t_len)
        return unflat_chunks(o, n, nh, t_len), h_final.reshape(n, nh, dk, dv)

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dh_final):
        qc, kc, vc, bc, gc, states = ctx.saved_tensors
        n, nh, t_len = ctx.shape
        doc = flat_chunks(do, ctx.chunk_size)
        dh_final = dh_final.reshape(states.shape[1], *dh_final.shape[-2:])
        dq, dk, dv, dbeta, dg, dh0 = chunk_delta_rule_bwd(qc, kc, vc, bc, gc, states, doc, dh_final, ctx.scale)
        grads = [unflat_chunks(x, n, nh, t_len) for x in (dq, dk, dv, dbeta)]
        grads.append(None if dg is None else unflat_chunks(dg, n, nh, t_len))
        dh0 = dh0.reshape(n, nh, *dh0.shape[-2:]) if ctx.has_h0 else None
        return (*grads, dh0, None, None)


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

    Training: the PyTorch backend differentiates through
    :class:`ChunkDeltaRuleFunction`, a hand-written backward (derived in
    ``delta_rule/README.md``) that keeps only the inputs and the T/C chunk-entry
    states -- O(T·(K+V) + (T/C)·K·V) per head -- and recomputes the rest.
    Gradients reach q, k, v, beta and initial_state (and g for the gated rule);
    double backward is not supported (use the recurrent or parallel form).
    ``benchmarks/chunk_speed.py`` (``fastweights bench``) measures it against the
    textbook chunk implementation and the recurrence.
    """
    kwargs = dict(
        beta=beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size, feature_map=feature_map,
        qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm,
    )
    if select_backend("chunk_delta_rule", backend, q, v, chunk_size=chunk_size, feature_map=feature_map) == "triton":
        return chunk_op_triton("chunk_delta_rule", q, k, v, **kwargs)
    return run_op("chunk_delta_rule", delta_rule_chunk, q, k, v, **kwargs, requires_beta=True)
