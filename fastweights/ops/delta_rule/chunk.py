"""The delta rule, chunk form: the WY/UT algorithm (Yang et al. 2024).

For chunks of C tokens with incoming state h (docs/design.md, "The chunk form"):

    A = tril(diag(β) K Kᵀ, −1)       C×C, strictly lower          } one batched
    T = (I + A)⁻¹ diag(β)            forward substitution          } computation
    W = T K,  U = T V                the WY / UT representation    } over all chunks
    U' = U − W h                     pseudo-values given the state  ]
    O  = scale·Q h + tril(scale·Q Kᵀ) U'                             ] T/C sequential
    h ← h + Kᵀ U'                                                   ] steps

The gated rule multiplies in the cumulative decays (``wy.py`` derives them). One
solver serves both; ``g=None`` is the plain rule.

This file is the fast path for training. Everything that does not need the state
(P, S, and W, U by a block substitution that never forms the C×C inverse; ``wy.py``)
is a few batched matmuls over a group of chunks; the loop does the two small
products per chunk that do (U' = U − W h and h ← e^{b_C} h + K̄ᵀ U'), and
O = scale·Q_b h + P U' is batched again after it from the saved chunk-entry
states. :func:`delta_rule_chunk` carries a hand-derived backward
(``README.md`` in this folder, step by step) that keeps the inputs, [W | U'], the
diagonal-block inverses and the T/C states entering the chunks, not autograd's
graph of the loop; its loop is the adjoint of the forward's (dU' and dh, two
products per chunk).
``textbook.py`` holds the plain implementation (row-by-row forward substitution,
a per-chunk loop, autograd) that ``benchmarks/chunk_speed.py`` measures this one
against.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._chunk import (
    ChunkDecay, backward_only, chunk_buffer, decay_pair_grad, flat_chunks, from_chunk_buffer, put_chunks, read_write_backward,
    reverse_cumsum,
)
from .._backend import backward_can_follow, inference_op
from .._checks import bf16_operands, check_qkv_finite
from ..precision import autocast_off
from ..cpu import kernels_for, kernels_for_bf16, unit_last_stride
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..step import delta_rule_step
from .wy import block_substitution, diagonal_block_inverses, row_blocks, ut_solve


#: Row blocks of the UT solve (``wy.block_substitution``): C/UT_BLOCKS-row diagonal blocks.
UT_BLOCKS = 4


class _Chunks:
    """Every per-chunk quantity that does not need the state, for a group of chunks at once.

    Inputs are flattened chunks ``[Bt, C, ·]`` (Bt = NC·N·H, chunk-major), keys and
    values side by side in one buffer ``kv [Bt, C, K + V]``. Glossary (README.md):
    ``scores`` P = scale·(Q Kᵀ ⊙ Γ); ``s`` S = K Kᵀ ⊙ Γ strictly lower; ``a`` A = diag(β) S
    (backward only); ``inverse_blocks`` (I + A)'s diagonal-block inverses X_j
    (:func:`~.wy.diagonal_block_inverses`); ``k_b`` K_b = K ⊙ e^b (backward only);
    ``wu`` [W | U] = (I + A)⁻¹ diag(β) [K_b | V] (forward: solved into ``wu``;
    backward: the forward's saved [W | U'] and X_j are passed in); ``k_decayed``
    K̄ = K ⊙ e^{b_C − b}; ``q_decayed`` Q_b = Q ⊙ e^b.
    """

    def __init__(self, q, kv, beta, g, scale, backward: bool, wu: torch.Tensor, inverse_blocks=None,
                 low: Optional[torch.dtype] = None) -> None:
        c, dk = q.shape[-2:]
        k, v = kv[..., :dk], kv[..., dk:]
        self.decay = decay = ChunkDecay(g, c, q.device, beta.dtype)
        k_t = k.transpose(-1, -2)
        if low is not None:  # a bf16 bmm copies a transposed operand: once here, not in each product
            k_t = k_t.contiguous()
        self.scores = decay.mask_(q @ k_t).mul_(scale)
        s = k @ k_t
        self.s = decay.mask_(s if low is None else s.float(), diagonal=-1)  # the solve stays fp32
        if inverse_blocks is None:
            inverse_blocks = diagonal_block_inverses(self.s, beta, UT_BLOCKS)
        self.inverse_blocks = inverse_blocks
        self.q_decayed = _scaled_rows(q, decay.read, low)
        self.k_decayed = _scaled_rows(k, decay.to_end, low)  # a new tensor with a gate, k itself without
        self.k, self.v = k, v
        if backward:
            self.a = beta.unsqueeze(-1) * self.s
            self.k_b = decay.rows(k, decay.read)
        else:  # [W | U] = (I + diag(β) S)⁻¹ diag(β) [K_b | V], by blocks with D_j = X_j diag(β_j)
            rhs = kv
            if decay.read is not None or low is not None:  # [K_b | V] in wu (the solve runs in place);
                rhs = wu.copy_(kv)                         # kv stays as it is (the backward may reuse it)
                if decay.read is not None:
                    rhs[..., :dk].mul_(decay.read.unsqueeze(-1))
            ut_solve(self.s, beta, self.inverse_blocks, rhs, out=wu)
        self.wu, self.w, self.u = wu, wu[..., :dk], wu[..., dk:]


def _operand(x: torch.Tensor, low: Optional[torch.dtype]) -> torch.Tensor:
    """``x`` as a product operand: itself, or cast to the low precision ``low`` (bf16 products)."""
    return x if low is None or x.dtype == low else x.to(low)


def _scaled_rows(x: torch.Tensor, factor: Optional[torch.Tensor], low: Optional[torch.dtype]) -> torch.Tensor:
    """``x ⊙ factor`` row by row as a product operand (``x`` itself without a factor): in one pass,
    computed in the factor's precision and written in ``low`` when given."""
    if factor is None:
        return _operand(x, low)
    out = None if low is None else x.new_empty(x.shape, dtype=low)
    return torch.mul(x, factor.unsqueeze(-1), out=out)


