"""The DPLR delta rule, parallel form: one block of the UT transform with two write paths.

Inside a block of L tokens entering with state h (c_r = gk_1 + … + gk_r per key channel),
the state after token r is h_r = D_r h + Σ_{i≤r} diag(e^{c_r − c_i}) (k_i v_iᵀ + b_i u_iᵀ)
with the pseudo-values u_i = a_iᵀ h_{i−1} (README.md in this folder). Reading row i:

    (I − A_ab) U = (A ⊙ e^{c_{i−1}}) h + A_ak V,
    A_ab[i, j] = Σ_d a_i b_j e^{c_{i−1} − c_j},  A_ak[i, j] = Σ_d a_i k_j e^{c_{i−1} − c_j}   (j < i)

so with [W | U₀] = (I − A_ab)⁻¹ [A ⊙ e^{c − gk} | A_ak V], U = U₀ + W h, and

    O  = scale · (Q ⊙ e^c) h + A_qk V + A_qb U,     A_qk, A_qb: KDA's decayed scores (j ≤ i)
    h' = diag(e^{c_L}) h + (K ⊙ e^{c_L − c})ᵀ V + (B ⊙ e^{c_L − c})ᵀ U.

This is KDA's block shape with 2L pseudo-rows: u = [U₀; V], w = [−W; 0] (so U' = u − w h is
[U; V]), scores [A_qb | A_qk] and write keys [B ⊙ e^{c_L − c}; K ⊙ e^{c_L − c}], so KDA's parallel
and chunk drivers run it unchanged. The four decayed products use KDA's relative sub-block
factors (every exponential of a number <= 0) with a ⊙ e^{−gk} as the row factor of A_ab and
A_ak: one token's e^{−gk}, finite for gk >= −80 in fp32 (the front end checks it).

The slots of KDA's drivers ``(q, k, v, beta, gk)`` carry ``(q, k, v, ab, gk)``, ``ab [.., 2, K]``
the pair stacked. The parallel form differentiates these terms by autograd; the chunk form's
backward runs their hand-written adjoint, :func:`dplr_block_terms_backward`.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch

from .._halving import halving_products_backward
from ..kda.parallel import BlockTerms, cumulative_decay, exclusive_cumsum, kda_parallel, reverse_cumsum, sub_block
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from .recurrent import dplr_step


def _paired_products(c, xs, ys, s: int, dtype):
    """The four decayed products ``M_xy[.., r, i] = Σ_d x[r, d] y[i, d] e^{c_r − c_i}`` (i <= r) of the
    two row operands ``xs [Bt, nb, 2, s, K]`` (a ⊙ e^{−gk}, q; per sub-block) and the two column
    operands ``ys`` (b, k), with KDA's relative sub-block factors (:class:`~..kda.parallel.RelativeDecay`: every
    exponential of a number <= 0, pairs inside a sub-block summed exactly); returns
    ``m [Bt, nb, 2s, 2L]`` (rows: sub-block j, then operand x and row r in it; columns: operand y,
    then token i) and ``diag [Bt, 2, 2, nb, s, s]`` (the pairs inside sub-block j, i <= r; a view).

    The factors are formed once for the block and shared: each x ⊙ e^{c_r − c_m(j)} and
    y ⊙ e^{c_e(j') − c_i} is taken once (not once per product); the cross-sub-block factor
    e^{c_m(j) − c_e(j')} scales the rows of sub-blocks j > j' only (not a full nb × nb grid), and
    one batched product per column sub-block gives all four products' pairs; inside a sub-block
    only the exponents of the lower triangle are taken."""
    bt, nb, _, _, dk = xs.shape
    length = nb * s
    cb = c.view(bt, nb, s, dk)
    ends = cb[:, :, -1]  # [Bt, nb, K] c at the last token of each sub-block
    refs = torch.cat([c.new_zeros(bt, 1, dk), ends[:, :-1]], dim=1)  # c_m(j), the token before sub-block j
    e_left = torch.exp((cb - refs.unsqueeze(2)).to(dtype))  # [Bt, nb, s, K]
    e_end = torch.exp((ends.unsqueeze(2) - cb).to(dtype))  # [Bt, nb, s, K] e^{c_e(j) − c_i}
    left = (xs * e_left.unsqueeze(2)).view(bt, nb, 2 * s, dk)
    ends_y = (ys * e_end.unsqueeze(2)).view(bt, nb, 2 * s, dk)
    # pairs in different sub-blocks j' < j, column sub-block j' at a time: the rows after it scaled by
    # e^{c_m(j) − c_e(j')} (m(j) = e(j − 1), so <= 0), one batched product with its scaled columns
    m = xs.new_zeros(bt, nb, 2 * s, 2, nb, s)  # [Bt, nb(j), 2s (x, r), 2(y), nb(j'), s(i)]
    for jp in range(nb - 1):
        across = torch.exp((refs[:, jp + 1:] - ends[:, jp:jp + 1]).to(dtype))  # [Bt, nb − j' − 1, K]
        rows = (left[:, jp + 1:] * across.unsqueeze(2)).view(bt, -1, dk)
        m[:, jp + 1:, :, :, jp].copy_((rows @ ends_y[:, jp].transpose(-1, -2)).view(bt, nb - jp - 1, 2 * s, 2, s))
    m = m.view(bt, nb, 2 * s, 2 * length)
    # y_i ⊙ e^{c_r − c_i} (i <= r in a sub-block) laid out per row r, one offset r − i = δ at a time
    # (the exponents of the lower triangle only); then one small product per row: [x_r] @ [y ⊙ e]ᵀ
    y_blocks = ys  # [Bt, nb, 2, s, K]
    y_diag = xs.new_empty(bt, nb, s, 2, s, dk)  # [Bt, nb, s(r), 2(y), s(i), K]
    y_diag.diagonal(dim1=2, dim2=4).copy_(y_blocks.transpose(-1, -2))
    for delta in range(1, s):
        y_diag.diagonal(delta, dim1=2, dim2=4).zero_()  # i > r
        e = torch.exp((cb[:, :, delta:] - cb[:, :, :-delta]).to(dtype))  # [Bt, nb, s − δ, K] e^{c_{i+δ} − c_i}
        y_diag.diagonal(-delta, dim1=2, dim2=4).copy_((y_blocks[:, :, :, :-delta] * e.unsqueeze(2)).transpose(-1, -2))
    x_rows = xs.transpose(2, 3)  # [Bt, nb, s, 2, K]
    diag = x_rows @ y_diag.view(bt, nb, s, 2 * s, dk).transpose(-1, -2)  # [Bt, nb, s(r), 2(x), 2s (y, i)]
    return m, diag.view(bt, nb, s, 2, 2, s).permute(0, 3, 4, 1, 2, 5)


class DplrSaved(NamedTuple):
    """What :func:`dplr_block_terms_backward` reads of a block beyond KDA's :class:`~..kda.parallel.BlockTerms`
    (kept in its ``solver`` slot)."""

    c: torch.Tensor          # [Bt, L, K] float64 cumulative log decay
    exp_neg_gk: torch.Tensor  # e^{−gk}
    a_shift: torch.Tensor    # a ⊙ e^{−gk}, the row operand of A_ab and A_ak
    a_ak: torch.Tensor       # [Bt, L, L] A_ak, strictly lower


def dplr_block_core(q, k, v, ab, gk, scale: float):
    """What :func:`dplr_block_terms` needs of blocks ``q, k, gk [Bt, L, K]``, ``v [Bt, L, V]``,
    ``ab [Bt, L, 2, K]``: ``(read, to_end, a_ab, scores, wu, saved)``, the scores ``[A_qb | A_qk]``
    scaled, ``wu = [W | U₀]`` (module docstring) and ``saved`` a :class:`DplrSaved`."""
    a, b = ab[..., 0, :], ab[..., 1, :]
    bt, length, dk = q.shape
    s = sub_block(length)
    nb = length // s
    c = cumulative_decay(gk)
    read, to_end = torch.exp(c.to(q.dtype)), torch.exp((c[:, -1:] - c).to(q.dtype))
    exp_neg_gk = torch.exp(-gk)
    a_shift = a * exp_neg_gk  # a_i e^{c_{i−1} − c_j} = (a_i e^{−gk_i}) e^{c_i − c_j}
    m, diag = _paired_products(c, torch.stack([t.reshape(bt, nb, s, dk) for t in (a_shift, q)], dim=2),
                               torch.stack([t.reshape(bt, nb, s, dk) for t in (b, k)], dim=2), s, q.dtype)
    # pairs inside a sub-block: A_ab and A_ak strictly below the diagonal, the scores on it too
    diag[:, 0].diagonal(dim1=-2, dim2=-1).zero_()
    m.view(bt, nb, 2, s, 2, nb, s).diagonal(dim1=1, dim2=5).add_(diag.permute(0, 1, 4, 2, 5, 3))
    a_ab = m[:, :, :s, :length].reshape(bt, length, length)
    a_ak = m[:, :, :s, length:].reshape(bt, length, length)
    scores = m[:, :, s:].reshape(bt, length, 2 * length) * scale  # [A_qb | A_qk]
    eye = torch.eye(length, dtype=q.dtype, device=q.device)
    rhs = torch.cat([a * torch.exp((c - gk.to(c.dtype)).to(q.dtype)), a_ak @ v], dim=-1)
    wu = torch.linalg.solve_triangular(eye - a_ab, rhs, upper=False, unitriangular=True)  # [W | U₀]
    return read, to_end, a_ab, scores, wu, DplrSaved(c, exp_neg_gk, a_shift, a_ak)


def block_terms_of(q, k, v, ab, read, to_end, neg_a_ab, scores, wu, saved: DplrSaved, scale: float) -> BlockTerms:
    """KDA's :class:`~..kda.parallel.BlockTerms` with 2L pseudo-rows from a block's DPLR terms (module
    docstring): ``s`` holds −A_ab (its diagonal is never read), ``solver`` the :class:`DplrSaved`."""
    b = ab[..., 1, :]
    dk = q.shape[-1]
    rows = torch.cat([torch.cat([-wu[..., :dk], wu[..., dk:]], dim=-1), torch.cat([torch.zeros_like(k), v], dim=-1)],
                     dim=-2)
    k_write = torch.cat([b * to_end, k * to_end], dim=-2)
    return BlockTerms(None, read, to_end, neg_a_ab, scores, q * read * scale, k_write, read[:, -1], rows, saved)


def dplr_block_terms(q, k, v, ab, gk, scale: float, solve=None) -> BlockTerms:
    """The state-free terms of blocks ``q, k, gk [Bt, L, K]``, ``v [Bt, L, V]``, ``ab [Bt, L, 2, K]``
    in KDA's :class:`~..kda.parallel.BlockTerms` shape with 2L pseudo-rows (module docstring;
    :func:`block_terms_of`), differentiable by autograd (the parallel form). ``solve`` is unused
    (one unit-triangular solve). ``decay`` is None: the four products share their factors
    (:func:`_paired_products`); :func:`dplr_block_terms_backward` is their adjoint."""
    read, to_end, a_ab, scores, wu, saved = dplr_block_core(q, k, v, ab, gk, scale)
    return block_terms_of(q, k, v, ab, read, to_end, -a_ab, scores, wu, saved, scale)


def dplr_block_terms_backward(q, k, v, ab, terms: BlockTerms, d_wu, d_scores, d_q_read, d_k_write, d_last,
                              scale: float, solve_adjoint=None) -> Tuple[torch.Tensor, ...]:
    """The adjoint of :func:`dplr_block_terms` (or of any :class:`~..kda.parallel.BlockTerms` built by
    :func:`block_terms_of`), by hand; returns ``(dq, dk, dv, dab, dgk)`` (KDA's order, ``ab``'s slot).
    ``solve_adjoint`` is unused (KDA's driver passes its own; here the solve's adjoint is one
    unit upper-triangular solve).

    The pseudo-rows are Ŷ = [−W | U₀] over the first L rows and [0 | V] over the last L. With
    Ŷ = (I − A_ab)⁻¹ Ẑ, Ẑ = [−A ⊙ e^{c − gk} | A_ak V]:

        dẐ = (I − A_ab)⁻ᵀ dŶ,     dA_ab = tril(dẐ Ŷᵀ, −1),
        dA_ak = tril(dẐ_U Vᵀ, −1),  dV = dŶ_V + A_akᵀ dẐ_U,  d(A ⊙ e^{c − gk}) = −dẐ_W;

    then the four decayed products' adjoint (:func:`~.._halving.halving_products_backward`: rows
    a ⊙ e^{−gk} and scale·q, columns b and k), the rows' e^{−gk}, and the factors of gk taken
    span by span, each summed directly: e^{c_r} (Q̂) for t <= r, e^{c_{r−1}} (the solve's
    right-hand side) for t < r, e^{c_L − c_r} (the write keys) for t > r, e^{c_L} for every t."""
    b = ab[..., 1, :]
    saved: DplrSaved = terms.solver
    length, dk = q.shape[-2], q.shape[-1]
    read, to_end = terms.read, terms.to_end
    wu_hat = terms.wu[:, :length]  # [−W | U₀]
    dz = torch.linalg.solve_triangular(terms.s.transpose(-1, -2), d_wu[:, :length], upper=True, unitriangular=True)
    dz_u = dz[..., dk:]
    d_products = q.new_empty(2, 2, *terms.s.shape)
    torch.matmul(dz, wu_hat.transpose(-1, -2), out=d_products[0, 0]).tril_(-1)  # dA_ab
    torch.matmul(dz_u, v.transpose(-1, -2), out=d_products[0, 1]).tril_(-1)  # dA_ak
    d_products[1, 0] = d_scores[..., :length]
    d_products[1, 1] = d_scores[..., length:]
    dv = torch.baddbmm(d_wu[:, length:, dk:], saved.a_ak.transpose(-1, -2), dz_u)
    rows = torch.stack([saved.a_shift, q * scale], dim=-2)
    d_rows, d_cols, dgk = halving_products_backward(saved.c, rows, torch.stack([b, k], dim=-2), d_products)
    d_rhs_w = dz[..., :dk].neg()  # d(A ⊙ e^{c − gk}); A ⊙ e^{c − gk} = (a ⊙ e^{−gk}) ⊙ e^c
    da = (d_rows[:, :, 0] + d_rhs_w * read) * saved.exp_neg_gk
    dgk -= d_rows[:, :, 0] * saved.a_shift  # the rows' e^{−gk}
    dq = (d_rows[:, :, 1] + d_q_read * read) * scale
    db = torch.addcmul(d_cols[:, :, 0], d_k_write[:, :length], to_end)
    dk_ = torch.addcmul(d_cols[:, :, 1], d_k_write[:, length:], to_end)
    # spans of gk_t: t <= r (e^{c_r}), t < r (e^{c_{r−1}}: token r + 1's term moved to r), t > r, every t
    suffix = d_q_read * terms.q_read
    suffix[:, :-1] += d_rhs_w[:, 1:] * saved.a_shift[:, 1:] * read[:, 1:]
    from_writes = d_k_write * terms.k_write
    dgk += reverse_cumsum(suffix, dim=-2)
    dgk += exclusive_cumsum(from_writes[:, :length] + from_writes[:, length:], dim=-2)
    dgk += (d_last * terms.last).unsqueeze(-2)
    return dq, dk_, dv, torch.stack([da, db], dim=-2), dgk


def dplr_parallel(q, k, v, beta, gk, h0, scale, *, a, b) -> Tuple[torch.Tensor, torch.Tensor]:
    """The DPLR delta rule as one block on head-first tensors ``[N, H, T, ·]`` (autograd)."""
    return kda_parallel(q, k, v, torch.stack([a, b], dim=-2), gk, h0, scale, terms=dplr_block_terms)


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_DPLR_DELTA_RULE = OpSpec("parallel_dplr_delta_rule", Rule.DELTA, Form.PARALLEL, torch=dplr_parallel, step=dplr_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.dplr.api", "parallel_dplr_delta_rule")
