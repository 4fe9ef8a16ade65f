"""The UT / WY transform of a block of delta-rule writes (Yang et al. 2024, §3).

For a block of L tokens with incoming state h, the (gated) delta rule

    h_r = α_r (I − β_r k_r k_rᵀ) h_{r−1} + β_r k_r v_rᵀ

can be written as ``h_r = e^{b_r} h + Σ_{i≤r} e^{b_r − b_i} k_i u_iᵀ`` with pseudo-values

    u_r = β_r (v_r − e^{b_r} hᵀ k_r − Σ_{i<r} e^{b_r − b_i} (k_rᵀ k_i) u_i).

In matrix form ``(I + A) U = diag(β) (V − diag(e^b) K h)`` with the strictly lower
triangular ``A = tril(diag(β) (K Kᵀ ⊙ Γ), −1)``. So, with

    T = (I + A)⁻¹ diag(β)      (an L×L unit-triangular solve: forward substitution)
    W = T (K ⊙ e^b),  U = T V

the pseudo-values given any incoming state are ``U − W h``. T, W and U depend only
on the block's own keys, so they are computed for every block at once; only
``U − W h`` needs the state. Yang et al. 2024 compute the same rows one at a time
(its ``w_r``, ``u_r`` recursion); ``tests/studies/test_worked_examples.py`` checks its C = 2
numbers. Without decay (g = 0) every e^{·} factor is 1.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._chunk import decay_matrix


def ut_transform(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, b: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``W = T (K ⊙ e^b)`` and ``U = T V`` for blocks ``k [..., L, K]``, ``v [..., L, V]``.

    ``beta`` is ``[..., L]``; ``b`` (cumulative log decay, ``[..., L]``) may be None.
    """
    length = k.shape[-2]
    gamma = decay_matrix(b, length, k.device, k.dtype, diagonal=-1)  # strictly lower
    a = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * gamma
    eye = torch.eye(length, dtype=k.dtype, device=k.device)
    k_decayed = k if b is None else k * torch.exp(b).unsqueeze(-1)
    rhs = beta.unsqueeze(-1) * torch.cat([k_decayed, v], dim=-1)  # diag(β) [K e^b | V]
    wu = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    return wu[..., : k.shape[-1]], wu[..., k.shape[-1]:]



def unit_lower_inverse(a: torch.Tensor, base: int = 8) -> torch.Tensor:
    """``(I + A)⁻¹`` for strictly lower-triangular blocks ``a [B, L, L]`` (B a flat batch).

    The chunk path calls it on the C/4 × C/4 diagonal blocks of the UT system
    (:func:`diagonal_block_inverses`). Forward substitution on the diagonal
    ``base × base`` blocks of every matrix at once (``base − 1`` steps), then block
    doubling: ``[[X₁₁, 0], [A₂₁, X₂₂]]`` inverts to ``[[X₁₁, 0], [−X₂₂ A₂₁ X₁₁, X₂₂]]``.
    Every step is a batched matmul; on the CPU this beats one batched
    ``torch.linalg.solve_triangular`` (which calls a LAPACK solve per matrix),
    and it is the same sum of products as row-by-row substitution. The blocks are
    written into one preallocated result (no concatenation).
    """
    batch, length = a.shape[0], a.shape[-1]
    base = min(base, length)
    total = base
    while total < length:
        total *= 2
    if total != length:  # pad with zero rows and columns: their block of I + A is I
        a = torch.nn.functional.pad(a, (0, total - length, 0, total - length))
    blocks = total // base
    out = a.new_zeros(batch, total, total)

    def diagonal_blocks(m, size, offset=0):  # [batch, n, size, size] view of the (sub)diagonal blocks
        n = total // size
        return torch.diagonal(m.view(batch, n, size, n, size), offset=offset, dim1=1, dim2=3).permute(0, 3, 1, 2)

    a_diag = diagonal_blocks(a, base).contiguous()
    x = torch.eye(base, dtype=a.dtype, device=a.device).repeat(batch, blocks, 1, 1)
    for r in range(1, base):  # row r of every diagonal block: x_r = e_r − a_r x
        x[:, :, r, :r] -= (a_diag[:, :, r : r + 1, :r] @ x[:, :, :r, :r]).squeeze(-2)
    diagonal_blocks(out, base).copy_(x)
    size = base
    while size < total:
        x_diag = diagonal_blocks(out, size)
        x11 = x_diag[:, 0::2].reshape(-1, size, size)  # contiguous copies: bmm's fast path
        x22 = x_diag[:, 1::2].reshape(-1, size, size)
        a21 = diagonal_blocks(a, size, offset=-1)[:, 0::2].reshape(-1, size, size)  # below each diagonal pair
        x21 = torch.bmm(x22, torch.bmm(a21, x11)).neg_()
        diagonal_blocks(out, size, offset=-1)[:, 0::2].copy_(x21.view(batch, -1, size, size))
        size *= 2
    return out if total == length else out[:, :length, :length]


