"""The DPLR delta rule, chunk form: KDA's chunk structure with the DPLR block terms.

Per chunk of C tokens, the block's state-free terms (:func:`~.parallel.dplr_block_core`: KDA's
relative sub-block decay factors, the four decayed products sharing them), then one sequential
loop across chunks and the outputs (:func:`chunk_dplr_fwd`: KDA's loop with the state-free V
pseudo-rows taken out of it). The
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
from .parallel import dplr_block_core, dplr_block_terms


def dplr_block_terms_backward(q, k, v, ab, terms, d_wu, d_scores, d_q_read, d_k_write, d_last, scale, solve_adjoint):
    """The adjoint of :func:`~.parallel.dplr_block_terms` by autograd on its recomputation from
    the inputs it kept; returns ``(dq, dk, dv, dab, dgk)``."""
    inputs = [t.detach().requires_grad_(True) for t in terms.solver]
    with torch.enable_grad():
        x = dplr_block_terms(*inputs, scale)
        grads = torch.autograd.grad((x.wu, x.scores, x.q_read, x.k_write, x.last), inputs,
                                    (d_wu, d_scores, d_q_read, d_k_write, d_last), allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads))


def chunk_dplr_fwd(q, k, v, ab, gk, h0, scale: float, chunk_size: int):
    """Forward on head-first ``[N, H, T, ·]`` tensors (``ab [N, H, T, 2, K]``), ``h0 [N·H, K, V]`` or
    None; returns KDA's ``(o, h_T, states)`` (:func:`~fastweights.ops.kda.chunk.chunk_kda_fwd`,
    ``states[c]`` the state entering chunk c), group by group of chunks as KDA's driver.

    KDA's driver would run the 2L pseudo-rows ``[U; V]`` through its loop; here the V rows, which
    do not depend on the state, are taken out of it: per chunk the loop forms U = U₀ + W h and
    h' = e^{c_L} ⊙ h + (K ⊙ e^{c_L − c})ᵀ V + (B ⊙ e^{c_L − c})ᵀ U with the V term batched over
    the group beforehand, and the outputs A_qk V + A_qb U + Q̂ h are batched after it."""
    n, nh, t_len, dk = q.shape
    dv = v.shape[-1]
    nc, rows = -(-t_len // chunk_size), n * nh
    states = v.new_empty(nc, rows, dk, dv)
    out = chunk_buffer(v, n, nh, nc, chunk_size, (dv,))
    h = v.new_zeros(rows, dk, dv) if h0 is None else h0
    for c0, c1 in kda_chunk._groups(nc, rows):
        qf, kf, vf, abf, gf = (flat_chunks(t, chunk_size, c0, c1) for t in (q, k, v, ab, gk))
        read, to_end, _, scores, wu = dplr_block_core(qf, kf, vf, abf, gf, scale)
        length = qf.shape[1]
        w, u0 = wu[..., :dk], wu[..., dk:]
        b_write_t = (abf[..., 1, :] * to_end).transpose(-1, -2)  # [Bt, K, L]
        from_v = torch.bmm((kf * to_end).transpose(-1, -2), vf)  # [Bt, K, V] (K ⊙ e^{c_L − c})ᵀ V
        last = read[:, -1].unsqueeze(-1)
        u = torch.empty_like(u0)
        for c in range(c1 - c0):  # the one sequential loop: two small products per chunk
            r = slice(c * rows, (c + 1) * rows)
            states[c0 + c] = h
            torch.baddbmm(u0[r], w[r], h, out=u[r])
            h = torch.baddbmm(torch.addcmul(from_v[r], last[r], h), b_write_t[r], u[r])
        entering = states[c0:c1].view(-1, dk, dv)
        o = torch.bmm(scores[..., length:], vf).baddbmm_(scores[..., :length], u)
        put_chunks(out, o.baddbmm_(qf * read * scale, entering), c0)
    return from_chunk_buffer(out, t_len), h, states


@torch.library.custom_op("fastweights::chunk_dplr_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, ab: Tensor, gk: Tensor, h0: Optional[Tensor],
            scale: float, chunk_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    n, nh, _, dk = q.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, v.shape[-1])
    with autocast_off(q.device), torch.no_grad():
        return chunk_dplr_fwd(q, k, v, ab, gk, h0_, scale, chunk_size)


_fwd_op.register_fake(kda_chunk._fwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, ab, gk, h0, scale, chunk_size = inputs
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
    return dq, dk, dv, dab, dgk, dh0, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def dplr_chunk(q, k, v, beta, gk, h0, scale, chunk_size, *, a, b) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk form on head-first compute-dtype tensors; returns ``(o, h_T)``."""
    o, h_final, _ = _fwd_op(q, k, v, torch.stack([a, b], dim=-2), gk, h0, float(scale), int(chunk_size))
    return o, h_final.view(q.shape[0], q.shape[1], *h_final.shape[1:])


#: The op, declared once (``fastweights/ops/_spec.py``).
CHUNK_DPLR_DELTA_RULE = OpSpec("chunk_dplr_delta_rule", Rule.DELTA, Form.CHUNK, torch=dplr_chunk, step=dplr_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.dplr.api", "chunk_dplr_delta_rule")
