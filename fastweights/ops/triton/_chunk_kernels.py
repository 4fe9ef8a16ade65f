"""Triton kernels of the chunk (gated) delta rule: forward and backward.

Imported lazily by :mod:`fastweights.ops.triton.chunk` (Triton decides at import
time whether ``@triton.jit`` compiles for the GPU or runs on numpy under
``TRITON_INTERPRET=1``). The maths is ``delta_rule/chunk.py``'s, regrouped for
kernels; symbols, per head and chunk of C = 64 tokens:

    b      = cumsum(g) inside the chunk, Γ[r, i] = e^{b_r − b_i}     (bcum)
    S      = K Kᵀ ⊙ Γ, strictly lower;  A = diag(β) S
    A⁻     = (I + A)⁻¹                                              (ainv)
    W      = A⁻ diag(β) (K ⊙ e^b),  U = A⁻ diag(β) V                (w, u)
    U'     = U − W h                                                pseudo-values
    P      = scale · tril(Q Kᵀ ⊙ Γ), diagonal included
    O      = scale · (Q ⊙ e^b) h + P U'
    h     ← e^{b_C} h + (K ⊙ e^{b_C − b})ᵀ U'

Kernels (grids in brackets; NT = chunks over all sequences, N = sequences):

forward
  ``_wy_fwd_kernel``     [NT, H]      b, K Kᵀ, the 64×64 inverse (16×16 diagonal
                                      blocks by substitution, merged blockwise), W, U.
  ``_state_fwd_kernel``  [N·H, V/BV]  the sequential part: U', O and h per chunk,
                                      state kept in registers; optionally saves the
                                      state entering every chunk for the backward.
backward
  ``_state_bwd_kernel``  [N·H, V/BV]  dU' = Pᵀ dO + K̄ dh and, chunks in reverse,
                                      dh ← e^{b_C} dh + scale·Q_bᵀ dO − Wᵀ dU'.
  ``_grads_kernel``      [NT, H]      every input gradient from chunk-local terms
                                      (the UT-transform adjoint, P, K̄, the decays).

Layout: q, k ``[TT, H, K]``, v ``[TT, H, V]``, beta, g ``[TT, H]`` with TT the
tokens of all sequences packed (``B·T`` for a plain batch); sequences are given
by ``cu_seqlens`` and every chunk by ``chunk_indices`` (sequence, chunk-in-sequence),
so varlen costs nothing extra. Per-chunk states are ``[NT, H, K, V]`` fp32,
indexed through ``chunk_offsets`` (first chunk of each sequence). Every load is
cast to fp32 and every ``tl.dot`` accumulates in fp32 with ``PREC`` input
precision ("ieee" for fp32 inputs, "tf32" for bf16/fp16).
"""

from __future__ import annotations

import triton
import triton.language as tl


# ---------------------------------------------------------------------------- helpers


