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

import torch.nn.functional as F

from .._chunk import causal_mask
from ..kda.parallel import (
    BlockTerms, block_terms, block_terms_backward, exclusive_cumsum, kda_parallel, reverse_cumsum, solve_ut,
)
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from .recurrent import gated_delta_product_step


class ScalarDecay:
    """The decay factors of a per-head decay, with :class:`~..kda.parallel.RelativeDecay`'s interface:
    one matrix Γ[r, i] = e^{c_r − c_i} (i <= r, else 0) per block, ``c`` the float64 cumulative log
    decay (``b [Bt, L, K]``, equal in every channel; ``s`` unused). Every exponent is a difference
    <= 0 formed in float64, so nothing overflows and each factor is rounded once; and the products
    are a matmul times Γ instead of KDA's per-channel sub-block factors (O(L²) exps, not O(L·√L·K))."""

    def __init__(self, b: torch.Tensor, s: int, dtype: torch.dtype) -> None:
        c = b[..., 0]
        length = c.shape[-1]
        diff = c.unsqueeze(-1) - c.unsqueeze(-2)  # [Bt, L(r), L(i)]: c_r − c_i
        inside = causal_mask(length, b.device)
        self.gamma = torch.exp_(diff.masked_fill_(~inside, float("-inf")).to(dtype))

    def products(self, x: torch.Tensor, y: torch.Tensor, strict: bool) -> torch.Tensor:
        """``M[r, i] = (x_r · y_i) e^{c_r − c_i}`` for i <= r (i < r if ``strict``), else 0."""
        m = (x @ y.transpose(-1, -2)).mul_(self.gamma)
        return m.tril_(-1) if strict else m

    def products_backward(self, x, y, strict: bool, dm: torch.Tensor):
        """Adjoint of :meth:`products`: ``(dx, dy, dgk)``; dgk ``[Bt, L, K]`` holds the per-head
        gradient in channel 0 (its sum over K is the gradient of the broadcast decay). As KDA's,
        each factor's span (i, r] is summed directly: dg_t = Σ_{r >= t} Σ_{i < t} Z[r, i],
        Z = dM ⊙ M, by prefix sums along i and suffix sums along r (no difference of cumsums)."""
        w = dm.tril(-1 if strict else 0) * self.gamma
        dx, dy = w @ y, w.transpose(-1, -2) @ x
        z = w.mul_(x @ y.transpose(-1, -2))
        spans = reverse_cumsum(exclusive_cumsum(z, dim=-1), dim=-2).diagonal(dim1=-2, dim2=-1)  # [Bt, L]
        return dx, dy, F.pad(spans.unsqueeze(-1), (0, x.shape[-1] - 1))


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
    terms = block_terms(*substeps(q, ks, vs, betas, g), scale, solve, decay_type=ScalarDecay)
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


def delta_product_parallel(q, k, v, beta, g, h0, scale, *, ks, vs, betas):
    """DeltaProduct as one block on head-first tensors (autograd); returns ``(o, h_T)``."""
    return kda_parallel(q, ks, vs, betas, g, h0, scale, terms=product_block_terms)


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_GATED_DELTA_PRODUCT = OpSpec("parallel_gated_delta_product", Rule.DELTA, Form.PARALLEL, torch=delta_product_parallel, step=gated_delta_product_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.delta_product.api", "parallel_gated_delta_product")
