"""The DPLR delta rule, chunk form: KDA's chunk driver with the DPLR block terms.

Per chunk of C tokens, :func:`~.parallel.dplr_block_terms` (KDA's relative sub-block decay
factors; the block's two write paths as 2C pseudo-rows), then KDA's one sequential loop
across chunks and the outputs (:func:`~fastweights.ops.kda.chunk.chunk_kda_fwd`). The
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

from .._chunk import backward_only
from .._frontend import autocast_off
from ..kda import chunk as kda_chunk
from .._spec import Form, OpSpec, Rule
from .fla import dplr_form
from .recurrent import dplr_step
from .parallel import dplr_block_terms


def dplr_block_terms_backward(q, k, v, ab, terms, d_wu, d_scores, d_q_read, d_k_write, d_last, scale, solve_adjoint):
    """The adjoint of :func:`~.parallel.dplr_block_terms` by autograd on its recomputation from
    the inputs it kept; returns ``(dq, dk, dv, dab, dgk)``."""
    inputs = [t.detach().requires_grad_(True) for t in terms.solver]
    with torch.enable_grad():
        x = dplr_block_terms(*inputs, scale)
        grads = torch.autograd.grad((x.wu, x.scores, x.q_read, x.k_write, x.last), inputs,
                                    (d_wu, d_scores, d_q_read, d_k_write, d_last), allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads))


@torch.library.custom_op("fastweights::chunk_dplr_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, ab: Tensor, gk: Tensor, h0: Optional[Tensor],
            scale: float, chunk_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    n, nh, _, dk = q.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, v.shape[-1])
    with autocast_off(q.device), torch.no_grad():
        return kda_chunk.chunk_kda_fwd(q, k, v, ab, gk, h0_, scale, chunk_size, terms=dplr_block_terms)


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

chunk_dplr_delta_rule = dplr_form(CHUNK_DPLR_DELTA_RULE, needs_floor=True, doc="""
    The DPLR delta rule, chunkwise parallel (module docstring), with fla 0.6.0's name and
    positional order ``(q, k, v, a, b, gk, scale, initial_state, output_final_state,
    cu_seqlens, cu_seqlens_cpu, safe_gate, chunk_size, disable_recompute, ...)``.

    Equivalent to :func:`~fastweights.ops.recurrent_dplr_delta_rule` (same arguments and
    returns) to ~1e-12 relative in float64, with ``gk >= −80``. ``chunk_size`` (C) is any
    positive int, ``None``: 64. Gradients reach q, k, v, a, b, gk and initial_state.
""")