@triton.jit
def _load_tile(ptr, row0, row_end, stride, cols, BR: tl.constexpr, BC: tl.constexpr):
    """Rows ``row0 .. row0+BR`` (those < row_end) and the first ``cols`` columns, as fp32, zero elsewhere."""
    rows = row0 + tl.arange(0, BR)
    c = tl.arange(0, BC)
    mask = (rows < row_end)[:, None] & (c < cols)[None, :]
    return tl.load(ptr + rows[:, None] * stride + c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_tile(ptr, x, row0, row_end, stride, cols, BR: tl.constexpr, BC: tl.constexpr):
    rows = row0 + tl.arange(0, BR)
    c = tl.arange(0, BC)
    mask = (rows < row_end)[:, None] & (c < cols)[None, :]
    tl.store(ptr + rows[:, None] * stride + c[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_vec(ptr, row0, row_end, stride, BR: tl.constexpr):
    rows = row0 + tl.arange(0, BR)
    return tl.load(ptr + rows * stride, mask=rows < row_end, other=0.0).to(tl.float32)


@triton.jit
def _load_decay(ptr, row0, row_end, stride, BR: tl.constexpr):
    """(b, b_C) of a chunk: b past the sequence end continues as b_C (padding has g = 0).

    Padding rows must not read b = 0: e^{b_r − b_i} with b_i < 0 would overflow,
    and inf · 0 would poison the real rows through the matmuls.
    """
    rows = row0 + tl.arange(0, BR)
    b_last = tl.load(ptr + (tl.minimum(row0 + BR, row_end) - 1) * stride).to(tl.float32)
    b = tl.load(ptr + rows * stride, mask=rows < row_end, other=0.0).to(tl.float32)
    return tl.where(rows < row_end, b, b_last), b_last


@triton.jit
def _load_state(ptr, K, V, i_v, BK: tl.constexpr, BV: tl.constexpr):
    """Block ``[:, i_v·BV : (i_v+1)·BV]`` of a ``[K, V]`` fp32 state at ``ptr``."""
    r = tl.arange(0, BK)
    c = i_v * BV + tl.arange(0, BV)
    mask = (r < K)[:, None] & (c < V)[None, :]
    return tl.load(ptr + r[:, None] * V + c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_state(ptr, x, K, V, i_v, BK: tl.constexpr, BV: tl.constexpr):
    r = tl.arange(0, BK)
    c = i_v * BV + tl.arange(0, BV)
    mask = (r < K)[:, None] & (c < V)[None, :]
    tl.store(ptr + r[:, None] * V + c[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _state_offset(index, K: tl.constexpr, V: tl.constexpr):
    """Element offset of state ``index`` in a ``[·, K, V]`` array, in int64: (chunk·H + head)·K·V
    passes 2³¹ at 512k tokens (H = 16, K = V = 128), and (sequence·H + head)·K·V at N·H = 32,768
    (K = V = 256)."""
    return index.to(tl.int64) * (K * V)


@triton.jit
def _chunk_bounds(cu_seqlens, chunk_indices, i_t, BT: tl.constexpr):
    """(start token, end of its sequence) of global chunk ``i_t``."""
    i_n = tl.load(chunk_indices + 2 * i_t).to(tl.int64)
    i_c = tl.load(chunk_indices + 2 * i_t + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return bos + i_c * BT, eos


@triton.jit
def _decay_mask(b_rows, b_cols, mask):
    """``exp(b_r − b_c)`` where ``mask``, else 0; the exponent is masked first so it cannot overflow."""
    return tl.where(mask, tl.exp(tl.where(mask, b_rows[:, None] - b_cols[None, :], 0.0)), 0.0)


@triton.jit
def _gram_block(ki, kj, bi, bj, beta_i, DIAG: tl.constexpr, GATED: tl.constexpr, PREC: tl.constexpr):
    """One 16×16 block of A = diag(β) (K Kᵀ ⊙ Γ), strictly lower on the diagonal."""
    s = tl.dot(ki, tl.trans(kj), input_precision=PREC)
    r = tl.arange(0, 16)
    if DIAG:
        mask = r[:, None] > r[None, :]
    else:
        mask = r[:, None] >= 0
    if GATED:
        s = s * _decay_mask(bi, bj, mask)
    else:
        s = tl.where(mask, s, 0.0)
    return s * beta_i[:, None]


@triton.jit
def _unit_lower_inverse16(a):
    """(I + a)⁻¹ for a strictly lower 16×16 ``a``: forward substitution, one row per step.

    Row i of the inverse is e_i − Σ_{j<i} a[i, j] · (row j of the inverse); rows
    are final once written, so 15 masked rank-1 reductions build it in registers.
    """
    r = tl.arange(0, 16)
    x = (r[:, None] == r[None, :]).to(tl.float32)
    for i in tl.static_range(1, 16):
        a_i = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)  # row i of a, [16]
        x_i = tl.sum(a_i[:, None] * x, axis=0)  # Σ_j a[i, j] x[j, :]
        x = tl.where(r[:, None] == i, x - x_i[None, :], x)
    return x


# ---------------------------------------------------------------------------- forward


@triton.jit
def _wy_fwd_kernel(
    k, v, beta, g, bcum, ainv, w, u, cu_seqlens, chunk_indices,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, PREC: tl.constexpr,
):
    """One chunk: b = cumsum(g), A⁻ = (I + A)⁻¹ (stored), W and U (stored).

    The 64×64 unit lower-triangular I + A is handled as 4×4 blocks of 16: the four
    diagonal blocks are inverted by substitution in registers, then the blocks
    below the diagonal follow from X_ij = −X_ii Σ_{j≤m<i} A_im X_mj (blocked
    forward substitution, as stable as the row-by-row one). A⁻ goes to memory
    (the backward needs it) and comes back as one 64×64 tile for W and U.
    """
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, eos = _chunk_bounds(cu_seqlens, chunk_indices, i_t, BT)
    k_h = k + i_h * K
    sk = H * K

    # 16-row blocks of K, β and b.
    k0 = _load_tile(k_h, t0, eos, sk, K, 16, BK)
    k1 = _load_tile(k_h, t0 + 16, eos, sk, K, 16, BK)
    k2 = _load_tile(k_h, t0 + 32, eos, sk, K, 16, BK)
    k3 = _load_tile(k_h, t0 + 48, eos, sk, K, 16, BK)
    be0 = _load_vec(beta + i_h, t0, eos, H, 16)
    be1 = _load_vec(beta + i_h, t0 + 16, eos, H, 16)
    be2 = _load_vec(beta + i_h, t0 + 32, eos, H, 16)
    be3 = _load_vec(beta + i_h, t0 + 48, eos, H, 16)
    if GATED:
        g0 = _load_vec(g + i_h, t0, eos, H, 16)
        g1 = _load_vec(g + i_h, t0 + 16, eos, H, 16)
        g2 = _load_vec(g + i_h, t0 + 32, eos, H, 16)
        g3 = _load_vec(g + i_h, t0 + 48, eos, H, 16)
        b0 = tl.cumsum(g0, axis=0)
        b1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
        b2 = tl.cumsum(g2, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0)
        b3 = tl.cumsum(g3, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0)
        r16 = tl.arange(0, 16)
        tl.store(bcum + (t0 + r16) * H + i_h, b0, mask=t0 + r16 < eos)
        tl.store(bcum + (t0 + 16 + r16) * H + i_h, b1, mask=t0 + 16 + r16 < eos)
        tl.store(bcum + (t0 + 32 + r16) * H + i_h, b2, mask=t0 + 32 + r16 < eos)
        tl.store(bcum + (t0 + 48 + r16) * H + i_h, b3, mask=t0 + 48 + r16 < eos)
    else:
        b0 = be0 * 0.0
        b1 = b0
        b2 = b0
        b3 = b0

    # Blocks of A (i > j full, i = j strictly lower).
    a00 = _gram_block(k0, k0, b0, b0, be0, True, GATED, PREC)
    a11 = _gram_block(k1, k1, b1, b1, be1, True, GATED, PREC)
    a22 = _gram_block(k2, k2, b2, b2, be2, True, GATED, PREC)
    a33 = _gram_block(k3, k3, b3, b3, be3, True, GATED, PREC)
    a10 = _gram_block(k1, k0, b1, b0, be1, False, GATED, PREC)
    a20 = _gram_block(k2, k0, b2, b0, be2, False, GATED, PREC)
    a21 = _gram_block(k2, k1, b2, b1, be2, False, GATED, PREC)
    a30 = _gram_block(k3, k0, b3, b0, be3, False, GATED, PREC)
    a31 = _gram_block(k3, k1, b3, b1, be3, False, GATED, PREC)
    a32 = _gram_block(k3, k2, b3, b2, be3, False, GATED, PREC)

    # Diagonal inverses, then the blocks below them, one block-diagonal at a time.
    x00 = _unit_lower_inverse16(a00)
    x11 = _unit_lower_inverse16(a11)
    x22 = _unit_lower_inverse16(a22)
    x33 = _unit_lower_inverse16(a33)
    x10 = -tl.dot(tl.dot(x11, a10, input_precision=PREC), x00, input_precision=PREC)
    x21 = -tl.dot(tl.dot(x22, a21, input_precision=PREC), x11, input_precision=PREC)
    x32 = -tl.dot(tl.dot(x33, a32, input_precision=PREC), x22, input_precision=PREC)
    x20 = -tl.dot(x22, tl.dot(a20, x00, input_precision=PREC) + tl.dot(a21, x10, input_precision=PREC),
                  input_precision=PREC)
    x31 = -tl.dot(x33, tl.dot(a31, x11, input_precision=PREC) + tl.dot(a32, x21, input_precision=PREC),
                  input_precision=PREC)
    x30 = -tl.dot(
        x33,
        tl.dot(a30, x00, input_precision=PREC) + tl.dot(a31, x10, input_precision=PREC)
        + tl.dot(a32, x20, input_precision=PREC),
        input_precision=PREC,
    )

    a_h = ainv + i_h * BT
    sa = H * BT
    zero = x00 * 0.0
    _store_tile(a_h, x00, t0, eos, sa, BT, 16, 16)
    _store_tile(a_h + 16, zero, t0, eos, sa, BT, 16, 16)
    _store_tile(a_h + 32, zero, t0, eos, sa, BT, 16, 16)
    _store_tile(a_h + 48, zero, t0, eos, sa, BT, 16, 16)
    _store_tile(a_h, x10, t0 + 16, eos, sa, BT, 16, 16)
    _store_tile(a_h + 16, x11, t0 + 16, eos, sa, BT, 16, 16)
    _store_tile(a_h + 32, zero, t0 + 16, eos, sa, BT, 16, 16)
    _store_tile(a_h + 48, zero, t0 + 16, eos, sa, BT, 16, 16)
    _store_tile(a_h, x20, t0 + 32, eos, sa, BT, 16, 16)
    _store_tile(a_h + 16, x21, t0 + 32, eos, sa, BT, 16, 16)
    _store_tile(a_h + 32, x22, t0 + 32, eos, sa, BT, 16, 16)
    _store_tile(a_h + 48, zero, t0 + 32, eos, sa, BT, 16, 16)
    _store_tile(a_h, x30, t0 + 48, eos, sa, BT, 16, 16)
    _store_tile(a_h + 16, x31, t0 + 48, eos, sa, BT, 16, 16)
    _store_tile(a_h + 32, x32, t0 + 48, eos, sa, BT, 16, 16)
    _store_tile(a_h + 48, x33, t0 + 48, eos, sa, BT, 16, 16)
    # Written by this program, read back by this program: a CTA barrier makes the
    # stores visible (the lines were never cached in this SM's L1 before).
    tl.debug_barrier()
    a_full = _load_tile(a_h, t0, eos, sa, BT, BT, BT)

    be = _load_vec(beta + i_h, t0, eos, H, BT)
    kb = _load_tile(k_h, t0, eos, sk, K, BT, BK)
    if GATED:
        b = tl.cumsum(_load_vec(g + i_h, t0, eos, H, BT), axis=0)
        kb = kb * (be * tl.exp(b))[:, None]
    else:
        kb = kb * be[:, None]
    _store_tile(w + i_h * K, tl.dot(a_full, kb, input_precision=PREC), t0, eos, sk, K, BT, BK)
    for i_v in tl.static_range(0, (V + BV - 1) // BV):
        vb = _load_tile(v + i_h * V + i_v * BV, t0, eos, H * V, V - i_v * BV, BT, BV) * be[:, None]
        _store_tile(u + i_h * V + i_v * BV, tl.dot(a_full, vb, input_precision=PREC), t0, eos, H * V,
                    V - i_v * BV, BT, BV)


@triton.jit
def _state_fwd_kernel(
    q, k, w, u, bcum, o, h0, h_final, states, cu_seqlens, chunk_offsets, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, SAVE_STATES: tl.constexpr,
    PREC: tl.constexpr,
):
    """One (sequence, head, V-block): the chunks in order, the state in registers.

    Per chunk: U' = U − W h; O = scale·(Q ⊙ e^b) h + P U'; h ← e^{b_C} h + K̄ᵀ U'.
    The V columns of the recurrence are independent, so V-blocks run in parallel.
    """
    i_nh = tl.program_id(0)  # N·H on axis 0: CUDA caps axes 1 and 2 at 65,535
    i_v = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    first = tl.load(chunk_offsets + i_n).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, BT)
    sk = H * K
    sv = H * V
    v0 = i_v * BV
    r = tl.arange(0, BT)
    causal = r[:, None] >= r[None, :]

    if HAS_H0:
        h = _load_state(h0 + _state_offset(i_nh, K, V), K, V, i_v, BK, BV)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_c in range(0, n_chunks):
        if SAVE_STATES:
            _store_state(states + _state_offset((first + i_c) * H + i_h, K, V), h, K, V, i_v, BK, BV)
        t0 = bos + i_c * BT
        q_c = _load_tile(q + i_h * K, t0, eos, sk, K, BT, BK)
        k_c = _load_tile(k + i_h * K, t0, eos, sk, K, BT, BK)
        w_c = _load_tile(w + i_h * K, t0, eos, sk, K, BT, BK)
        u_c = _load_tile(u + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
        u_c = u_c - tl.dot(w_c, h, input_precision=PREC)  # U'
        scores = tl.dot(q_c, tl.trans(k_c), input_precision=PREC) * scale
        if GATED:
            b, b_last = _load_decay(bcum + i_h, t0, eos, H, BT)
            scores = scores * _decay_mask(b, b, causal)
            out = tl.dot(q_c * tl.exp(b)[:, None], h, input_precision=PREC) * scale
            out += tl.dot(scores, u_c, input_precision=PREC)
            k_bar = k_c * tl.exp(b_last - b)[:, None]
            h = h * tl.exp(b_last) + tl.dot(tl.trans(k_bar), u_c, input_precision=PREC)
        else:
            scores = tl.where(causal, scores, 0.0)
            out = tl.dot(q_c, h, input_precision=PREC) * scale
            out += tl.dot(scores, u_c, input_precision=PREC)
            h = h + tl.dot(tl.trans(k_c), u_c, input_precision=PREC)
        _store_tile(o + i_h * V + v0, out, t0, eos, sv, V - v0, BT, BV)
    if STORE_FINAL:
        _store_state(h_final + _state_offset(i_nh, K, V), h, K, V, i_v, BK, BV)


# ---------------------------------------------------------------------------- backward


@triton.jit
def _state_bwd_kernel(
    q, k, w, bcum, do, dh_final, dh0, dstates, du, cu_seqlens, chunk_offsets, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
):
    """The adjoint of the state recurrence, chunks in reverse, per (sequence, head, V-block).

    With dh the gradient of the state leaving chunk c (saved per chunk):
        dU' = Pᵀ dO + K̄ dh                              (stored)
        dh ← e^{b_C} dh + scale·(Q ⊙ e^b)ᵀ dO − Wᵀ dU'   (the gradient entering chunk c)
    """
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    first = tl.load(chunk_offsets + i_n).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, BT)
    sk = H * K
    sv = H * V
    v0 = i_v * BV
    r = tl.arange(0, BT)
    causal = r[:, None] >= r[None, :]

    if HAS_DHT:
        dh = _load_state(dh_final + _state_offset(i_nh, K, V), K, V, i_v, BK, BV)
    else:
        dh = tl.zeros([BK, BV], dtype=tl.float32)
    for j in range(0, n_chunks):
        i_c = n_chunks - 1 - j
        _store_state(dstates + _state_offset((first + i_c) * H + i_h, K, V), dh, K, V, i_v, BK, BV)
        t0 = bos + i_c * BT
        q_c = _load_tile(q + i_h * K, t0, eos, sk, K, BT, BK)
        k_c = _load_tile(k + i_h * K, t0, eos, sk, K, BT, BK)
        w_c = _load_tile(w + i_h * K, t0, eos, sk, K, BT, BK)
        do_c = _load_tile(do + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
        scores = tl.dot(q_c, tl.trans(k_c), input_precision=PREC) * scale
        if GATED:
            b, b_last = _load_decay(bcum + i_h, t0, eos, H, BT)
            scores = scores * _decay_mask(b, b, causal)
            k_bar = k_c * tl.exp(b_last - b)[:, None]
            q_c = q_c * tl.exp(b)[:, None]
        else:
            scores = tl.where(causal, scores, 0.0)
            k_bar = k_c
        du_c = tl.dot(tl.trans(scores), do_c, input_precision=PREC) + tl.dot(k_bar, dh, input_precision=PREC)
        _store_tile(du + i_h * V + v0, du_c, t0, eos, sv, V - v0, BT, BV)
        if GATED:
            dh = dh * tl.exp(b_last)
        dh += tl.dot(tl.trans(q_c), do_c, input_precision=PREC) * scale
        dh -= tl.dot(tl.trans(w_c), du_c, input_precision=PREC)
    if STORE_DH0:
        _store_state(dh0 + _state_offset(i_nh, K, V), dh, K, V, i_v, BK, BV)


@triton.jit
def _grads_kernel(
    q, k, v, beta, bcum, ainv, w, u, states, dstates, do, du,
    dq, dk, dv, dbeta, dg, cu_seqlens, chunk_indices, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, PREC: tl.constexpr,
):
    """Every input gradient of one chunk from chunk-local terms (no sequential dependency).

    Given h (entering), dh (leaving) and dU' from the state kernels:
        dQ_b = scale·dO hᵀ,  dP = dO U'ᵀ,  dK̄ = U' dhᵀ,  dW = −dU' hᵀ,  dU = dU'
    then the UT transform Y = [W | U] = A⁻ diag(β) [K_b | V]:
        dZ = A⁻ᵀ dY,  dA = −tril(dZ Yᵀ, −1),  dv = β dZ_U,  dK_b = β dZ_W,
        dβ = rowsum(dZ ⊙ [K_b | V]) + rowsum(dA ⊙ S),  dS = diag(β) dA,
    and the decays: each of Q_b, K̄, K_b, e^{b_C}, P's Γ and S's Γ adds to db
    (a pair-wise Γ adds rowsum − colsum of dM ⊙ M); dg = reverse cumsum of db.
    """
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, eos = _chunk_bounds(cu_seqlens, chunk_indices, i_t, BT)
    sk = H * K
    sv = H * V
    r = tl.arange(0, BT)
    causal = r[:, None] >= r[None, :]
    strict = r[:, None] > r[None, :]

    q_c = _load_tile(q + i_h * K, t0, eos, sk, K, BT, BK)
    k_c = _load_tile(k + i_h * K, t0, eos, sk, K, BT, BK)
    w_c = _load_tile(w + i_h * K, t0, eos, sk, K, BT, BK)
    be = _load_vec(beta + i_h, t0, eos, H, BT)
    a_inv = _load_tile(ainv + i_h * BT, t0, eos, H * BT, BT, BT, BT)
    state = states + _state_offset(i_t * H + i_h, K, V)
    dstate = dstates + _state_offset(i_t * H + i_h, K, V)

    d_qb = tl.zeros([BT, BK], dtype=tl.float32)  # dO hᵀ (times scale later)
    d_kbar = tl.zeros([BT, BK], dtype=tl.float32)  # U' dhᵀ
    d_w = tl.zeros([BT, BK], dtype=tl.float32)  # −dU' hᵀ
    d_scores = tl.zeros([BT, BT], dtype=tl.float32)  # dO U'ᵀ
    d_a = tl.zeros([BT, BT], dtype=tl.float32)  # −dZ Yᵀ, accumulated over V-blocks and W
    d_beta = tl.zeros([BT], dtype=tl.float32)
    h_dh = tl.zeros([BK, BV], dtype=tl.float32)  # Σ h ⊙ dh for the chunk decay e^{b_C}
    for i_v in tl.static_range(0, (V + BV - 1) // BV):
        v0 = i_v * BV
        h = _load_state(state, K, V, i_v, BK, BV)
        dh = _load_state(dstate, K, V, i_v, BK, BV)
        u_c = _load_tile(u + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
        v_c = _load_tile(v + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
        do_c = _load_tile(do + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
        du_c = _load_tile(du + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
        u_prime = u_c - tl.dot(w_c, h, input_precision=PREC)
        d_qb += tl.dot(do_c, tl.trans(h), input_precision=PREC)
        d_kbar += tl.dot(u_prime, tl.trans(dh), input_precision=PREC)
        d_w -= tl.dot(du_c, tl.trans(h), input_precision=PREC)
        d_scores += tl.dot(do_c, tl.trans(u_prime), input_precision=PREC)
        dz_u = tl.dot(tl.trans(a_inv), du_c, input_precision=PREC)
        _store_tile(dv + i_h * V + v0, dz_u * be[:, None], t0, eos, sv, V - v0, BT, BV)
        d_beta += tl.sum(dz_u * v_c, axis=1)
        d_a -= tl.dot(dz_u, tl.trans(u_c), input_precision=PREC)
        if GATED:
            h_dh += h * dh

    dz_w = tl.dot(tl.trans(a_inv), d_w, input_precision=PREC)
    d_a -= tl.dot(dz_w, tl.trans(w_c), input_precision=PREC)
    d_a = tl.where(strict, d_a, 0.0)
    gram = tl.dot(k_c, tl.trans(k_c), input_precision=PREC)
    scores = tl.dot(q_c, tl.trans(k_c), input_precision=PREC) * scale
    d_scores = tl.where(causal, d_scores, 0.0)
    if GATED:
        b, b_last = _load_decay(bcum + i_h, t0, eos, H, BT)
        e_b = tl.exp(b)
        k_b = k_c * e_b[:, None]
        s = gram * _decay_mask(b, b, strict)
        scores = scores * _decay_mask(b, b, causal)
    else:
        k_b = k_c
        s = tl.where(strict, gram, 0.0)
        scores = tl.where(causal, scores, 0.0)
    d_beta += tl.sum(dz_w * k_b, axis=1) + tl.sum(d_a * s, axis=1)
    d_kb = dz_w * be[:, None]
    d_s = d_a * be[:, None]

    if GATED:
        d_gram = d_s * _decay_mask(b, b, strict)
        d_qk = d_scores * scale * _decay_mask(b, b, causal)
        d_q = d_qb * (scale * e_b)[:, None] + tl.dot(d_qk, k_c, input_precision=PREC)
        k_bar_scale = tl.exp(b_last - b)
        d_k = d_kbar * k_bar_scale[:, None] + d_kb * e_b[:, None]
        # db: Q_b, K̄ (rows), K_b, then P's and S's pairwise decays; e^{b_C} and K̄'s b_C part last.
        e_p = d_scores * scores
        e_s = d_s * s
        k_bar_term = tl.sum(d_kbar * k_c * k_bar_scale[:, None], axis=1)
        db = tl.sum(d_qb * q_c, axis=1) * scale * e_b - k_bar_term + tl.sum(d_kb * k_b, axis=1)
        db += tl.sum(e_p, axis=1) - tl.sum(e_p, axis=0) + tl.sum(e_s, axis=1) - tl.sum(e_s, axis=0)
        db_last = tl.sum(k_bar_term, axis=0) + tl.exp(b_last) * tl.sum(tl.sum(h_dh, axis=1), axis=0)
        # b_C is the b of the chunk's last token; padded rows past the end carry g = 0,
        # so adding db_C to row BT − 1 reaches every real token through the reverse cumsum.
        db += tl.where(r == BT - 1, db_last, 0.0)
        tl.store(dg + (t0 + r) * H + i_h, tl.cumsum(db, axis=0, reverse=True).to(dg.dtype.element_ty),
                 mask=t0 + r < eos)
    else:
        d_gram = d_s
        d_qk = d_scores * scale
        d_q = d_qb * scale + tl.dot(d_qk, k_c, input_precision=PREC)
        d_k = d_kbar + d_kb
    d_k += tl.dot(tl.trans(d_qk), q_c, input_precision=PREC)
    d_k += tl.dot(d_gram, k_c, input_precision=PREC) + tl.dot(tl.trans(d_gram), k_c, input_precision=PREC)
    _store_tile(dq + i_h * K, d_q, t0, eos, sk, K, BT, BK)
    _store_tile(dk + i_h * K, d_k, t0, eos, sk, K, BT, BK)
    tl.store(dbeta + (t0 + r) * H + i_h, d_beta.to(dbeta.dtype.element_ty), mask=t0 + r < eos)
