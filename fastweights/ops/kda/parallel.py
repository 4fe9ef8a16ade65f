"""Kimi Delta Attention, parallel form: the whole sequence as one block of the UT transform.

For a block of L tokens with incoming state h (README.md in this folder derives it),
with b_r = gk_1 + ... + gk_r ∈ ℝ^K the cumulative log decay of each key channel:

    S[r, i] = Σ_d k_r[d] k_i[d] e^{b_r[d] − b_i[d]}   (i < r)       decayed key products
    P[r, i] = scale · Σ_d q_r[d] k_i[d] e^{b_r[d] − b_i[d]}  (i ≤ r)   decayed scores
    [W | U] = (I + diag(β) S)⁻¹ diag(β) [K ⊙ e^b | V]                 the UT transform
    U' = U − W h
    O  = scale · (Q ⊙ e^b) h + P U'
    h ← diag(e^{b_L}) h + (K ⊙ e^{b_L − b})ᵀ U'

Unlike a per-head decay, e^{b_r − b_i} varies along the channel d, so S and P are not a
decay mask times K Kᵀ. Writing them as (K ⊙ e^b)(K ⊙ e^{−b})ᵀ overflows: e^{−b_i} reaches
e^{6.9·L} for α = 1e-3 per token. :func:`decayed_products` computes them in the
*relative* form instead: rows in sub-blocks of s tokens, each sub-block measured from its
own start m, so every exponential it takes is e^{b_r − b_m} or e^{b_m − b_i} with
i < m ≤ r, both ≤ 1; pairs inside a sub-block are summed exactly.

The parallel form runs this on one block of length T (O(T²·K) work and O(T²) memory) and
differentiates it by autograd; the chunk form (``chunk.py``) runs it per chunk of C tokens
with a hand-written backward (:func:`block_terms_backward`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .._chunk import causal_mask
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..step import kda_step

#: The parallel form pads T to a multiple of this (zero tokens), so that its sub-blocks divide it.
SUB_BLOCK = 16


def sub_block(length: int) -> int:
    """The sub-block size s for blocks of ``length`` tokens: the largest divisor of L up to √L.

    Inside the sub-blocks the products are summed exactly (O(L·s·K) elementwise work), across
    them by matmuls of factors taken once per sub-block (O(L²·K/s) elementwise); s ≈ √L
    balances the two (C = 32, 64, 128: s = 4, 8, 8).
    """
    top = max(1, int(length ** 0.5))
    return next(s for s in range(min(top, length), 0, -1) if length % s == 0)


class RelativeDecay:
    """The decay factors of :func:`decayed_products` for a cumulative log decay ``b [Bt, L, K]``
    (non-increasing along L), rows in nb sub-blocks of s tokens; built once per block and
    shared by every product with that decay (S and P).

    The reference point of sub-block j is the token before it, m_j = js − 1 (b_{−1} = 0), so
    b_r − b_m <= 0 for its rows r >= js and b_m − b_i <= 0 for every column i <= js − 1:

    - ``e_left [Bt, nb, s, K]``: e^{b_r − b_m(r)};
    - ``e_right [Bt, nb, L, K]``: e^{b_m − b_i} for i < m + 1, else 0 (a product of two <= 1 factors);
    - ``e_diag [Bt, nb, s, s, K]``: e^{b_r − b_i} for i <= r inside a sub-block, else 0.

    ``b`` is float64 (:func:`cumulative_decay`): the exponents are differences of cumulative
    sums that may be large (−6.9·C), formed exactly there and rounded to ``dtype`` only as
    differences, so each factor carries the rounding of its own exponent, as a product of α's
    in the recurrence does, and not that of b's magnitude.
    """

    def __init__(self, b: torch.Tensor, s: int, dtype: torch.dtype) -> None:
        bt, length, dk = b.shape
        nb = length // s
        self.s, self.nb = s, nb
        bb = b.view(bt, nb, s, dk)
        refs = torch.cat([b.new_zeros(bt, 1, dk), bb[:, :-1, -1]], dim=1)  # [Bt, nb, K]
        self.e_left = torch.exp((bb - refs.unsqueeze(2)).to(dtype))
        before = torch.arange(length, device=b.device)[None, :] < (torch.arange(nb, device=b.device) * s)[:, None]
        self.before_m = before[None, :, :, None].to(dtype)  # [1, nb, L, 1]: token t lies before sub-block j
        # e^{b_m − b_i} for column i in sub-block j' < j, as e^{b_m(j) − b_e(j')} · e^{b_e(j') − b_i} with
        # e(j') the last token of sub-block j': two <= 1 factors, exponents on [nb, nb] and [L] only.
        ends = bb[:, :, -1]  # [Bt, nb, K]
        to_end = torch.exp((ends.unsqueeze(2) - bb).to(dtype))  # [Bt, nb(j'), s, K]
        earlier = causal_mask(nb, b.device, -1)  # j' < j
        across = (refs.unsqueeze(2) - ends.unsqueeze(1)).to(dtype).masked_fill_(~earlier[None, :, :, None], float("-inf"))
        self.e_right = (torch.exp_(across).unsqueeze(3) * to_end.unsqueeze(1)).view(bt, nb, length, dk)
        diff = (bb.unsqueeze(3) - bb.unsqueeze(2)).to(dtype)  # [Bt, nb, s(r), s(i), K]: b_r − b_i
        inside = causal_mask(s, b.device)
        self.e_diag = torch.exp_(diff.masked_fill_(~inside[None, None, :, :, None], float("-inf")))

    def products(self, x: torch.Tensor, y: torch.Tensor, strict: bool) -> torch.Tensor:
        """``M[.., r, i] = Σ_d x[r, d] y[i, d] e^{b[r, d] − b[i, d]}`` for i <= r (i < r if ``strict``), else 0.

        ``x, y [Bt, L, K]`` -> ``[Bt, L, L]``. Pairs in different sub-blocks: one batched product of
        the <= 1 factors x ⊙ e_left and y ⊙ e_right; pairs inside a sub-block: summed exactly.
        """
        bt, length, dk = x.shape
        nb, s = self.nb, self.s
        left = x.view(bt, nb, s, dk) * self.e_left
        right = y.unsqueeze(1) * self.e_right
        m = (left @ right.transpose(-1, -2)).view(bt, length, length)  # sub-blocks below the diagonal
        diag = (x.view(bt, nb, s, 1, dk) * self.e_diag * y.view(bt, nb, 1, s, dk)).sum(-1)  # [Bt, nb, s, s]
        if strict:
            diag = diag.tril(-1)
        m.view(bt, nb, s, nb, s).diagonal(dim1=1, dim2=3).add_(diag.permute(0, 2, 3, 1))  # in place
        return m

    def products_backward(
        self, x: torch.Tensor, y: torch.Tensor, strict: bool, dm: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Adjoint of :meth:`products`: ``dM [Bt, L, L]`` (only the causal triangle is read) ->
        ``(dx, dy, dgk)``, each ``[Bt, L, K]``.

        Off the diagonal blocks M = left · rightᵀ: d left = dM right, d right = dMᵀ left. Each
        factor is f·e^{(sum of gk over a span)}, so its ∂/∂gk_t is f for every t in that span
        and 0 elsewhere: left's span is (m, r], right's is (i, m], a pair's inside a sub-block
        (i, r]. Each span is summed directly (cumulative sums of the terms whose span holds t),
        never as a difference of two cumulative sums: with strong decays those would cancel to a
        small dgk_t and leave the rounding of all later terms behind (fp32 errors ~10x the
        recurrence's).
        """
        bt, length, dk = x.shape
        nb, s = self.nb, self.s
        dm = dm.tril(-1 if strict else 0)
        left = x.view(bt, nb, s, dk) * self.e_left
        right = y.unsqueeze(1) * self.e_right
        d_off = dm.view(bt, nb, s, length)
        d_left = d_off @ right  # [Bt, nb, s, K]
        d_right = d_off.transpose(-1, -2) @ left  # [Bt, nb, L, K]
        dx = (d_left * self.e_left).view(bt, length, dk)
        dy = (d_right * self.e_right).sum(1)
        # left: span (m_j, r] inside sub-block j; right: span (i, m_j] for columns i < js
        dgk = reverse_cumsum(d_left.mul_(left), dim=2).view(bt, length, dk)
        dgk = dgk + exclusive_cumsum(d_right.mul_(right), dim=2).mul_(self.before_m).sum(1)
        # inside the sub-blocks: Z[r, i] = dM[r, i] x_r y_i e^{b_r − b_i}, span (i, r]
        xb, yb = x.view(bt, nb, s, 1, dk), y.view(bt, nb, 1, s, dk)
        d_diag = dm.view(bt, nb, s, nb, s).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).unsqueeze(-1)
        weighted = d_diag * self.e_diag  # dM[r, i] e^{b_r − b_i}, [Bt, nb, s, s, K]
        dx = dx + (weighted * yb).sum(3).view(bt, length, dk)
        dy = dy + (weighted * xb).sum(2).view(bt, length, dk)
        z = weighted.mul_(xb).mul_(yb)
        # Σ_{r >= t} Σ_{i < t} Z[r, i]: prefix sums along i, suffix sums along r, at r = t
        spans = reverse_cumsum(exclusive_cumsum(z, dim=3), dim=2).diagonal(dim1=2, dim2=3)  # [Bt, nb, K, s]
        return dx, dy, dgk + spans.transpose(-1, -2).reshape(bt, length, dk)


def exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``y_t = Σ_{i < t} x_i`` along ``dim`` (shifted, not a difference: no cancellation)."""
    n = x.shape[dim]
    return torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), x.narrow(dim, 0, n - 1).cumsum(dim)], dim)


def reverse_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``y_t = Σ_{i >= t} x_i`` along ``dim``."""
    return x.flip(dim).cumsum(dim).flip(dim)


def cumulative_decay(gk: torch.Tensor) -> torch.Tensor:
    """``b = cumsum(gk)`` along the block (dim −2), in float64 (see :class:`RelativeDecay`)."""
    return gk.to(torch.float64).cumsum(-2)


def decayed_products(x: torch.Tensor, y: torch.Tensor, gk: torch.Tensor, strict: bool, s: int) -> torch.Tensor:
    """``Σ_d x[r, d] y[i, d] e^{b[r, d] − b[i, d]}`` on the causal triangle, b = cumsum(gk)
    (:meth:`RelativeDecay.products`)."""
    return RelativeDecay(cumulative_decay(gk), s, x.dtype).products(x, y, strict)


class BlockTerms(NamedTuple):
    """Everything of a block (``[Bt, L, ·]``) that does not depend on the incoming state (module docstring)."""

    decay: RelativeDecay     # the relative factors of b = cumsum(gk)
    read: torch.Tensor       # e^b
    to_end: torch.Tensor     # e^{b_L − b}
    s: torch.Tensor          # [Bt, L, L] S, strictly lower
    scores: torch.Tensor     # [Bt, L, L] P, lower (diagonal included)
    q_read: torch.Tensor     # scale · Q ⊙ e^b
    k_write: torch.Tensor    # K ⊙ e^{b_L − b}
    last: torch.Tensor       # [Bt, K] e^{b_L}
    wu: torch.Tensor         # [Bt, L, K + V] [W | U]
    solver: Optional[torch.Tensor]  # what the solve keeps for its adjoint (chunk form), or None