def _flat_kv(k, v, chunk_size, c0, c1, kv=None, dtype=None):
    """Chunks ``c0 .. c1 − 1`` of k and v copied side by side into one ``[Bt, C, K + V]`` buffer ``kv``
    (new, of ``dtype`` or k's, when not given)."""
    dk = k.shape[-1]
    if kv is None:
        kv = k.new_empty((c1 - c0) * k.shape[0] * k.shape[1], chunk_size, dk + v.shape[-1], dtype=dtype)
    flat_chunks(k, chunk_size, c0, c1, out=kv[..., :dk])
    flat_chunks(v, chunk_size, c0, c1, out=kv[..., dk:])
    return kv


def _delta_scan(x, h, states, u_prime, low=None, states_low=None, u_low=None):
    """The one sequential loop: ``U'_c = U_c − W_c h_c`` and ``h_{c+1} = e^{b_C} h_c + K̄_cᵀ U'_c``.

    ``h`` is the state entering the first chunk of ``x`` (``[N·H, K, V]``); the state
    entering each chunk is written into ``states [NC, N·H, K, V]`` and U' into
    ``u_prime`` (contiguous, ``[NC·N·H, C, V]``). Returns the state after the last chunk.
    With ``low`` (bf16 products) the two products take ``low`` operands: h and U' are
    rounded into ``states_low`` and ``u_low`` (shaped like ``states`` and ``u_prime``, kept
    for the output's products), while h, U' and the sums stay in the state's dtype.
    """
    nc, nh, dk, dv = states.shape
    c = x.w.shape[-2]
    w = _operand(x.w, low).view(nc, nh, c, dk).unbind(0)
    u_prime.copy_(x.u)  # U, made U' = U − W h in place chunk by chunk
    u_out = u_prime.view(nc, nh, c, dv).unbind(0)
    k_t = x.k_decayed.view(nc, nh, c, dk).transpose(-1, -2).unbind(0)
    last = None if x.decay.last is None else x.decay.last.view(nc, nh, 1, 1).unbind(0)
    targets = states.unbind(0)[1:] + (None,)
    states[0] = h
    h = states[0]
    if low is not None:
        h_low, u_low = states_low.unbind(0), u_low.view(nc, nh, c, dv).unbind(0)
    for i in range(nc):
        if low is None:
            u_i = u_out[i].baddbmm_(w[i], h, alpha=-1.0)
        else:
            u_i = u_out[i].sub_(torch.bmm(w[i], h_low[i].copy_(h)))
        carried = h if last is None else h * last[i]
        if low is None:
            h = torch.baddbmm(carried, k_t[i], u_i, out=targets[i])
        else:
            h = torch.add(carried, torch.bmm(k_t[i], u_low[i].copy_(u_i)), out=targets[i])
    return h


