"""Gated DeltaNet-2, parallel form: the whole sequence as one block of KDA's UT transform.

GDN-2's write is ``u_r = w_r ⊙ v_r − h'ᵀ e_r`` with the erase key ``e_r = b_r ⊙ k_r``, added
along k_r. Inside a block of L tokens entering with state h (c_r = g_1 + … + g_r ∈ ℝ^K),
the derivation of ``ops/kda/README.md`` goes through with e in the place of β k and
x = w ⊙ v in the place of β v (README.md in this folder):

    S[r, i] = Σ_d e_r[d] k_i[d] e^{c_r[d] − c_i[d]}   (i < r)        erase keys against write keys
    [W | U] = (I + S)⁻¹ [E ⊙ e^c | X]                                 the UT transform
    U' = U − W h
    O  = scale · (Q ⊙ e^c) h + P U',    h ← diag(e^{c_L}) h + (K ⊙ e^{c_L − c})ᵀ U'

with KDA's scores P and KDA's relative (sub-block reference point) decay factors, so no
exponential of a positive number is ever taken. Only S changes: it is no longer
symmetric in its two keys. :func:`gdn2_block_terms` and :func:`gdn2_block_terms_backward`
are those terms and their adjoint; KDA's parallel and chunk drivers run them.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..kda.parallel import (
    BlockTerms, RelativeDecay, cumulative_decay, exclusive_cumsum, kda_parallel, reverse_cumsum, solve_ut, sub_block,
)
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from .recurrent import gdn2_step


def gdn2_block_terms(q, k, x, e, g, scale: float, solve=solve_ut) -> BlockTerms:
    """The state-free terms of blocks ``q, k, e, g [Bt, L, K]``, ``x [Bt, L, V]`` (e = b ⊙ k,
    x = w ⊙ v): KDA's :func:`~..kda.parallel.block_terms` with S = decayed(E, K) and the
    right-hand side [E ⊙ e^c | X] (β = 1: the gates are inside e and x). The arguments sit in
    KDA's slots ``(q, k, v, beta, gk)``, so that KDA's drivers run these terms unchanged."""
    c = cumulative_decay(g)
    decay = RelativeDecay(c, sub_block(q.shape[-2]), q.dtype)
    read, to_end = torch.exp(c.to(q.dtype)), torch.exp((c[:, -1:] - c).to(q.dtype))
    s = decay.products(e, k, strict=True)
    scores = decay.products(q, k, strict=False) * scale
    ones = q.new_ones(q.shape[:-1])
    wu, solver = solve(s, ones, torch.cat([e * read, x], dim=-1))
    return BlockTerms(decay, read, to_end, s, scores, q * read * scale, k * to_end, read[:, -1], wu, solver)


def gdn2_block_terms_backward(q, k, x, e, terms: BlockTerms, d_wu, d_scores, d_q_read, d_k_write, d_last,
                              scale: float, solve_adjoint) -> Tuple[torch.Tensor, ...]:
    """Adjoint of :func:`gdn2_block_terms`; returns ``(dq, dk, dx, de, dg)`` (KDA's order).

    ``solve_adjoint(A, solver, dY)`` returns ``(I + A)⁻ᵀ dY``. With Y = (I + S)⁻¹ Z,
    Z = [E ⊙ e^c | X]: dZ = (I + S)⁻ᵀ dY, dS = −tril(dZ Yᵀ, −1); then S = decayed(E, K),
    P = scale · decayed(Q, K) and the decay factors (spans summed directly, as KDA's).
    """
    dk_ = k.shape[-1]
    read = terms.read
    dz = solve_adjoint(terms.s, terms.solver, d_wu)
    ds = -(dz @ terms.wu.transpose(-1, -2)).tril_(-1)
    dz_key = dz[..., :dk_]
    de_s, dk_s, dg_s = terms.decay.products_backward(e, k, True, ds)
    dq_p, dk_p, dg_p = terms.decay.products_backward(q, k, False, d_scores * scale)
    dq = d_q_read * read * scale + dq_p
    dk = d_k_write * terms.to_end + dk_s + dk_p
    de = dz_key * read + de_s
    # g_t enters e^{c_r} for r >= t, e^{c_L − c_r} for r < t and e^{c_L} always
    dg = reverse_cumsum(dz_key * e * read + d_q_read * terms.q_read, dim=-2)
    dg = dg + exclusive_cumsum(d_k_write * terms.k_write, dim=-2) + (d_last * terms.last).unsqueeze(-2)
    return dq, dk, dz[..., dk_:], de, dg + dg_s + dg_p


def gdn2_parallel(q, k, v, beta, g, h0, scale, *, b, w) -> Tuple[torch.Tensor, torch.Tensor]:
    """GDN-2 as one block on head-first tensors ``[N, H, T, ·]`` (autograd); returns ``(o, h_T)``."""
    return kda_parallel(q, k, w * v, b * k, g, h0, scale, terms=gdn2_block_terms)


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_GDN2 = OpSpec("parallel_gdn2", Rule.DELTA, Form.PARALLEL, torch=gdn2_parallel, step=gdn2_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.gdn2.api", "parallel_gdn2")