def solve_ut(s: torch.Tensor, beta: torch.Tensor, rhs: torch.Tensor) -> Tuple[torch.Tensor, None]:
    """``(I + diag(β) S)⁻¹ diag(β) R`` by one batched triangular solve (autograd-friendly)."""
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device)
    y = torch.linalg.solve_triangular(eye + beta.unsqueeze(-1) * s, beta.unsqueeze(-1) * rhs, upper=False,
                                      unitriangular=True)
    return y, None


def block_terms(q, k, v, beta, gk, scale: float, solve=solve_ut, decay_type=RelativeDecay) -> BlockTerms:
    """The state-free terms of blocks ``q, k, gk [Bt, L, K]``, ``v [Bt, L, V]``, ``beta [Bt, L]``
    (L a multiple of :func:`sub_block`'s size). ``solve(S, β, R)`` returns ``((I + diag(β) S)⁻¹ diag(β) R,
    what its adjoint needs)``. ``decay_type`` builds the decay factors (:class:`RelativeDecay`'s
    interface; a per-head decay broadcast over K may pass a cheaper one)."""
    b = cumulative_decay(gk)
    decay = decay_type(b, sub_block(q.shape[-2]), q.dtype)
    read, to_end = torch.exp(b.to(q.dtype)), torch.exp((b[:, -1:] - b).to(q.dtype))
    s = decay.products(k, k, strict=True)
    scores = decay.products(q, k, strict=False) * scale
    wu, solver = solve(s, beta, torch.cat([k * read, v], dim=-1))
    return BlockTerms(decay, read, to_end, s, scores, q * read * scale, k * to_end, read[:, -1], wu, solver)