#: Chunk-heads per group in the forward: each group's intra-chunk terms, its part of
#: the loop and its outputs are computed before the next group's, so the transient
#: tensors stay small (cache-resident, and reused by the allocator instead of fresh pages).
FORWARD_GROUP = 128


def _native_forward(q, k, v, beta, g, h0, scale, chunk_size, keep, low, check_finite=""):
    """:func:`chunk_delta_rule_fwd` by the compiled CPU kernel (``fastweights/ops/cpu/chunk_delta.cpp``:
    the same algebra, one (sequence, head) per task; bf16 products: :func:`_native_forward_bf16`),
    or None where it does not apply: T = 0, or not :func:`~fastweights.ops.cpu.kernels_for` the
    inputs (the CPU, fp32 or fp64 throughout, the kernels on and built). ``check_finite``: the
    op's name, for the finite check of q, k, v the kernel makes as it gathers them ("" for none)."""
    if k.shape[2] == 0:
        return None
    if low is not None:
        return _native_forward_bf16(q, k, v, beta, g, h0, scale, chunk_size, low, check_finite)
    if v.dtype == torch.bfloat16 and not keep:  # plain bf16 inputs: fp32 arithmetic, widened in the kernel's gather
        mod = kernels_for_bf16(q, k, v, beta, g, h0)
    else:
        mod = kernels_for(q, k, v, beta, g, h0)
    if mod is None:
        return None
    q, k, v = unit_last_stride(q, k, v)
    nb = row_blocks(chunk_size, UT_BLOCKS)
    o, h, states, *kept = mod.chunk_delta_fwd(q, k, v, beta, g, h0, float(scale), int(chunk_size), nb, bool(keep),
                                              check_finite)
    return from_chunk_buffer(o, k.shape[2]), h, states, (tuple(kept) if keep else None)


def _native_forward_bf16(q, k, v, beta, g, h0, scale, chunk_size, low, check_finite=""):
    """The bf16-products inference forward by the compiled kernel (q, k, v as bf16 operands; the
    state, the solve and the sums fp32), or None where it does not apply."""
    if low != torch.bfloat16:
        return None
    mod = kernels_for_bf16(q, k, v, beta, g, h0, operands=True)
    if mod is None:
        return None
    q, k, check_finite = bf16_operands(check_finite, q, k, v)
    q, k, v = unit_last_stride(q, k, v)
    o, h = mod.chunk_delta_fwd_bf16(q, k, v, beta, g, h0, float(scale), int(chunk_size), check_finite)
    return from_chunk_buffer(o, k.shape[2]), h, h.new_empty(0), None


