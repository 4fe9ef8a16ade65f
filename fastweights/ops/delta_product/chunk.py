"""(Gated) DeltaProduct, chunk form: KDA's chunkwise UT algorithm over each chunk's sub-steps.

Per chunk of C tokens, :func:`~.parallel.product_block_terms` lays out the chunk's C·n_h
Householder sub-steps (and only the chunk's) and computes KDA's state-free terms over them,
with one output row per token; then KDA's driver (:func:`~fastweights.ops.kda.chunk.chunk_kda_fwd`)
runs the one sequential loop across chunks, ``U' = U − W h``, ``h ← e^{c_end} h + K̄ᵀ U'``,
and the outputs. Its hand-written backward (the adjoint loop, last chunk first) runs with
:func:`~.parallel.product_block_terms_backward`. Forward and backward are ``torch.library``
custom ops, opaque to ``torch.compile``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..precision import autocast_off
from ..kda import chunk as kda_chunk
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from .recurrent import gated_delta_product_step
from .parallel import product_block_terms, product_block_terms_backward


@torch.library.custom_op("fastweights::chunk_gated_delta_product_fwd", mutates_args=())
def _fwd_op(q: Tensor, ks: Tensor, vs: Tensor, betas: Tensor, g: Tensor, h0: Optional[Tensor],
            scale: float, chunk_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    n, nh, _, dk = q.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, vs.shape[-1])
    with autocast_off(q.device):
        return kda_chunk.chunk_kda_fwd(q, ks, vs, betas, g, h0_, scale, chunk_size, terms=product_block_terms)


@_fwd_op.register_fake
def _fwd_fake(q, ks, vs, betas, g, h0, scale, chunk_size):
    n, nh, t_len, dk = q.shape
    dv, nc = vs.shape[-1], -(-t_len // chunk_size)
    o = kda_chunk._like_chunks(q, n, nh, nc, chunk_size, t_len, (dv,))  # the real one's strides
    return o, q.new_empty(n * nh, dk, dv), q.new_empty(nc, n * nh, dk, dv)


@torch.library.custom_op("fastweights::chunk_gated_delta_product_bwd", mutates_args=())
def _bwd_op(q: Tensor, ks: Tensor, vs: Tensor, betas: Tensor, g: Tensor, states: Tensor, do: Tensor,
            dh_final: Tensor, scale: float, chunk_size: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    with autocast_off(do.device):
        return kda_chunk.chunk_kda_bwd(q, ks, vs, betas, g, states, do, dh_final, scale, chunk_size,
                                       terms=product_block_terms, terms_backward=product_block_terms_backward)


@_bwd_op.register_fake
def _bwd_fake(q, ks, vs, betas, g, states, do, dh_final, scale, chunk_size):
    n, nh, t_len, _ = q.shape
    grads = tuple(kda_chunk._like_chunks(t, n, nh, states.shape[0], chunk_size, t_len) for t in (q, ks, vs, betas, g))
    return grads + (torch.empty_like(dh_final),)


kda_chunk.register_chunk_autograd(_fwd_op, _bwd_op, lambda q, ks, vs, betas, g: q.new_zeros(q.shape[:3] + vs.shape[-1:]))


def delta_product_chunk(q, k, v, beta, g, h0, scale, chunk_size, *, ks, vs, betas):
    """The chunk form on head-first compute-dtype tensors; returns ``(o, h_T)``."""
    o, h_final, _ = _fwd_op(q, ks, vs, betas, g, h0, float(scale), int(chunk_size))
    return o, h_final.view(q.shape[0], q.shape[1], *h_final.shape[1:])


#: The op, declared once (``fastweights/ops/_spec.py``).
CHUNK_GATED_DELTA_PRODUCT = OpSpec("chunk_gated_delta_product", Rule.DELTA, Form.CHUNK, torch=delta_product_chunk, step=gated_delta_product_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.delta_product.api", "chunk_gated_delta_product")