def block_terms_backward(q, k, v, beta, terms: BlockTerms, d_wu, d_scores, d_q_read, d_k_write, d_last,
                         scale: float, solve_adjoint):
    """Adjoint of :func:`block_terms`; returns ``(dq, dk, dv, dbeta, dgk)``.

    ``solve_adjoint(A, solver, dY)`` returns ``(I + A)⁻ᵀ dY`` (A = diag(β) S). Through
    Y = (I + A)⁻¹ Z with Z = diag(β) R: dZ = (I + A)⁻ᵀ dY, dA = −tril(dZ Yᵀ, −1); then A = diag(β) S
    and Z = diag(β) [K ⊙ e^b | V] give dβ, dS, dK, dV and db. README.md in this folder, step by step.
    """
    dk_ = k.shape[-1]
    read = terms.read
    a = beta.unsqueeze(-1) * terms.s
    dz = solve_adjoint(a, terms.solver, d_wu)
    da = -(dz @ terms.wu.transpose(-1, -2)).tril_(-1)
    k_read = k * read
    dbeta = (dz[..., :dk_] * k_read).sum(-1) + (dz[..., dk_:] * v).sum(-1) + (da * terms.s).sum(-1)
    dr = dz * beta.unsqueeze(-1)
    dv = dr[..., dk_:]
    ds = da * beta.unsqueeze(-1)
    # S = decayed(K, K), P = scale · decayed(Q, K)
    dx_s, dy_s, dgk_s = terms.decay.products_backward(k, k, True, ds)
    dq_p, dk_p, dgk_p = terms.decay.products_backward(q, k, False, d_scores * scale)
    # K ⊙ e^b, scale·Q ⊙ e^b, K ⊙ e^{b_L − b}, e^{b_L}
    dk_read = dr[..., :dk_]
    dq = d_q_read * read * scale + dq_p
    dk = dk_read * read + d_k_write * terms.to_end + dx_s + dy_s + dk_p
    # gk_t enters e^{b_r} for r >= t, e^{b_L − b_r} for r < t and e^{b_L} always (spans summed directly)
    dgk = reverse_cumsum(dk_read * k_read + d_q_read * terms.q_read, dim=-2)
    dgk = dgk + exclusive_cumsum(d_k_write * terms.k_write, dim=-2) + (d_last * terms.last).unsqueeze(-2)
    return dq, dk, dv, dbeta, dgk + dgk_s + dgk_p


def pad_tokens(x: Optional[torch.Tensor], length: int) -> Optional[torch.Tensor]:
    """Zero-pad ``[N, H, T, ...]`` along T to ``length``: no-op tokens (k = v = β = gk = 0)."""
    if x is None or x.shape[2] == length:
        return x
    widths = [0, 0] * (x.dim() - 3) + [0, length - x.shape[2]]
    return F.pad(x, widths)


def kda_parallel(q, k, v, beta, gk, h0, scale, terms=block_terms) -> Tuple[torch.Tensor, torch.Tensor]:
    """KDA as one block on head-first tensors ``[N, H, T, ·]`` (autograd); returns ``(o, h_T)``.

    ``terms`` computes the block's :class:`BlockTerms` from the five per-token inputs (another
    rule with KDA's block structure, GDN-2, passes its own)."""
    n, nh, t_len, dk = q.shape  # (k may carry more per token: DeltaProduct's sub-steps)
    dv = v.shape[-1]
    length = -(-t_len // SUB_BLOCK) * SUB_BLOCK if t_len > SUB_BLOCK else t_len
    q, k, v, beta, gk = (pad_tokens(t, length).reshape((n * nh, length) + t.shape[3:]) for t in (q, k, v, beta, gk))
    terms = terms(q, k, v, beta, gk, scale)
    w, u = terms.wu[..., :dk], terms.wu[..., dk:]
    if h0 is None:
        o, h = terms.scores @ u, terms.k_write.transpose(-1, -2) @ u
    else:
        h0 = h0.reshape(n * nh, dk, dv)
        u = u - w @ h0
        o = terms.q_read @ h0 + terms.scores @ u
        h = terms.last.unsqueeze(-1) * h0 + terms.k_write.transpose(-1, -2) @ u
    return o.view(n, nh, length, dv)[:, :, :t_len], h.view(n, nh, dk, dv)


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_KDA = OpSpec("parallel_kda", Rule.DELTA, Form.PARALLEL, torch=kda_parallel, step=kda_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.kda.api", "parallel_kda")