def chunk_delta_rule_fwd(q, k, v, beta, g, h0, scale, chunk_size, keep: bool = True, low: Optional[torch.dtype] = None,
                         native: bool = True, check_finite: str = ""):
    """Forward on head-first ``[N, H, T, ·]`` tensors, ``h0 [N·H, K, V]`` or None.

    Returns ``(o [N, H, T, V], h_T [N·H, K, V], states [NC, N·H, K, V], kept)``;
    ``states[c]`` is the state entering chunk c. ``kept`` is what the backward
    reuses, all flattened chunk-major (``[NC·N·H, C, ·]``): ``(q [.., K], kv [.., K + V],
    wu, inverses)`` with ``wu`` = [W | U'] and ``inverses`` the diagonal-block
    inverses X_j (``[nb, NC·N·H, C/nb, C/nb]``). With ``keep=False`` (no backward
    to come) ``kept`` is None and each group's flattened chunks exist only while
    it is worked on, so the transient memory is independent of T. ``low`` (bf16,
    only with ``keep=False``; ``fastweights.ops.precision``) gives the products
    operands of that dtype; the state, the decays and the triangular solve stay
    in the inputs' dtype. ``native``: the compiled CPU kernel may run it (backend ``"cpu"``);
    False runs the PyTorch code below whatever the device (backend ``"torch"``).
    ``check_finite`` (the op's name, or "" for none): the ops' finite check of q, k and v, made
    here instead of in the front end (the compiled kernel counts NaN/Inf while it gathers the rows,
    which it reads anyway; the PyTorch code runs the front end's check first).
    """
    if low is not None and keep:
        raise ValueError("chunk_delta_rule_fwd: `low` products are for inference only (keep=False)")
    compiled = _native_forward(q, k, v, beta, g, h0, scale, chunk_size, keep, low, check_finite) if native else None
    if compiled is not None:
        return compiled
    if check_finite:
        check_qkv_finite(check_finite, q, k, v)
    if low is None and v.dtype != beta.dtype:  # plain bf16 inputs the compiled kernel did not take: widen here
        q, k, v = (t.to(beta.dtype) for t in (q, k, v))
    n, nh, t_len, dk = k.shape
    dv = v.shape[-1]
    nc = -(-t_len // chunk_size)
    per = max(1, FORWARD_GROUP // (n * nh))
    acc = beta.dtype  # of the state, the solve and every sum (q, k, v may be bf16 with ``low``)
    states = v.new_empty(nc, n * nh, dk, dv, dtype=acc)
    rows = nc * n * nh
    if keep:
        q_flat, kv_flat = q.new_empty(rows, chunk_size, dk), k.new_empty(rows, chunk_size, dk + dv)
        wu, inverses = v.new_empty(rows, chunk_size, dk + dv), None
    o = chunk_buffer(v, n, nh, nc, chunk_size)  # in v's dtype: bf16 with bf16 inputs and ``low``
    h = v.new_zeros(n * nh, dk, dv, dtype=acc) if h0 is None else h0
    for c0 in range(0, nc, per):
        c1 = min(c0 + per, nc)
        r0, r1 = c0 * n * nh, c1 * n * nh
        bg, gg = (flat_chunks(t, chunk_size, c0, c1) for t in (beta, g))
        q_out = q_flat[r0:r1] if keep else (None if low is None else q.new_empty(r1 - r0, chunk_size, dk, dtype=low))
        qg = flat_chunks(q, chunk_size, c0, c1, out=q_out)
        kv = _flat_kv(k, v, chunk_size, c0, c1, kv_flat[r0:r1] if keep else None, dtype=low)
        wu_g = wu[r0:r1] if keep else v.new_empty(r1 - r0, chunk_size, dk + dv, dtype=acc)
        x = _Chunks(qg, kv, bg, gg, scale, backward=False, wu=wu_g, low=low)
        u_prime = wu_g.new_empty(wu_g.shape[:-1] + (dv,))
        if low is None:
            h = _delta_scan(x, h, states[c0:c1], u_prime)
            og = torch.bmm(x.scores, u_prime).baddbmm_(x.q_decayed, states[c0:c1].view(-1, dk, dv), alpha=scale)
        else:  # bf16 copies of the entering states and of U', made in the loop, serve the output's products
            states_low = states.new_empty((c1 - c0,) + states.shape[1:], dtype=low)
            u_low = u_prime.new_empty(u_prime.shape, dtype=low)
            h = _delta_scan(x, h, states[c0:c1], u_prime, low, states_low, u_low)
            og = torch.bmm(x.scores, u_low).to(acc).add_(torch.bmm(x.q_decayed, states_low.view(-1, dk, dv)), alpha=scale)
        put_chunks(o, og, c0)
        if keep:  # [W | U'] and X_j for the backward
            wu_g[..., dk:] = u_prime
            if inverses is None:
                inverses = v.new_empty((x.inverse_blocks.shape[0], rows) + x.inverse_blocks.shape[2:])
            inverses[:, r0:r1] = x.inverse_blocks
    kept = (q_flat, kv_flat, wu, inverses) if keep else None
    return from_chunk_buffer(o, t_len), h, states, kept


#: Chunk-heads per group in the backward: its transient tensors are O(group·C·(C + K + V)),
#: so the backward's peak memory stops growing with T beyond the saved tensors
#: (and, as in the forward, they stay small enough to be reused rather than fresh pages).
BACKWARD_GROUP = 64


def _input_grads(x, q, k, v, beta, do, du, states, dh_next, scale):
    """Steps 3-5 of README.md for one group, given its states h, dU' and state gradients dh_{c+1}."""
    decay = x.decay
    u_prime = x.u  # the forward's U' = U − W h
    # 3. Through [W | U] = (I + A)⁻¹ diag(β) [K_b | V]: dZ = (I + A)⁻ᵀ dY. Since dW = −dU hᵀ,
    #    dZ_W = −dZ_U hᵀ and dA = −tril(dZ_W Wᵀ + dZ_U Uᵀ, −1) = −tril(dZ_U U'ᵀ, −1).
    dz_u = block_substitution(x.a, x.inverse_blocks, du, transpose=True)
    u_prime_t, states_t = u_prime.transpose(-1, -2), states.transpose(-1, -2)
    d_scores = do @ u_prime_t  # dP
    minus_da = (dz_u @ u_prime_t).tril_(-1)
    d_q_decayed = torch.bmm(do, states_t).mul_(scale)
    minus_dz_w = dz_u @ states_t
    d_k_decayed = u_prime @ dh_next.transpose(-1, -2)
    d_last = None if decay.b is None else (states * dh_next).sum((-1, -2))

    k_b = x.k_b
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


def _state_grads(x, du, grads):
    """The backward's loop over one group's chunks, last chunk first (README.md, step 2).

    On entry ``du`` holds Pᵀ dO (``[NC·N·H, C, V]`` for the group's NC chunks) and
    ``grads [NC + 1, N·H, K, V]`` holds scale·Q_bᵀ dO_c in slot c and, in slot NC,
    the gradient of the state leaving the group's last chunk. In place, slot c
    becomes dh_c = e^{b_C} dh_{c+1} + scale·Q_bᵀ dO_c − W_cᵀ dU'_c and ``du`` becomes
    dU'_c = Pᵀ dO_c + K̄_c dh_{c+1}; so afterwards ``grads[1:]`` are the gradients
    of the states leaving the chunks and ``grads[0]`` that of the state entering
    the group.
    """
    nc, nh, dk, dv = grads.shape
    nc -= 1
    c = x.w.shape[-2]
    w_t = x.w.view(nc, nh, c, dk).transpose(-1, -2).unbind(0)
    k_decayed = x.k_decayed.view(nc, nh, c, dk).unbind(0)
    last = None if x.decay.last is None else x.decay.last.view(nc, nh, 1, 1).unbind(0)
    du, dh = du.view(nc, nh, c, dv).unbind(0), grads.unbind(0)
    for i in range(nc - 1, -1, -1):
        du_i = du[i].baddbmm_(k_decayed[i], dh[i + 1])
        carried = dh[i].add_(dh[i + 1]) if last is None else dh[i].addcmul_(dh[i + 1], last[i])
        carried.baddbmm_(w_t[i], du_i, alpha=-1.0)


def _native_backward(beta, g, states, kept, do, dh_final, scale, chunk_size):
    """:func:`chunk_delta_rule_bwd` by the compiled CPU kernel (one (sequence, head) per task, T
    recomputed per chunk instead of read from the kept inverse blocks), or None where it does not
    apply (as :func:`_native_forward`)."""
    q_flat, kv_flat, wu, _ = kept
    mod = kernels_for(states, beta, g, do, dh_final, q_flat, kv_flat, wu)
    if mod is None:
        return None
    do = unit_last_stride(do)
    t_len = beta.shape[-1]
    dq, dk, dv, dbeta, dg, dh0 = mod.chunk_delta_bwd(q_flat, kv_flat, wu, states, beta, g, do, dh_final, float(scale), int(chunk_size))
    grads = [from_chunk_buffer(t, t_len) for t in (dq, dk, dv, dbeta)]
    return (*grads, None if g is None else from_chunk_buffer(dg, t_len), dh0)


def chunk_delta_rule_bwd(beta, g, states, kept, do, dh_final, scale, chunk_size, native: bool = True):
    """Backward on head-first ``[N, H, T, ·]`` tensors; ``README.md`` in this folder derives every line.

    ``kept`` is the forward's ``(q, kv, wu, inverses)``, flattened chunk-major: the
    gathered inputs, [W | U'] and X_j. Works through the chunks in groups of
    :data:`BACKWARD_GROUP` chunk-heads, last group first: each group's intra-chunk
    terms (P and S) are recomputed once, its part of the state-gradient loop
    runs, and its input gradients are written before the next group's. The
    transient tensors are those of one group, O(group·C·(C + K + V)), independent of T.

    Returns ``(dq, dk, dv, dbeta, dg_or_None, dh0)``, the first five ``[N, H, T, ·]``;
    ``native`` as in :func:`chunk_delta_rule_fwd`.
    """
    compiled = _native_backward(beta, g, states, kept, do, dh_final, scale, chunk_size) if native else None
    if compiled is not None:
        return compiled
    q_flat, kv_flat, wu, inverses = kept
    nc, nhh, dk, dv = states.shape
    n, nh, t_len = beta.shape
    per = max(1, BACKWARD_GROUP // nhh)
    grads = [chunk_buffer(do, n, nh, nc, chunk_size, tail=(d,)) for d in (dk, dk, dv)]
    grads += [None if t is None else chunk_buffer(t, n, nh, nc, chunk_size) for t in (beta, g)]
    dh = dh_final
    for c0 in reversed(range(0, nc, per)):
        c1 = min(c0 + per, nc)
        r0, r1 = c0 * nhh, c1 * nhh
        q_ = q_flat[r0:r1]
        beta_, g_, do_ = (flat_chunks(t, chunk_size, c0, c1) for t in (beta, g, do))
        x = _Chunks(q_, kv_flat[r0:r1], beta_, g_, scale, backward=True, wu=wu[r0:r1], inverse_blocks=inverses[:, r0:r1])
        du = x.scores.transpose(-1, -2) @ do_  # Pᵀ dO, then dU'
        state_grads = states.new_empty(c1 - c0 + 1, nhh, dk, dv)  # dh_c, c = c0 .. c1 (_state_grads)
        torch.bmm(x.q_decayed.transpose(-1, -2), do_, out=state_grads[:-1].view(-1, dk, dv)).mul_(scale)
        state_grads[-1] = dh
        _state_grads(x, du, state_grads)
        dh, dh_next = state_grads[0], state_grads[1:]
        group = _input_grads(x, q_, x.k, x.v, beta_, do_, du, states[c0:c1].view(-1, dk, dv), dh_next.view(-1, dk, dv), scale)
        for buffer, grad in zip(grads, group):
            if buffer is not None:
                put_chunks(buffer, grad, c0)
        del x, du, dh_next, group
    return (*(None if b is None else from_chunk_buffer(b, t_len) for b in grads), dh)


# --------------------------------------------------------------------------------------
# The chunk form as a differentiable custom op (torch.library). torch.compile treats
# the forward and the backward as two opaque calls: the loops, the in-place updates
# of preallocated buffers and the group sizes above stay plain eager PyTorch, and a
# compiled graph has no break (and no unrolled loop) here. The fake implementations
# give the outputs' shapes and strides without computing.
# --------------------------------------------------------------------------------------


def _fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor], h0: Optional[Tensor],
    scale: float, chunk_size: int, keep: bool, bf16_products: bool = False, native: bool = True,
    check_finite: str = "",
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`chunk_delta_rule_fwd` with ``h0 [N, H, K, V]``; the states and kept tensors are empty when ``keep`` is False."""
    n, nh, _, dk = k.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, v.shape[-1])
    low = torch.bfloat16 if bf16_products else None
    with autocast_off(q.device):
        o, h_final, states, kept = chunk_delta_rule_fwd(q, k, v, beta, g, h0_, scale, chunk_size, keep, low, native,
                                                        check_finite)
    if not keep:  # the chunk states and the gathered inputs serve only a backward
        return (o, h_final) + tuple(q.new_empty(0) for _ in range(5))
    return (o, h_final, states) + kept


_fwd_op = torch.library.custom_op("fastweights::chunk_delta_rule_fwd", mutates_args=())(_fwd_impl)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, beta, g, h0, scale, chunk_size, keep, bf16_products=False, native=True, check_finite=""):
    n, nh, t_len, dk = k.shape
    dv = v.shape[-1]
    nc = -(-t_len // chunk_size)
    rows = nc * n * nh
    o = from_chunk_buffer(chunk_buffer(v, n, nh, nc, chunk_size), t_len)
    h_final = v.new_empty(n * nh, dk, dv, dtype=beta.dtype)
    if not keep:
        return (o, h_final) + tuple(q.new_empty(0) for _ in range(5))
    out = (o, h_final, v.new_empty(nc, n * nh, dk, dv, dtype=beta.dtype))
    nb = row_blocks(chunk_size, UT_BLOCKS)
    kv = k.new_empty(rows, chunk_size, dk + dv)
    return out + (q.new_empty(rows, chunk_size, dk), kv, torch.empty_like(kv),
                  v.new_empty(nb, rows, chunk_size // nb, chunk_size // nb))


@torch.library.custom_op("fastweights::chunk_delta_rule_bwd", mutates_args=())
def _bwd_op(
    beta: Tensor, g: Optional[Tensor], states: Tensor, q_flat: Tensor, kv_flat: Tensor, wu: Tensor,
    inverses: Tensor, do: Tensor, dh_final: Tensor, scale: float, chunk_size: int, native: bool = True,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`chunk_delta_rule_bwd`; ``dg`` is empty when ``g`` is None."""
    with autocast_off(do.device):
        grads = chunk_delta_rule_bwd(beta, g, states, (q_flat, kv_flat, wu, inverses), do, dh_final, scale, chunk_size,
                                     native)
    return tuple(beta.new_empty(0) if t is None else t for t in grads)


@_bwd_op.register_fake
def _bwd_fake(beta, g, states, q_flat, kv_flat, wu, inverses, do, dh_final, scale, chunk_size, native=True):
    nc, _, dk, dv = states.shape
    n, nh, t_len = beta.shape
    grads = [from_chunk_buffer(chunk_buffer(do, n, nh, nc, chunk_size, tail=(d,)), t_len) for d in (dk, dk, dv)]
    grads += [from_chunk_buffer(chunk_buffer(beta, n, nh, nc, chunk_size), t_len) for t in (beta, g) if t is not None]
    if g is None:
        grads.append(beta.new_empty(0))
    return (*grads, torch.empty_like(dh_final))


def _setup_context(ctx, inputs, output):
    q, k, v, beta, g, h0, scale, chunk_size, keep, _, native, _ = inputs
    _, _, states, *kept = output
    ctx.save_for_backward(beta, g, states, *kept)
    backward_only(ctx, states, *kept)
    ctx.scale, ctx.chunk_size, ctx.h0_shape = scale, chunk_size, None if h0 is None else h0.shape
    ctx.native = native


def _backward(ctx, do, dh_final, *unused):
    beta, g, states, *kept = ctx.saved_tensors
    if dh_final is None:
        dh_final = states.new_zeros(states.shape[1:])
    if do is None:  # only h_T was used
        n, nh, t_len = beta.shape
        do = states.new_zeros(n, nh, t_len, states.shape[-1])
    dq, dk, dv, dbeta, dg, dh0 = _bwd_op(beta, g, states, *kept, do, dh_final, ctx.scale, ctx.chunk_size, ctx.native)
    dg = None if g is None else dg
    dh0 = None if ctx.h0_shape is None else dh0.reshape(ctx.h0_shape)
    return dq, dk, dv, dbeta, dg, dh0, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@inference_op("fastweights::chunk_delta_rule_infer")
def _infer_op(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor], h0: Optional[Tensor], scale: float,
              chunk_size: int, bf16_products: bool = False, native: bool = True, check_finite: str = ""
              ) -> Tuple[Tensor, Tensor]:
    """``(o [N, H, T, V], h_T [N·H, K, V])``: the forward when no backward follows (nothing kept;
    :func:`_fwd_impl` with ``keep=False``). Eager code calls it without the custom op's dispatch,
    ``torch.compile`` sees the op (:class:`~fastweights.ops._backend.InferenceOp`), as KDA's and
    linear attention's inference forwards."""
    o, h_final, *_ = _fwd_impl(q, k, v, beta, g, h0, scale, chunk_size, False, bf16_products, native, check_finite)
    return o, h_final


@_infer_op.register_fake
def _infer_fake(q, k, v, beta, g, h0, scale, chunk_size, bf16_products=False, native=True, check_finite=""):
    o, h_final, *_ = _fwd_fake(q, k, v, beta, g, h0, scale, chunk_size, False)
    return o, h_final


def delta_rule_chunk(
    q, k, v, beta, g, h0, scale, chunk_size, keep: Optional[bool] = None, low: Optional[torch.dtype] = None,
    native: bool = True, check_finite: str = "",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (gated) delta rule's chunk form with its hand-written backward; returns ``(o, h_T)``.

    On head-first compute-dtype tensors ``[N, H, T, D]`` (``g``/``h0`` may be None;
    ``g=None`` is the plain rule). Gradients reach q, k, v, beta, g and h0, and the
    cotangent of h_T is honoured.

    Memory kept for the backward: the inputs (O(T·(2K + V)) per head; q, k, v as the
    forward gathered them, chunk-major),
    [W | U'] (T·(K + V)), the diagonal-block inverses (T·C/4) and the T/C states
    entering the chunks (O((T/C)·K·V)). The backward recomputes P and S group by
    group (transient O(group·C·(C + K + V))). ``keep`` (default
    :func:`~fastweights.ops._backend.backward_can_follow`) says whether to keep
    anything for a backward: nothing is kept for inference.
    Double backward is not supported: use the recurrent or parallel form, which
    keep plain autograd, for higher derivatives. ``low=torch.bfloat16`` (set by the
    front end under :func:`fastweights.ops.bf16_products` for bf16 inputs) gives an
    inference forward bf16 product operands; it is ignored when a backward may follow.
    ``native`` (the spec's ``cpu`` solver; ``False`` for its ``torch`` one): whether the
    compiled CPU kernels may run the forward and the backward where they apply.
    ``check_finite``: the op's name when the front end left the finite check of q, k, v to the
    solver (:attr:`~fastweights.ops._spec.OpSpec.fused_finite_check`), else "".
    """
    if keep is None:
        keep = backward_can_follow(q, k, v, beta, g, h0)
    low_products = low is not None and not keep
    if not keep and not backward_can_follow(q, k, v, beta, g, h0):  # inference: the op without autograd
        o, h_final = _infer_op(q, k, v, beta, g, h0, float(scale), int(chunk_size), low_products, native, check_finite)
    else:
        o, h_final, *_ = _fwd_op(q, k, v, beta, g, h0, float(scale), int(chunk_size), keep, low_products, native,
                                 check_finite)
    return o, h_final.view(k.shape[0], k.shape[1], *h_final.shape[1:])


#: The delta rule's chunk op, declared once (``fastweights/ops/_spec.py``): the PyTorch solver and the
#: compiled CPU one are :func:`delta_rule_chunk` without and with the kernels; the Triton kernels run
#: it too; it takes bf16 product operands and plain bf16 inputs, and has no double backward.
CHUNK_DELTA_RULE = OpSpec(
    "chunk_delta_rule", Rule.DELTA, Form.CHUNK, torch=functools.partial(delta_rule_chunk, native=False),
    cpu=delta_rule_chunk, triton=True, low_products=True, reads_bf16_inputs=True, single_backward=True,
    fused_finite_check=True, step=delta_rule_step,
)


#: The public function moved to api.py (its old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.delta_rule.api", "chunk_delta_rule")