def diagonal_block_inverses(s: torch.Tensor, beta: torch.Tensor, blocks: int = 4) -> torch.Tensor:
    """Inverses of the diagonal blocks of ``I + diag(β) S``, for :func:`block_substitution`.

    ``s [B, L, L]`` is strictly lower triangular, ``beta [B, L]``. The L rows are cut
    into ``nb`` equal blocks of ``bs = L / nb`` (``nb`` the largest of ``blocks, ..., 1``
    that divides L); returns ``[nb, B, bs, bs]``, block-major so that each block's
    inverses are one contiguous batch.
    """
    batch, length = s.shape[0], s.shape[-1]
    nb = row_blocks(length, blocks)
    bs = length // nb
    diag = torch.diagonal(s.view(batch, nb, bs, nb, bs), dim1=1, dim2=3).permute(3, 0, 1, 2)  # [nb, B, bs, bs]
    a = torch.mul(diag, _beta_blocks(beta, nb).unsqueeze(-1), out=s.new_empty(nb, batch, bs, bs))
    return unit_lower_inverse(a.view(nb * batch, bs, bs)).view(nb, batch, bs, bs)  # of diag(β) S's blocks


def row_blocks(length: int, blocks: int) -> int:
    """The number of row blocks of an L-row UT system: the largest of ``blocks, ..., 1`` that divides L."""
    return next(n for n in range(min(blocks, length), 0, -1) if length % n == 0)


def _beta_blocks(beta: torch.Tensor, nb: int) -> torch.Tensor:
    """``beta [B, L]`` cut into the row blocks of :func:`diagonal_block_inverses`: ``[nb, B, L / nb]``."""
    return beta.view(beta.shape[0], nb, -1).transpose(0, 1)


def ut_solve(
    s: torch.Tensor, beta: torch.Tensor, inverse_blocks: torch.Tensor, rhs: torch.Tensor,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The UT transform ``(I + diag(β) S)⁻¹ diag(β) R`` by :func:`block_substitution`.

    ``s [B, L, L]`` strictly lower, ``beta [B, L]``, ``inverse_blocks`` from
    :func:`diagonal_block_inverses` (of the same s and β), ``rhs`` R ``[B, L, D]``.
    β goes into the small diagonal factors D_j = X_j diag(β_j), so R is used as it is.
    """
    factors = inverse_blocks * _beta_blocks(beta, inverse_blocks.shape[0]).unsqueeze(-2)
    return block_substitution(s, factors, rhs, out=out)


def block_substitution(
    lower: torch.Tensor, diagonal: torch.Tensor, rhs: torch.Tensor, transpose: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Block forward substitution ``Y_j = D_j (R_j − L_{j,<j} Y_{<j})``, top block first.

    ``lower [B, L, L]`` (only its strictly lower blocks are read), ``diagonal
    [nb, B, bs, bs]`` the diagonal factors D_j, ``rhs [B, L, D]``. With
    ``transpose=True`` it runs the transposed system bottom block first,
    ``Y_j = D_jᵀ (R_j − L_{>j,j}ᵀ Y_{>j})``. Two uses (README.md):

    - the UT transform, ``(I + diag(β) S)⁻¹ diag(β) R`` (:func:`ut_solve`): ``lower`` = S
      and D_j = X_j diag(β_j), X_j the inverses of :func:`diagonal_block_inverses`;
    - its adjoint, ``(I + A)⁻ᵀ R`` with A = diag(β) S: ``lower`` = A, D_j = X_j.

    2·nb − 1 batched products on views: about 5/8 of the multiply-adds of forming
    the C×C inverse and multiplying by it (nb = 4), and no full inverse. ``out``
    (contiguous, shaped like ``rhs``; may be ``rhs`` itself) receives Y.
    """
    nb, bs = diagonal.shape[0], diagonal.shape[-1]
    y = torch.empty_like(rhs) if out is None else out
    for j in (reversed(range(nb)) if transpose else range(nb)):
        lo, hi = j * bs, (j + 1) * bs
        r = rhs[:, lo:hi]
        if transpose:
            d = diagonal[j].transpose(-1, -2)
            if hi < nb * bs:
                r = torch.baddbmm(r, lower[:, hi:, lo:hi].transpose(-1, -2), y[:, hi:], alpha=-1.0)
        else:
            d = diagonal[j]
            if lo:
                r = torch.baddbmm(r, lower[:, lo:hi, :lo], y[:, :lo], alpha=-1.0)
        y[:, lo:hi] = torch.bmm(d, r)  # (bmm's out= on a row-block view takes a slow per-matrix path)
    return y
