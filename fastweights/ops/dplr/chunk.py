"""The DPLR delta rule, chunk form: KDA's chunk structure with the DPLR block terms.

Per chunk of C tokens, the block's state-free terms (:func:`_forward_terms`: the four decayed
products by recursive halving, :func:`~.._halving.halving_products`, every exponential of a
number <= 0; one unit-triangular solve), then one sequential loop across chunks and the outputs
(:func:`chunk_dplr_fwd`: KDA's loop with the state-free V pseudo-rows taken out of it; no chunk
states kept without grad). No compiled CPU kernel runs it: KDA's (``ops/cpu/chunk_kda.cpp``)
reads and writes the state along one key per token, while the DPLR transition reads along a,
writes along b and adds k vᵀ, two write paths that kernel's block algebra does not have. The
backward is KDA's hand-written adjoint loop (last chunk first, from the saved chunk-entry
states); the adjoint of each group of chunks' state-free terms is taken by autograd on
their recomputation (:func:`dplr_block_terms_backward`), not written out by hand as KDA's,
GDN-2's and DeltaProduct's are. The forward is a ``torch.library`` custom op; the backward
is its registered autograd formula, not a custom op of its own (autograd does not run below
a custom op's dispatch).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._chunk import backward_only, chunk_buffer, flat_chunks, from_chunk_buffer, put_chunks
from ..precision import autocast_off
from ..kda import chunk as kda_chunk
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from .recurrent import dplr_step
from .parallel import dplr_block_terms
from .._halving import halving_products
from ..kda.parallel import cumulative_decay


def dplr_block_terms_backward(q, k, v, ab, terms, d_wu, d_scores, d_q_read, d_k_write, d_last, scale, solve_adjoint):
    """The adjoint of :func:`~.parallel.dplr_block_terms` by autograd on its recomputation from
    the inputs it kept; returns ``(dq, dk, dv, dab, dgk)``."""
    inputs = [t.detach().requires_grad_(True) for t in terms.solver]
    with torch.enable_grad():
        x = dplr_block_terms(*inputs, scale)
        grads = torch.autograd.grad((x.wu, x.scores, x.q_read, x.k_write, x.last), inputs,
                                    (d_wu, d_scores, d_q_read, d_k_write, d_last), allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads))


def _forward_terms(q, k, v, ab, gk, scale: float):
    """What the forward needs of blocks ``q, k, gk [Bt, L, K]``, ``v [Bt, L, V]``, ``ab [Bt, L, 2, K]``:
    ``(e^c, e^{c_L − c}, A_qb, A_qk, W, U₀)``, the scores scaled (:func:`~.parallel.dplr_block_core`'s
    algebra, module docstring of ``parallel.py``).

    The four decayed products (rows a ⊙ e^{−gk} and scale·q, columns b and k) are formed together by
    recursive halving (:func:`~.._halving.halving_products`: every exponential of a number <= 0), and
    ``[W | U₀] = (I − A_ab)⁻¹ [A ⊙ e^{c − gk} | A_ak V]`` is one unit lower-triangular solve on −A_ab
    (LAPACK's substitution reads only the strict lower triangle)."""
    bt, length, dk = q.shape
    c = cumulative_decay(gk)
    read = c.to(q.dtype, copy=True).exp_()  # (a copy: c itself when the inputs are float64)
    to_end = torch.sub(c[:, -1:], c, out=torch.empty_like(q)).exp_()  # the float64 difference, rounded once
    rows = q.new_empty(bt, length, 2, dk)  # the row operands: a ⊙ e^{−gk} and scale·q
    # a_i e^{c_{i−1} − c_j} = (a_i e^{−gk_i}) e^{c_i − c_j}
    a_shift = torch.mul(ab[..., 0, :], torch.neg(gk).exp_(), out=rows[:, :, 0])
    torch.mul(q, scale, out=rows[:, :, 1])
    cols = q.new_empty(bt, length, 2, dk)  # the column operands: b and k
    cols[:, :, 0] = ab[..., 1, :]
    cols[:, :, 1] = k
    products = halving_products(c, rows, cols)
    a_ak = products[0, 1]
    a_ak.diagonal(dim1=-2, dim2=-1).zero_()  # A_ak strictly below the diagonal
    rhs = q.new_empty(bt, length, dk + v.shape[-1])
    torch.mul(a_shift, read, out=rhs[..., :dk])  # A ⊙ e^{c − gk} = (A ⊙ e^{−gk}) ⊙ e^c
    torch.bmm(a_ak, v, out=rhs[..., dk:])
    wu = torch.linalg.solve_triangular(products[0, 0].neg_(), rhs, upper=False, unitriangular=True)
    return read, to_end, rows[:, :, 1], products[1, 0], products[1, 1], wu


def chunk_dplr_fwd(q, k, v, ab, gk, h0, scale: float, chunk_size: int, keep_states: bool = True):
    """Forward on head-first ``[N, H, T, ·]`` tensors (``ab [N, H, T, 2, K]``), ``h0 [N·H, K, V]`` or
    None; returns KDA's ``(o, h_T, states)`` (:func:`~fastweights.ops.kda.chunk.chunk_kda_fwd`,
    ``states[c]`` the state entering chunk c), group by group of chunks as KDA's driver.

    KDA's driver would run the 2L pseudo-rows ``[U; V]`` through its loop; here the V rows, which
    do not depend on the state, are taken out of it: per chunk the loop forms U = U₀ + W h and
    h' = e^{c_L} ⊙ h + (K ⊙ e^{c_L − c})ᵀ V + (B ⊙ e^{c_L − c})ᵀ U with the V term batched over
    the group beforehand, and the outputs A_qk V + A_qb U + Q̂ h are batched after it.

    ``keep_states=False`` (a forward no backward will follow) returns ``states`` with no chunks
    (``[0, N·H, K, V]``): the group's entry states go to one group-sized buffer used again by every
    group instead of T/C states written once each (fresh memory, faulted in page by page)."""
    n, nh, t_len, dk = q.shape
    dv = v.shape[-1]
    nc, rows = -(-t_len // chunk_size), n * nh
    groups = kda_chunk._groups(nc, rows)
    states = v.new_empty(nc if keep_states else 0, rows, dk, dv)
    buffer = None if keep_states or not groups else v.new_empty(groups[0][1], rows, dk, dv)
    out = chunk_buffer(v, n, nh, nc, chunk_size, (dv,))
    h_final = v.new_empty(rows, dk, dv)
    if nc == 0:
        return from_chunk_buffer(out, t_len), (h_final.zero_() if h0 is None else h0), states
    h, carry = (v.new_zeros(rows, dk, dv) if h0 is None else h0), v.new_empty(rows, dk, dv)
    for c0, c1 in groups:
        qf, kf, vf, abf, gf = (flat_chunks(t, chunk_size, c0, c1) for t in (q, k, v, ab, gk))
        read, to_end, q_scaled, a_qb, a_qk, wu = _forward_terms(qf, kf, vf, abf, gf, scale)
        w, u0 = wu[..., :dk], wu[..., dk:]
        b_write_t = (abf[..., 1, :] * to_end).transpose(-1, -2)  # [Bt, K, L]
        from_v = torch.bmm((kf * to_end).transpose(-1, -2), vf)  # [Bt, K, V] (K ⊙ e^{c_L − c})ᵀ V
        last = read[:, -1].unsqueeze(-1)
        u = torch.empty_like(u0)
        entering = states[c0:c1] if keep_states else buffer[:c1 - c0]
        entering[0].copy_(h)
        for c in range(c1 - c0):  # the one sequential loop: two small products per chunk, written in place
            r = slice(c * rows, (c + 1) * rows)
            torch.baddbmm(u0[r], w[r], entering[c], out=u[r])
            h = entering[c + 1] if c0 + c + 1 < c1 else (h_final if c1 == nc else carry)
            torch.addcmul(from_v[r], last[r], entering[c], out=h).baddbmm_(b_write_t[r], u[r])
        o = torch.bmm(a_qk, vf).baddbmm_(a_qb, u)
        put_chunks(out, o.baddbmm_(q_scaled * read, entering.view(-1, dk, dv)), c0)
    return from_chunk_buffer(out, t_len), h_final, states


@torch.library.custom_op("fastweights::chunk_dplr_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, ab: Tensor, gk: Tensor, h0: Optional[Tensor],
            scale: float, chunk_size: int, keep_states: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
    n, nh, _, dk = q.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, v.shape[-1])
    with autocast_off(q.device), torch.no_grad():
        return chunk_dplr_fwd(q, k, v, ab, gk, h0_, scale, chunk_size, keep_states)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, ab, gk, h0, scale, chunk_size, keep_states=True):
    o, h_final, states = kda_chunk._fwd_fake(q, k, v, ab, gk, h0, scale, chunk_size)
    return o, h_final, (states if keep_states else states.new_empty((0,) + tuple(states.shape[1:])))


def _setup_context(ctx, inputs, output):
    q, k, v, ab, gk, h0, scale, chunk_size, *_ = inputs
    states = output[2]
    ctx.save_for_backward(q, k, v, ab, gk, states)
    backward_only(ctx, states)
    ctx.scale, ctx.chunk_size, ctx.h0_shape = scale, chunk_size, None if h0 is None else h0.shape


def _backward(ctx, do, dh_final, _states):
    q, k, v, ab, gk, states = ctx.saved_tensors
    if dh_final is None:
        dh_final = states.new_zeros(states.shape[1:])
    if do is None:  # only h_T was used
        do = v.new_zeros(v.shape)
    with autocast_off(do.device), torch.no_grad():  # no custom op here: the terms' adjoint needs autograd
        dq, dk, dv, dab, dgk, dh0 = kda_chunk.chunk_kda_bwd(
            q, k, v, ab, gk, states, do, dh_final, ctx.scale, ctx.chunk_size, terms=dplr_block_terms,
            terms_backward=dplr_block_terms_backward)
    dh0 = None if ctx.h0_shape is None else dh0.reshape(ctx.h0_shape)
    return dq, dk, dv, dab, dgk, dh0, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def dplr_chunk(q, k, v, beta, gk, h0, scale, chunk_size, *, a, b) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk form on head-first compute-dtype tensors; returns ``(o, h_T)``."""
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, a, b, gk, h0))
    o, h_final, _ = _fwd_op(q, k, v, torch.stack([a, b], dim=-2), gk, h0, float(scale), int(chunk_size),
                            keep)  # states: backward only
    return o, h_final.view(q.shape[0], q.shape[1], *h_final.shape[1:])


#: The op, declared once (``fastweights/ops/_spec.py``).
CHUNK_DPLR_DELTA_RULE = OpSpec("chunk_dplr_delta_rule", Rule.DELTA, Form.CHUNK, torch=dplr_chunk, step=dplr_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.dplr.api", "chunk_dplr_delta_rule")
