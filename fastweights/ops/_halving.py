"""Decayed pair products of a block by recursive halving: every exponential of a number <= 0.

The chunk forms of the per-channel-decay rules (GDN-2, DPLR) need, per block of L tokens with a
cumulative log decay ``c [L, K]`` (non-increasing along L: every gate g <= 0), products

    M_xy[r, i] = Σ_d x_r[d] y_i[d] e^{c_r[d] − c_i[d]}        (i <= r)

of row operands x (S's erase keys, the scaled queries, ...) and column operands y (the keys).
``e^{c_r − c_i}`` does not factor into a row part times a column part without risking overflow
(``e^{−c_i}`` is huge for strong decays), so KDA's form (:class:`~.kda.parallel.RelativeDecay`)
takes a reference point per sub-block of s tokens and a cross factor per pair of sub-blocks:
O(L²·K/s) elementwise work, in tensors of that size.

Here the block is halved recursively instead. At level ℓ the block is cut into pairs of halves
of ``b = L / 2^ℓ`` tokens; for a row r in a second half and a column i in the first half of the
same pair, with m the last token of that first half (i <= m < r),

    e^{c_r − c_i} = e^{c_r − c_m} · e^{c_m − c_i},     both exponents <= 0,

so the whole off-diagonal block of the pair is one matrix product of row operands scaled by
``e^{c_r − c_m}`` and column operands scaled by ``e^{c_m − c_i}``. Every pair (i < r) lies in
exactly one such block (the level at which r and i are first separated), and the levels' blocks
together tile the strict lower triangle; the diagonal (i = r, factor 1) is a row-wise dot product.
Each level scales every token once (O(L·K) elementwise work per level, log₂ L levels) and its
products are batched over all pairs of halves; each factor is the exponential of a float64
difference of float64 cumulative sums, rounded once, as KDA's are. This is the hierarchical
(multi-level) tiling of the causal decayed product that chunked linear-attention kernels use
within a chunk (Yang et al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient
Training", arXiv:2312.06635, secondary-level chunking), taken to every level with the reference
point at each split.

L that is not a power of two is padded (zero operands, no decay) and the result cut back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def halving_products(c: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The decayed products of every row operand with every column operand (module docstring).

    Args:
        c: ``[Bt, L, K]`` float64, the cumulative log decay of each block (non-increasing along L).
        rows: ``[Bt, L, nr, K]`` the row operands x, token-major; ``cols``: ``[Bt, L, ny, K]`` the
            column operands y. Both in the compute dtype.

    Returns:
        ``[nr, ny, Bt, L, L]``, ``out[x, y, :, r, i] = Σ_d x_r y_i e^{c_r − c_i}`` for i <= r (diagonal
        included) and 0 above the diagonal; each ``out[x, y]`` a contiguous ``[Bt, L, L]``.
    """
    bt, length, nr, dk = rows.shape
    ny = cols.shape[2]
    padded = 1 << max(0, (length - 1).bit_length())
    if padded != length:  # zero operands and no decay after the block: nothing changes inside it
        extra = padded - length
        c = torch.cat([c, c[:, -1:].expand(bt, extra, dk)], dim=1)
        rows = F.pad(rows, (0, 0, 0, 0, 0, extra))
        cols = F.pad(cols, (0, 0, 0, 0, 0, extra))
    levels = padded.bit_length() - 1
    out = rows.new_zeros(nr, ny, bt, padded, padded)
    # the diagonal, i = r: factor 1
    out.diagonal(dim1=-2, dim2=-1).copy_(torch.matmul(rows, cols.transpose(-1, -2)).permute(2, 3, 0, 1))
    if levels:
        # every level's exponent of every token, c_r − c_m for the rows after m and c_m − c_i for the
        # columns up to m (both <= 0): float64 differences, each rounded once as it is written to the
        # compute dtype; then one exponential for all levels
        exponents = rows.new_empty(bt, levels, padded, dk)
        for level in range(1, levels + 1):
            half = padded >> level
            halves = c.view(bt, 1 << (level - 1), 2, half, dk)
            mid = halves[:, :, 0, -1:]  # [Bt, P, 1, K]: c at the last token of each first half
            into = exponents[:, level - 1].view(halves.shape)
            torch.sub(halves[:, :, 1], mid, out=into[:, :, 1])
            torch.sub(mid, halves[:, :, 0], out=into[:, :, 0])
        factors = exponents.exp_()  # [Bt, levels, L, K]
        for level in range(1, levels + 1):
            half = padded >> level
            pairs = 1 << (level - 1)
            f = factors[:, level - 1].view(bt, pairs, 2, half, 1, dk)
            x = rows.view(bt, pairs, 2, half, nr, dk)[:, :, 1] * f[:, :, 1]  # [Bt, P, b, nr, K]
            y = cols.view(bt, pairs, 2, half, ny, dk)[:, :, 0] * f[:, :, 0]  # [Bt, P, b, ny, K]
            block = torch.bmm(x.view(bt * pairs, half * nr, dk), y.view(bt * pairs, half * ny, dk).transpose(-1, -2))
            target = out.view(nr, ny, bt, pairs, 2, half, pairs, 2, half).diagonal(dim1=3, dim2=6)[:, :, :, 1, :, 0]
            target.copy_(block.view(bt, pairs, half, nr, half, ny).permute(3, 5, 0, 2, 4, 1))
    if padded != length:
        out = out[..., :length, :length].contiguous()
    return out
