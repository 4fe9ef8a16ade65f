"""Gated DeltaNet-2, chunk form: KDA's chunkwise UT/WY algorithm with GDN-2's block terms.

Per chunk of C tokens, the state-free terms of :func:`~.parallel.gdn2_block_terms` (KDA's
relative sub-block decay factors, every exponential of a number <= 0), then the one
sequential loop ``U' = U − W h``, ``h ← diag(e^{c_C}) h + (K ⊙ e^{c_C − c})ᵀ U'``, then the
outputs, batched: :func:`~fastweights.ops.kda.chunk.chunk_kda_fwd` runs exactly that with
the terms passed in. The backward is KDA's hand-written one (the adjoint loop, last chunk
first) with :func:`~.parallel.gdn2_block_terms_backward`; both are ``torch.library`` custom
ops, opaque to ``torch.compile``.

The custom ops take the erase keys ``e = b ⊙ k`` and the gated values ``x = w ⊙ v``; those
two products, and their gradients to b, k, w and v, are ordinary autograd around them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._frontend import autocast_off
from ..kda import chunk as kda_chunk
from .._spec import Form, OpSpec, Rule
from .fla import gdn2_form
from .recurrent import gdn2_step
from .parallel import gdn2_block_terms, gdn2_block_terms_backward


@torch.library.custom_op("fastweights::chunk_gdn2_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, e: Tensor, x: Tensor, g: Tensor, h0: Optional[Tensor],
            scale: float, chunk_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    n, nh, _, dk = k.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, x.shape[-1])
    with autocast_off(q.device):
        return kda_chunk.chunk_kda_fwd(q, k, x, e, g, h0_, scale, chunk_size, terms=gdn2_block_terms)


@_fwd_op.register_fake
def _fwd_fake(q, k, e, x, g, h0, scale, chunk_size):
    return kda_chunk._fwd_fake(q, k, x, e, g, h0, scale, chunk_size)


@torch.library.custom_op("fastweights::chunk_gdn2_bwd", mutates_args=())
def _bwd_op(q: Tensor, k: Tensor, e: Tensor, x: Tensor, g: Tensor, states: Tensor, do: Tensor,
            dh_final: Tensor, scale: float, chunk_size: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    with autocast_off(do.device):
        dq, dk, dx, de, dg, dh0 = kda_chunk.chunk_kda_bwd(q, k, x, e, g, states, do, dh_final, scale, chunk_size,
                                                          terms=gdn2_block_terms,
                                                          terms_backward=gdn2_block_terms_backward)
    return dq, dk, de, dx, dg, dh0


@_bwd_op.register_fake
def _bwd_fake(q, k, e, x, g, states, do, dh_final, scale, chunk_size):
    dq, dk, dx, de, dg, dh0 = kda_chunk._bwd_fake(q, k, x, e, g, states, do, dh_final, scale, chunk_size)
    return dq, dk, de, dx, dg, dh0


kda_chunk.register_chunk_autograd(_fwd_op, _bwd_op, lambda q, k, e, x, g: x.new_zeros(x.shape))


def gdn2_chunk(q, k, v, beta, g, h0, scale, chunk_size, *, b, w) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk form on head-first compute-dtype tensors; returns ``(o, h_T)`` (``beta`` unused)."""
    o, h_final, _ = _fwd_op(q, k, b * k, w * v, g, h0, float(scale), int(chunk_size))
    return o, h_final.view(k.shape[0], k.shape[1], *h_final.shape[1:])


#: The op, declared once (``fastweights/ops/_spec.py``).
CHUNK_GDN2 = OpSpec("chunk_gdn2", Rule.DELTA, Form.CHUNK, torch=gdn2_chunk, step=gdn2_step)

chunk_gdn2 = gdn2_form(CHUNK_GDN2, doc="""
    Gated DeltaNet-2, chunkwise parallel: the fast path for training (module docstring).

    Equivalent to :func:`~fastweights.ops.recurrent_gdn2` (same arguments and returns; see
    its docstring), to ~1e-12 relative in float64, with fla 0.6.0's name and positional
    order ``(q, k, v, g, b, w, scale, initial_state, output_final_state,
    use_qk_l2norm_in_kernel, use_gate_in_kernel, cu_seqlens, ...)``.

    Args beyond the reference's:
        chunk_size: C, tokens per chunk (any positive int; fla's kernel requires 64).

    Gradients reach q, k, v, g, b, w and initial_state through KDA's hand-written chunk
    backward (inputs and the T/C chunk-entry states kept, the rest recomputed); double
    backward is not supported (use the parallel form). Under ``torch.autocast`` it computes
    in fp32 and returns the inputs' dtype.

    Example::

        >>> B, T, H, K, V = 2, 1000, 4, 64, 64
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> g = -torch.rand(B, T, H, K) * 7          # α down to 1e-3 per token and channel
        >>> b, w = 2 * torch.rand(B, T, H, K), torch.rand(B, T, H, V)
        >>> o, h = chunk_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True, output_final_state=True)
""")
