"""(Gated) DeltaProduct, parallel form: KDA's block UT transform over a block's sub-steps.

A block of L tokens is a block of L·n_h Householder sub-steps of the gated delta rule: the
token's log decay g_t sits on its first sub-step (0 on the others) and its query reads after
its last. So the block terms are KDA's (``ops/kda/README.md``; a per-head decay is a
per-channel one that is the same in every channel) over the L·n_h sub-steps, with

- S, the UT transform, W, U, K ⊙ e^{c_end − c}: over all sub-steps, as KDA's;
- the scores P and the state read Q ⊙ e^c: one row per token (its last sub-step), so
  ``P [L, L·n_h]`` and the outputs ``[L, V]``, never n_h rows per token.

The sub-steps are laid out as a sequence only inside the block (:func:`substeps`); the
chunk form (``chunk.py``) does this per chunk of C tokens, so nothing n_h× longer than a
chunk is built beyond the inputs themselves. :func:`product_block_terms` and
:func:`product_block_terms_backward` take KDA's five slots ``(q, k, v, beta, gk)`` as
``(q, ks, vs, betas, g)`` (``ks [Bt, L, n_h, K]``, ..., ``g [Bt, L]``), so that KDA's
parallel and chunk drivers run them unchanged.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..kda.parallel import BlockTerms, block_terms, block_terms_backward, kda_parallel, solve_ut
from .fla import delta_product_form


def substeps(q, ks, vs, betas, g=None):
    """A block's tokens as a sequence of L·n_h sub-steps: ``(q at each token's last sub-step and 0
    elsewhere, k, v, β, g on each token's first sub-step broadcast over K)``, each ``[Bt, L·n_h, ·]``
    (the last None without ``g``)."""
    bt, length, n_h, dk = ks.shape
    steps = length * n_h
    zeros = q.new_zeros(bt, length, n_h - 1, dk)
    q_steps = torch.cat([zeros, q.unsqueeze(2)], dim=2).view(bt, steps, dk)
    g_steps = None if g is None else torch.cat([g[:, :, None, None].expand(bt, length, 1, dk), zeros], dim=2)
    g_steps = None if g is None else g_steps.view(bt, steps, dk)
    return q_steps, ks.reshape(bt, steps, dk), vs.reshape(bt, steps, -1), betas.reshape(bt, steps), g_steps


def product_block_terms(q, ks, vs, betas, g, scale: float, solve=solve_ut) -> BlockTerms:
    """KDA's :func:`~..kda.parallel.block_terms` over the block's sub-steps, with the scores and
    the state read kept at each token's last sub-step only (module docstring)."""
    n_h = ks.shape[2]
    terms = block_terms(*substeps(q, ks, vs, betas, g), scale, solve)
    last = slice(n_h - 1, None, n_h)
    return terms._replace(scores=terms.scores[:, last], q_read=terms.q_read[:, last])


def product_block_terms_backward(q, ks, vs, betas, terms: BlockTerms, d_wu, d_scores, d_q_read, d_k_write, d_last,
                                 scale: float, solve_adjoint) -> Tuple[torch.Tensor, ...]:
    """Adjoint of :func:`product_block_terms`: the token rows' cotangents placed at their last
    sub-steps, KDA's :func:`~..kda.parallel.block_terms_backward`, and back to the tokens
    (dq from the last sub-steps, dg from the first, summed over the channels it was broadcast
    to); returns ``(dq, dks, dvs, dbetas, dg)``."""
    bt, length, n_h, dk = ks.shape
    steps = length * n_h
    q_steps, k_steps, v_steps, beta_steps, _ = substeps(q, ks, vs, betas)
    d_scores_steps = d_scores.new_zeros(bt, steps, steps)
    d_scores_steps[:, n_h - 1::n_h] = d_scores
    d_q_read_steps = d_q_read.new_zeros(bt, steps, dk)
    d_q_read_steps[:, n_h - 1::n_h] = d_q_read
    full = terms._replace(q_read=q_steps * terms.read * scale)
    dq, dk_, dv, dbeta, dgk = block_terms_backward(q_steps, k_steps, v_steps, beta_steps, full, d_wu, d_scores_steps,
                                                   d_q_read_steps, d_k_write, d_last, scale, solve_adjoint)
    return (dq.view(bt, length, n_h, dk)[:, :, -1], dk_.view(ks.shape), dv.view(vs.shape), dbeta.view(betas.shape),
            dgk.view(bt, length, n_h, dk)[:, :, 0].sum(-1))


def delta_product_parallel(q, k, v, beta, g, h0, scale, chunk_size=None, *, ks, vs, betas):
    """DeltaProduct as one block on head-first tensors (autograd); returns ``(o, h_T)``."""
    return kda_parallel(q, ks, vs, betas, g, h0, scale, terms=product_block_terms)


parallel_gated_delta_product = delta_product_form("parallel_gated_delta_product", delta_product_parallel, doc="""
    (Gated) DeltaProduct as one UT transform over all T·n_h sub-steps (O((T·n_h)²·K) work).

    Equivalent to :func:`~fastweights.ops.recurrent_gated_delta_product`: same arguments and
    returns (``chunk_size`` is unused). Differentiable by autograd, double backward included.
""")
