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
  ``_wy_fwd_kernel``       [NT, H]      b, K Kᵀ, the 64×64 inverse (16×16 diagonal
                                        blocks by substitution, merged blockwise), W, U.
  ``_state_fwd_kernel``    [N·H, V/BV]  the sequential part: U', O and h per chunk,
                                        state kept in registers; for a backward it
                                        also saves the state entering every chunk
                                        and writes U' over U.
backward
  ``_state_bwd_kernel``    [N·H, V/BV]  dU' = Pᵀ dO + K̄ dh and, chunks in reverse,
                                        dh ← e^{b_C} dh + scale·Q_bᵀ dO − Wᵀ dU'.
  ``_grads_intra_kernel``  [NT, H]      the chunk's C×C terms: dZ_U = A⁻ᵀ dU' (written
                                        over dU'), dv, dP and dA, and the parts of dβ
                                        and db that need all of K at once.
  ``_grads_key_kernel``    [NT, H]      dq, dk, the rest of dβ and db, and dg, one
                                        64-column block of K at a time (registers).

Layout: q, k ``[TT, H, K]``, v ``[TT, H, V]``, beta, g ``[TT, H]`` with TT the
tokens of all sequences packed (``B·T`` for a plain batch); sequences are given
by ``cu_seqlens`` and every chunk by ``chunk_indices`` (sequence, chunk-in-sequence),
so varlen costs nothing extra. Per-chunk states are ``[NT, H, K, V]``, indexed
through ``chunk_offsets`` (first chunk of each sequence).

Precision: ``tl.dot`` takes its operands in the input dtype and accumulates in
fp32 (bf16/fp16 operands run at the tensor cores' full rate; fp32 operands use
``PREC``, see ``chunk.py``). Fp32 intermediates that feed a product (h, U', P,
the decayed keys) are rounded to the input dtype first, and W, U', A⁻ and the
saved chunk states are stored in it; decays, b, the running state and every
accumulator stay fp32. With fp32 inputs nothing is rounded.
"""

from __future__ import annotations

import triton
import triton.language as tl


# ---------------------------------------------------------------------------- helpers


@triton.jit
def _load_tile(ptr, row0, row_end, stride, cols, BR: tl.constexpr, BC: tl.constexpr):
    """Rows ``row0 .. row0+BR`` (those < row_end) and the first ``cols`` columns, in the stored dtype, zero elsewhere."""
    rows = row0 + tl.arange(0, BR)
    c = tl.arange(0, BC)
    mask = (rows < row_end)[:, None] & (c < cols)[None, :]
    return tl.load(ptr + rows[:, None] * stride + c[None, :], mask=mask, other=0.0)


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
def _store_vec(ptr, x, row0, row_end, stride, BR: tl.constexpr):
    rows = row0 + tl.arange(0, BR)
    tl.store(ptr + rows * stride, x.to(ptr.dtype.element_ty), mask=rows < row_end)


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
def _state_offset(index, K: tl.constexpr, V: tl.constexpr):
    """Element offset of state ``index`` in a ``[·, K, V]`` array, in int64: (chunk·H + head)·K·V
    passes 2³¹ at 512k tokens (H = 16, K = V = 128), and (sequence·H + head)·K·V at N·H = 32,768
    (K = V = 256)."""
    return index.to(tl.int64) * (K * V)


@triton.jit
def _load_state(ptr, K, V, k0, v0, BR: tl.constexpr, BC: tl.constexpr):
    """Block ``[k0 : k0+BR, v0 : v0+BC]`` of a ``[K, V]`` state at ``ptr``, as fp32."""
    r = k0 + tl.arange(0, BR)
    c = v0 + tl.arange(0, BC)
    mask = (r < K)[:, None] & (c < V)[None, :]
    return tl.load(ptr + r[:, None] * V + c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_state(ptr, x, K, V, k0, v0, BR: tl.constexpr, BC: tl.constexpr):
    r = k0 + tl.arange(0, BR)
    c = v0 + tl.arange(0, BC)
    mask = (r < K)[:, None] & (c < V)[None, :]
    tl.store(ptr + r[:, None] * V + c[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _state_program(cu_seqlens, chunk_offsets, h_in, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, HAS_IN: tl.constexpr):
    """Where a program of the two sequential kernels starts: (sequence, head) on axis 0 (N·H there:
    CUDA caps axes 1 and 2 at 65,535), the V-block on axis 1.

    Returns (i_nh, head, first column v0, bos, eos, the sequence's first global chunk, its number
    of chunks, the fp32 ``[BK, BV]`` state it starts from: its block of ``h_in`` with ``HAS_IN``,
    else zeros).
    """
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    first = tl.load(chunk_offsets + i_n).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, BT)
    v0 = i_v * BV
    if HAS_IN:
        h = _load_state(h_in + _state_offset(i_nh, K, V), K, V, 0, v0, BK, BV)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    return i_nh, i_h, v0, bos, eos, first, n_chunks, h


@triton.jit
def _chunk_qkw(q, k, w, i_h, t0, eos, H, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """The chunk's rows of q, k and w (from token ``t0``, zero from ``eos`` on), ``[BT, BK]`` each, stored dtype."""
    sk = H * K
    q_c = _load_tile(q + i_h * K, t0, eos, sk, K, BT, BK)
    k_c = _load_tile(k + i_h * K, t0, eos, sk, K, BT, BK)
    w_c = _load_tile(w + i_h * K, t0, eos, sk, K, BT, BK)
    return q_c, k_c, w_c


@triton.jit
def _chunk_program(cu_seqlens, chunk_indices, BT: tl.constexpr):
    """What a program of the chunk-parallel kernels works on: (global chunk ``i_t`` on axis 0,
    head on axis 1, the chunk's start token, the end of its sequence)."""
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_t).to(tl.int64)
    i_c = tl.load(chunk_indices + 2 * i_t + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return i_t, i_h, bos + i_c * BT, eos


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
    forward substitution, as stable as the row-by-row one), all in fp32. A⁻ goes
    to memory in the input dtype (the backward needs it) and comes back as one
    64×64 tile, the left operand of W and U.
    """
    i_t, i_h, t0, eos = _chunk_program(cu_seqlens, chunk_indices, BT)
    k_h = k + i_h * K
    sk = H * K
    dt = k.dtype.element_ty

    # 16-row blocks of K (input dtype: the Gram blocks are tensor-core products), β and b.
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
        _store_vec(bcum + i_h, b0, t0, eos, H, 16)
        _store_vec(bcum + i_h, b1, t0 + 16, eos, H, 16)
        _store_vec(bcum + i_h, b2, t0 + 32, eos, H, 16)
        _store_vec(bcum + i_h, b3, t0 + 48, eos, H, 16)
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

    # Diagonal inverses, then the blocks below them, one block-diagonal at a time (fp32).
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
    kb = _load_tile(k_h, t0, eos, sk, K, BT, BK).to(tl.float32)
    if GATED:
        b = tl.cumsum(_load_vec(g + i_h, t0, eos, H, BT), axis=0)
        kb = kb * (be * tl.exp(b))[:, None]
    else:
        kb = kb * be[:, None]
    _store_tile(w + i_h * K, tl.dot(a_full, kb.to(dt), input_precision=PREC), t0, eos, sk, K, BT, BK)
    for i_v in tl.static_range(0, (V + BV - 1) // BV):
        vb = _load_tile(v + i_h * V + i_v * BV, t0, eos, H * V, V - i_v * BV, BT, BV).to(tl.float32) * be[:, None]
        _store_tile(u + i_h * V + i_v * BV, tl.dot(a_full, vb.to(dt), input_precision=PREC), t0, eos, H * V,
                    V - i_v * BV, BT, BV)


@triton.jit
def _state_fwd_kernel(
    q, k, w, u, bcum, o, h0, h_final, states, cu_seqlens, chunk_offsets, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, SAVE_STATES: tl.constexpr,
    PREC: tl.constexpr,
):
    """One (sequence, head, V-block): the chunks in order, the state in registers (fp32).

    Per chunk: U' = U − W h; O = scale·(Q ⊙ e^b) h + P U'; h ← e^{b_C} h + K̄ᵀ U'.
    The V columns of the recurrence are independent, so V-blocks run in parallel.
    With ``SAVE_STATES`` (a backward follows) the state entering each chunk is saved
    and U' is written over U (the backward needs U', never U).
    """
    i_nh, i_h, v0, bos, eos, first, n_chunks, h = _state_program(cu_seqlens, chunk_offsets, h0, H, K, V, BT, BK, BV,
                                                                  HAS_H0)
    sv = H * V
    r = tl.arange(0, BT)
    causal = r[:, None] >= r[None, :]
    dt = q.dtype.element_ty

    for i_c in range(0, n_chunks):
        if SAVE_STATES:
            _store_state(states + _state_offset((first + i_c) * H + i_h, K, V), h, K, V, 0, v0, BK, BV)
        t0 = bos + i_c * BT
        q_c, k_c, w_c = _chunk_qkw(q, k, w, i_h, t0, eos, H, K, BT, BK)
        u_c = _load_tile(u + i_h * V + v0, t0, eos, sv, V - v0, BT, BV).to(tl.float32)
        h_op = h.to(dt)
        u_c = u_c - tl.dot(w_c, h_op, input_precision=PREC)  # U'
        if SAVE_STATES:
            _store_tile(u + i_h * V + v0, u_c, t0, eos, sv, V - v0, BT, BV)
        u_op = u_c.to(dt)
        scores = tl.dot(q_c, tl.trans(k_c), input_precision=PREC) * scale
        if GATED:
            # The decays scale rows: (Q ⊙ e^b) h = diag(e^b) (Q h) and K̄ᵀ U' = Kᵀ (diag(e^{b_C − b}) U'),
            # so they go on the [64, BV] side, never on a [64, BK] copy of q or k (registers).
            b, b_last = _load_decay(bcum + i_h, t0, eos, H, BT)
            scores = scores * _decay_mask(b, b, causal)
            out = tl.dot(q_c, h_op, input_precision=PREC) * (scale * tl.exp(b))[:, None]
            out += tl.dot(scores.to(dt), u_op, input_precision=PREC)
            u_bar = (u_c * tl.exp(b_last - b)[:, None]).to(dt)
            h = h * tl.exp(b_last) + tl.dot(tl.trans(k_c), u_bar, input_precision=PREC)
        else:
            scores = tl.where(causal, scores, 0.0)
            out = tl.dot(q_c, h_op, input_precision=PREC) * scale
            out += tl.dot(scores.to(dt), u_op, input_precision=PREC)
            h = h + tl.dot(tl.trans(k_c), u_op, input_precision=PREC)
        _store_tile(o + i_h * V + v0, out, t0, eos, sv, V - v0, BT, BV)
    if STORE_FINAL:
        _store_state(h_final + _state_offset(i_nh, K, V), h, K, V, 0, v0, BK, BV)


# ---------------------------------------------------------------------------- backward


@triton.jit
def _state_bwd_kernel(
    q, k, w, bcum, do, dh_final, dh0, dstates, du, cu_seqlens, chunk_offsets, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
):
    """The adjoint of the state recurrence, chunks in reverse, per (sequence, head, V-block).

    With dh the gradient of the state leaving chunk c (saved per chunk, fp32):
        dU' = Pᵀ dO + K̄ dh                              (stored, fp32)
        dh ← e^{b_C} dh + scale·(Q ⊙ e^b)ᵀ dO − Wᵀ dU'   (the gradient entering chunk c)
    """
    i_nh, i_h, v0, bos, eos, first, n_chunks, dh = _state_program(cu_seqlens, chunk_offsets, dh_final, H, K, V, BT, BK,
                                                                   BV, HAS_DHT)
    sv = H * V
    r = tl.arange(0, BT)
    causal = r[:, None] >= r[None, :]
    dt = q.dtype.element_ty

    for j in range(0, n_chunks):
        i_c = n_chunks - 1 - j
        _store_state(dstates + _state_offset((first + i_c) * H + i_h, K, V), dh, K, V, 0, v0, BK, BV)
        t0 = bos + i_c * BT
        q_c, k_c, w_c = _chunk_qkw(q, k, w, i_h, t0, eos, H, K, BT, BK)
        do_c = _load_tile(do + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
        scores = tl.dot(q_c, tl.trans(k_c), input_precision=PREC) * scale
        du_c = tl.dot(k_c, dh.to(dt), input_precision=PREC)  # K̄ dh, K̄ = diag(e^{b_C − b}) K
        if GATED:  # decays on the [64, BV] side, as in the forward
            b, b_last = _load_decay(bcum + i_h, t0, eos, H, BT)
            scores = scores * _decay_mask(b, b, causal)
            du_c = du_c * tl.exp(b_last - b)[:, None]
            do_b = (do_c.to(tl.float32) * tl.exp(b)[:, None]).to(dt)  # Q_bᵀ dO = Qᵀ (diag(e^b) dO)
            dh = dh * tl.exp(b_last)
        else:
            scores = tl.where(causal, scores, 0.0)
            do_b = do_c
        du_c += tl.dot(tl.trans(scores.to(dt)), do_c, input_precision=PREC)
        _store_tile(du + i_h * V + v0, du_c, t0, eos, sv, V - v0, BT, BV)
        dh += tl.dot(tl.trans(q_c), do_b, input_precision=PREC) * scale
        dh -= tl.dot(tl.trans(w_c), du_c.to(dt), input_precision=PREC)
    if STORE_DH0:
        _store_state(dh0 + _state_offset(i_nh, K, V), dh, K, V, 0, v0, BK, BV)


@triton.jit
def _grads_intra_kernel(
    q, k, v, beta, bcum, ainv, u, do, du, dv, d_qk, d_gram, dbeta_part, db_part, cu_seqlens, chunk_indices,
    scale, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, PREC: tl.constexpr,
):
    """A chunk's C×C gradient terms (no sequential dependency). With ``u`` holding U':

        dZ_U = A⁻ᵀ dU'  (written over dU'),  dv = β dZ_U,  dP = dO U'ᵀ,  dA = −tril(dZ_U U'ᵀ, −1)

    (dZ_W Wᵀ folds into dA: dZ_W = −dZ_U hᵀ, so dZ_U Uᵀ + dZ_W Wᵀ = dZ_U U'ᵀ). Stores
    dQK = scale·dP ⊙ Γ (causal) and dS' = diag(β) dA ⊙ Γ (strict) for ``_grads_key_kernel``,
    and the parts of dβ (rowsum(dZ_U ⊙ V) + rowsum(dA ⊙ S)) and of db (the pair-wise Γ
    of P and S: rowsum − colsum of dM ⊙ M) that need all of K for S and P.
    """
    i_t, i_h, t0, eos = _chunk_program(cu_seqlens, chunk_indices, BT)
    sk = H * K
    sv = H * V
    r = tl.arange(0, BT)
    causal = r[:, None] >= r[None, :]
    strict = r[:, None] > r[None, :]
    dt = q.dtype.element_ty

    be = _load_vec(beta + i_h, t0, eos, H, BT)
    a_inv_t = tl.trans(_load_tile(ainv + i_h * BT, t0, eos, H * BT, BT, BT, BT))
    d_scores = tl.zeros([BT, BT], dtype=tl.float32)  # dO U'ᵀ
    d_a = tl.zeros([BT, BT], dtype=tl.float32)  # −dZ_U U'ᵀ
    d_beta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, (V + BV - 1) // BV):
        v0 = i_v * BV
        u_c = _load_tile(u + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
        do_c = _load_tile(do + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
        du_c = _load_tile(du + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
        d_scores += tl.dot(do_c, tl.trans(u_c), input_precision=PREC)
        dz_u = tl.dot(a_inv_t, du_c.to(dt), input_precision=PREC)
        _store_tile(du + i_h * V + v0, dz_u, t0, eos, sv, V - v0, BT, BV)
        _store_tile(dv + i_h * V + v0, dz_u * be[:, None], t0, eos, sv, V - v0, BT, BV)
        v_c = _load_tile(v + i_h * V + v0, t0, eos, sv, V - v0, BT, BV).to(tl.float32)
        d_beta += tl.sum(dz_u * v_c, axis=1)
        d_a -= tl.dot(dz_u.to(dt), tl.trans(u_c), input_precision=PREC)

    q_c = _load_tile(q + i_h * K, t0, eos, sk, K, BT, BK)
    k_c = _load_tile(k + i_h * K, t0, eos, sk, K, BT, BK)
    s = tl.dot(k_c, tl.trans(k_c), input_precision=PREC)
    d_a = tl.where(strict, d_a, 0.0)
    d_scores = tl.where(causal, d_scores, 0.0)
    if GATED:
        b, b_last = _load_decay(bcum + i_h, t0, eos, H, BT)
        gamma_strict = _decay_mask(b, b, strict)
        gamma_causal = _decay_mask(b, b, causal)
        s = s * gamma_strict
        scores = tl.dot(q_c, tl.trans(k_c), input_precision=PREC) * scale * gamma_causal
        d_s = d_a * be[:, None]
        e_p = d_scores * scores
        e_s = d_s * s
        db = tl.sum(e_p, axis=1) - tl.sum(e_p, axis=0) + tl.sum(e_s, axis=1) - tl.sum(e_s, axis=0)
        _store_vec(db_part + i_h, db, t0, eos, H, BT)
        d_gram_c = d_s * gamma_strict
        d_qk_c = d_scores * scale * gamma_causal
    else:
        s = tl.where(strict, s, 0.0)
        d_gram_c = d_a * be[:, None]
        d_qk_c = d_scores * scale
    d_beta += tl.sum(d_a * s, axis=1)
    _store_vec(dbeta_part + i_h, d_beta, t0, eos, H, BT)
    _store_tile(d_qk + i_h * BT, d_qk_c, t0, eos, H * BT, BT, BT, BT)
    _store_tile(d_gram + i_h * BT, d_gram_c, t0, eos, H * BT, BT, BT, BT)


@triton.jit
def _grads_key_kernel(
    q, k, beta, bcum, states, dstates, do, u, du, d_qk, d_gram, dbeta_part, db_part,
    dq, dk, dbeta, dg, cu_seqlens, chunk_indices, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, PREC: tl.constexpr,
):
    """dq, dk, the rest of dβ and db, and dg of one chunk, BK columns of K at a time.

    Given h (entering), dh (leaving), U', dZ_U (in ``du``) and dQK, dS' from
    ``_grads_intra_kernel``, per column block of K:
        dQ_b = scale·dO hᵀ,  dK̄ = U' dhᵀ,  dZ_W = −dZ_U hᵀ,  dK_b = β dZ_W
        dq = dQ_b ⊙ e^b + dQK K,  dk = dK̄ ⊙ e^{b_C − b} + dK_b ⊙ e^b + dQKᵀ Q + (dS' + dS'ᵀ) K
    dβ adds rowsum(dZ_W ⊙ K_b); db adds the row terms of Q_b, K̄, K_b and (to the last
    row) e^{b_C}'s and K̄'s b_C part; dg = reverse cumsum of db in the chunk.
    """
    i_t, i_h, t0, eos = _chunk_program(cu_seqlens, chunk_indices, BT)
    sk = H * K
    sv = H * V
    r = tl.arange(0, BT)
    dt = q.dtype.element_ty

    be = _load_vec(beta + i_h, t0, eos, H, BT)
    d_beta = _load_vec(dbeta_part + i_h, t0, eos, H, BT)
    d_qk_c = _load_tile(d_qk + i_h * BT, t0, eos, H * BT, BT, BT, BT).to(dt)
    d_gram_c = _load_tile(d_gram + i_h * BT, t0, eos, H * BT, BT, BT, BT).to(dt)
    state = states + _state_offset(i_t * H + i_h, K, V)
    dstate = dstates + _state_offset(i_t * H + i_h, K, V)
    if GATED:
        b, b_last = _load_decay(bcum + i_h, t0, eos, H, BT)
        e_b = tl.exp(b)
        k_bar_scale = tl.exp(b_last - b)
        db = _load_vec(db_part + i_h, t0, eos, H, BT)
        db_last = tl.sum(b * 0.0, axis=0)  # scalar accumulator: e^{b_C}'s and K̄'s b_C terms
    for i_k in range(0, (K + BK - 1) // BK):  # runtime loops: unrolled, they spilled 1.6 KB at K = 256
        k0 = i_k * BK
        d_qb = tl.zeros([BT, BK], dtype=tl.float32)  # dO hᵀ (times scale later)
        d_kbar = tl.zeros([BT, BK], dtype=tl.float32)  # U' dhᵀ
        dz_w = tl.zeros([BT, BK], dtype=tl.float32)  # −dZ_U hᵀ
        h_dh = tl.zeros([BK, BV], dtype=tl.float32)  # Σ h ⊙ dh for the chunk decay e^{b_C}
        for i_v in range(0, (V + BV - 1) // BV):
            v0 = i_v * BV
            h = _load_state(state, K, V, k0, v0, BK, BV)
            dh = _load_state(dstate, K, V, k0, v0, BK, BV)
            do_c = _load_tile(do + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
            u_c = _load_tile(u + i_h * V + v0, t0, eos, sv, V - v0, BT, BV)
            dz_u = _load_tile(du + i_h * V + v0, t0, eos, sv, V - v0, BT, BV).to(dt)
            h_t = tl.trans(h.to(dt))
            d_qb += tl.dot(do_c, h_t, input_precision=PREC)
            d_kbar += tl.dot(u_c, tl.trans(dh.to(dt)), input_precision=PREC)
            dz_w -= tl.dot(dz_u, h_t, input_precision=PREC)
            if GATED:
                h_dh += h * dh
        q_c = _load_tile(q + i_h * K + k0, t0, eos, sk, K - k0, BT, BK)
        k_c = _load_tile(k + i_h * K + k0, t0, eos, sk, K - k0, BT, BK)
        k_f = k_c.to(tl.float32)
        d_kb = dz_w * be[:, None]
        if GATED:
            k_b = k_f * e_b[:, None]
            d_q = d_qb * (scale * e_b)[:, None]
            d_k = d_kbar * k_bar_scale[:, None] + d_kb * e_b[:, None]
            k_bar_term = tl.sum(d_kbar * k_f * k_bar_scale[:, None], axis=1)
            db += tl.sum(d_qb * q_c.to(tl.float32), axis=1) * scale * e_b - k_bar_term + tl.sum(d_kb * k_b, axis=1)
            db_last += tl.sum(k_bar_term, axis=0) + tl.exp(b_last) * tl.sum(tl.sum(h_dh, axis=1), axis=0)
        else:
            k_b = k_f
            d_q = d_qb * scale
            d_k = d_kbar + d_kb
        d_beta += tl.sum(dz_w * k_b, axis=1)
        d_q += tl.dot(d_qk_c, k_c, input_precision=PREC)
        d_k += tl.dot(tl.trans(d_qk_c), q_c, input_precision=PREC)
        d_k += tl.dot(d_gram_c, k_c, input_precision=PREC) + tl.dot(tl.trans(d_gram_c), k_c, input_precision=PREC)
        _store_tile(dq + i_h * K + k0, d_q, t0, eos, sk, K - k0, BT, BK)
        _store_tile(dk + i_h * K + k0, d_k, t0, eos, sk, K - k0, BT, BK)
    if GATED:
        # b_C is the b of the chunk's last token; padded rows past the end carry g = 0,
        # so adding db_C to row BT − 1 reaches every real token through the reverse cumsum.
        db += tl.where(r == BT - 1, db_last, 0.0)
        _store_vec(dg + i_h, tl.cumsum(db, axis=0, reverse=True), t0, eos, H, BT)
    _store_vec(dbeta + i_h, d_beta, t0, eos, H, BT)
