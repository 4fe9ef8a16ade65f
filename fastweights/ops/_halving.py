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
:func:`halving_products_backward` is the adjoint (to the operands and to the log decays).
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
    c, rows, cols, padded = _pad_block(c, rows, cols)
    levels = padded.bit_length() - 1
    out = rows.new_zeros(nr, ny, bt, padded, padded)
    # the diagonal, i = r: factor 1
    out.diagonal(dim1=-2, dim2=-1).copy_(torch.matmul(rows, cols.transpose(-1, -2)).permute(2, 3, 0, 1))
    if levels:
        for level, half, pairs, _, x, y in _level_operands(c, rows, cols, padded, levels):
            block = torch.bmm(x.view(bt * pairs, half * nr, dk), y.view(bt * pairs, half * ny, dk).transpose(-1, -2))
            _pair_blocks(out, level).copy_(block.view(bt, pairs, half, nr, half, ny).permute(3, 5, 0, 2, 4, 1))
    if padded != length:
        out = out[..., :length, :length].contiguous()
    return out


def _pad_block(c, rows, cols):
    """``(c, rows, cols, L')`` with L padded to the next power of two L' (zero operands, no decay after
    the block: nothing changes inside it)."""
    bt, length, _, dk = rows.shape
    padded = 1 << max(0, (length - 1).bit_length())
    if padded != length:
        extra = padded - length
        c = torch.cat([c, c[:, -1:].expand(bt, extra, dk)], dim=1)
        rows = F.pad(rows, (0, 0, 0, 0, 0, extra))
        cols = F.pad(cols, (0, 0, 0, 0, 0, extra))
    return c, rows, cols, padded


def _level_exponent(c: torch.Tensor, level: int, out: torch.Tensor) -> torch.Tensor:
    """Level ℓ's exponents into ``out [Bt, L, K]``: c_r − c_m for the tokens r of every second half and
    c_m − c_i for the tokens i of every first half (m the first half's last token; both <= 0), each
    a float64 difference rounded once as it is written to ``out``'s dtype."""
    bt, padded, dk = c.shape
    half = padded >> level
    halves = c.view(bt, 1 << (level - 1), 2, half, dk)
    mid = halves[:, :, 0, -1:]  # [Bt, P, 1, K]: c at the last token of each first half
    into = out.view(halves.shape)
    torch.sub(halves[:, :, 1], mid, out=into[:, :, 1])
    torch.sub(mid, halves[:, :, 0], out=into[:, :, 0])
    return out


def _level_factors(c: torch.Tensor, levels: int, dtype: torch.dtype) -> torch.Tensor:
    """``[Bt, levels, L, K]``: every level's factors, the exponentials of :func:`_level_exponent`."""
    bt, padded, dk = c.shape
    exponents = torch.empty(bt, levels, padded, dk, dtype=dtype, device=c.device)
    for level in range(1, levels + 1):
        _level_exponent(c, level, exponents[:, level - 1])
    return exponents.exp_()


def _level_operands(c, rows, cols, padded: int, levels: int):
    """For each halving level of a padded block (``rows [Bt, L, nr, K]``, ``cols [Bt, L, ny, K]``):
    ``(level, half, pairs, f, x, y)`` with the level's decay factors ``f [Bt, P, 2, b, 1, K]`` and the
    scaled operands ``x`` (the pairs' second halves of ``rows``) and ``y`` (their first halves of
    ``cols``), ``[Bt, P, b, n, K]``; shared by :func:`halving_products` and its adjoint."""
    bt, _, nr, dk = rows.shape
    ny = cols.shape[2]
    factors = _level_factors(c, levels, rows.dtype)  # [Bt, levels, L, K]
    for level in range(1, levels + 1):
        half = padded >> level
        pairs = 1 << (level - 1)
        f = factors[:, level - 1].view(bt, pairs, 2, half, 1, dk)
        x = rows.view(bt, pairs, 2, half, nr, dk)[:, :, 1] * f[:, :, 1]  # [Bt, P, b, nr, K]
        y = cols.view(bt, pairs, 2, half, ny, dk)[:, :, 0] * f[:, :, 0]  # [Bt, P, b, ny, K]
        yield level, half, pairs, f, x, y


def _pair_blocks(out: torch.Tensor, level: int) -> torch.Tensor:
    """The view of ``out [nr, ny, Bt, L, L]`` that level ℓ writes: ``[nr, ny, Bt, b(r), b(i), P]``, row r in
    the second half and column i in the first half of each of the P pairs of halves of b tokens."""
    nr, ny, bt, padded, _ = out.shape
    half, pairs = padded >> level, 1 << (level - 1)
    s_x, s_y, s_b, s_r, s_i = out.stride()  # entry (r, i) = (2bp + b + r', 2bp + i'), one strided view
    return out.as_strided((nr, ny, bt, half, half, pairs), (s_x, s_y, s_b, s_r, s_i, 2 * half * (s_r + s_i)),
                          out.storage_offset() + half * s_r)


def halving_products_by_operand(g: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, diagonal_from: int = 0):
    """:func:`halving_products` from the log decays themselves, with the operands operand-major; also
    returns the block's end factors.

    Args:
        g: ``[Bt, L, K]`` the per-token log decays (<= 0) of each block, c = cumsum(g), in the compute dtype.
        rows: ``[Bt, nr, L, K]``, ``cols``: ``[Bt, ny, L, K]``, each operand a contiguous ``[L, K]`` per block.
        diagonal_from: the row operands before it get strictly lower products (their diagonal stays 0,
            not computed); the others include it.

    Returns:
        ``(products [nr, ny, Bt, L, L]`` as :func:`halving_products`, ``ends [Bt, 2, L, K]``: e^{c_r} and
        e^{c_L − c_r})``.

    Every factor is a product of the tokens' own decays over its span, formed without float64 and
    without a difference of cumulative sums: with P_b(t) the sum of g from the start of t's aligned
    run of b tokens up to t and S_b(t) the sum after t to the run's end, level ℓ's factors are e^{P_b}
    on every second half (c_r − c_m) and e^{S_b} on every first half (c_m − c_i), and going up a level
    multiplies one half's factors by the other half's total (e^{P_2b} = e^{P_b} · e^{the first half's
    total} on the second half, e^{S_2b} = e^{S_b} · e^{the second half's total} on the first half). So
    only e^g is an exponential (one per token and channel, of a number <= 0); every factor lies in
    (0, 1] and is a product of at most log₂ L + 1 correctly rounded numbers in (0, 1], so its relative
    rounding is at most about (log₂ L + 1) roundings whatever the size of its exponent (a sum of
    exponents, exponentiated, would carry |exponent| times its relative rounding instead); the top of
    the recursion gives e^{c_r} and e^{c_L − c_r} with no more work.

    Arranged for the CPU's caches: each level's factors used in place, each level's scaled operands
    written operand-major (every elementwise product runs over contiguous spans of b·K numbers; the
    level's one batched product reads them without a copy)."""
    bt, nr, length, dk = rows.shape
    ny = cols.shape[1]
    padded = 1 << max(0, (length - 1).bit_length())
    if padded != length:  # zero operands and no decay after the block: nothing changes inside it
        extra = padded - length
        g, rows, cols = F.pad(g, (0, 0, 0, extra)), F.pad(rows, (0, 0, 0, extra)), F.pad(cols, (0, 0, 0, extra))
    out = rows.new_zeros(nr, ny, bt, padded, padded)
    if diagonal_from < nr:  # i = r: factor 1
        diag = (rows[:, diagonal_from:].unsqueeze(2) * cols.unsqueeze(1)).sum(-1)  # [Bt, nr', ny, L]
        out[diagonal_from:].diagonal(dim1=-2, dim2=-1).copy_(diag.permute(1, 2, 0, 3))
    ends = rows.new_empty(bt, 2, padded, dk)  # e^{P_b} and e^{S_b}, from b = 1: e^{P_1} = e^g, e^{S_1} = 1
    torch.exp(g, out=ends[:, 0])
    ends[:, 1].fill_(1.0)
    # (views by select/unbind/narrow: at these sizes a Python slice costs about as much as the arithmetic)
    for level in range(padded.bit_length() - 1, 0, -1):  # the finest level (b = 1) first
        half, pairs = padded >> level, 1 << (level - 1)
        (p_first, p_second), (s_first, _) = (t.unbind(2) for t in ends.view(bt, 2, pairs, 2, half, dk).unbind(1))
        x = rows.new_empty(bt, pairs, nr, half, dk)  # rows of the second halves, scaled by e^{c_r − c_m} = e^{P_b}
        torch.mul(rows.view(bt, nr, pairs, 2, half, dk).select(3, 1), p_second.unsqueeze(1), out=x.transpose(1, 2))
        y = rows.new_empty(bt, pairs, ny, half, dk)  # columns of the first halves, scaled by e^{c_m − c_i} = e^{S_b}
        torch.mul(cols.view(bt, ny, pairs, 2, half, dk).select(3, 0), s_first.unsqueeze(1), out=y.transpose(1, 2))
        block = torch.bmm(x.view(bt * pairs, nr * half, dk), y.view(bt * pairs, ny * half, dk).transpose(1, 2))
        _pair_blocks(out, level).copy_(block.view(bt, pairs, nr, half, ny, half).permute(2, 4, 0, 3, 5, 1))
        # up a level: times the second half's total (e^{P_b} at its end, before it grows), resp. the first half's
        s_first.mul_(p_second.narrow(2, half - 1, 1))
        p_second.mul_(p_first.narrow(2, half - 1, 1))
    if padded != length:
        out, ends = out[..., :length, :length].contiguous(), ends[:, :, :length]
    return out, ends


def halving_products_backward(c: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, d_out: torch.Tensor):
    """The adjoint of :func:`halving_products`: ``d_out [nr, ny, Bt, L, L]`` (only the diagonal and the
    strict lower triangle are read; zero a strict product's diagonal first) -> ``(d_rows [Bt, L, nr, K],
    d_cols [Bt, L, ny, K], dgk [Bt, L, K])``, dgk the gradient to the log decays g whose cumulative
    sums are ``c`` (c_r = g_1 + … + g_r).

    The forward's products are recomputed level by level. At level ℓ a block is x̃ ỹᵀ with
    x̃ = x ⊙ e^{c_r − c_m} and ỹ = y ⊙ e^{c_m − c_i}: d x̃ = dB ỹ, d ỹ = dBᵀ x̃. A factor e^{c_r − c_m}
    depends on g_t for t in (m, r] with derivative the factor itself, so g_t collects Σ_x d x̃ ⊙ x̃ of
    the rows r >= t of its own second half (a suffix sum inside that half); e^{c_m − c_i} depends on
    g_t for t in (i, m]: g_t collects the columns i < t of its own first half (a prefix sum, t
    excluded). Each span is summed directly, never as a difference of two cumulative sums (with
    strong decays those would cancel and leave the rounding of larger terms behind, as KDA's
    :meth:`~.kda.parallel.RelativeDecay.products_backward` notes)."""
    bt, length, nr, dk = rows.shape
    ny = cols.shape[2]
    c, rows, cols, padded = _pad_block(c, rows, cols)
    if padded != length:
        d_out = F.pad(d_out, (0, padded - length, 0, padded - length))
    # the diagonal, factor 1: D [Bt, L, nr, ny]
    diag = d_out.diagonal(dim1=-2, dim2=-1).permute(2, 3, 0, 1)
    d_rows = torch.matmul(diag, cols)
    d_cols = torch.matmul(diag.transpose(-1, -2), rows)
    dgk = rows.new_zeros(bt, padded, dk)
    levels = padded.bit_length() - 1
    if levels:
        for level, half, pairs, f, x, y in _level_operands(c, rows, cols, padded, levels):
            d_block = _pair_blocks(d_out, level).permute(2, 5, 3, 0, 4, 1).reshape(bt * pairs, half * nr, half * ny)
            d_x = torch.bmm(d_block, y.view(bt * pairs, half * ny, dk)).view(bt, pairs, half, nr, dk)
            d_y = torch.bmm(d_block.transpose(-1, -2), x.view(bt * pairs, half * nr, dk)).view(bt, pairs, half, ny, dk)
            d_rows.view(bt, pairs, 2, half, nr, dk)[:, :, 1].addcmul_(d_x, f[:, :, 1])
            d_cols.view(bt, pairs, 2, half, ny, dk)[:, :, 0].addcmul_(d_y, f[:, :, 0])
            spans = dgk.view(bt, pairs, 2, half, dk)
            # rows: the suffix sums inside the second half (t <= r); columns: the prefix sums inside the
            # first half, t excluded (i < t)
            spans[:, :, 1] += d_x.mul_(x).sum(3).flip(2).cumsum(2).flip(2)
            from_cols = d_y.mul_(y).sum(3)
            spans[:, :, 0, 1:] += from_cols[:, :, :-1].cumsum(2)
    if padded != length:
        return d_rows[:, :length], d_cols[:, :length], dgk[:, :length]
    return d_rows, d_cols, dgk


class OperandPlan:
    """:func:`halving_products_by_operand` for one block shape used again and again (the chunk forward's groups):
    every buffer and every view its levels read or write made once, so that :meth:`run` only computes (at the
    chunk forms' sizes the views and allocations of each call cost about a tenth of the forward).

    ``rows [Bt, nr, L, K]`` and ``cols [Bt, ny, L, K]`` are the plan's operand buffers, filled before each
    :meth:`run`; L a power of two. :meth:`run` returns the plan's own ``(products, ends)`` buffers, as
    :func:`halving_products_by_operand` would: valid until the next run. The products' entries above the
    diagonal (and the diagonal of the row operands before ``diagonal_from``) are zeroed once and never
    written; a caller may negate the products in place (zeros stay zeros), nothing else."""

    def __init__(self, like: torch.Tensor, bt: int, nr: int, ny: int, length: int, dk: int, diagonal_from: int = 0):
        if length & (length - 1):
            raise ValueError(f"OperandPlan: `length` must be a power of two, got {length}")
        self.rows, self.cols = like.new_empty(bt, nr, length, dk), like.new_empty(bt, ny, length, dk)
        self.out = like.new_zeros(nr, ny, bt, length, length)
        self.ends = like.new_empty(bt, 2, length, dk)
        self.first_sums, self.last_sums = self.ends.unbind(1)
        self.diagonal = None
        if diagonal_from < nr:  # i = r: factor 1
            products = like.new_empty(bt, nr - diagonal_from, ny, length, dk)
            self.diagonal = (self.rows[:, diagonal_from:].unsqueeze(2), self.cols.unsqueeze(1), products,
                             like.new_empty(bt, nr - diagonal_from, ny, length),
                             self.out[diagonal_from:].diagonal(dim1=-2, dim2=-1))
        x_all, y_all = like.new_empty(bt * nr * (length // 2) * dk), like.new_empty(bt * ny * (length // 2) * dk)
        block_all = like.new_empty(bt * nr * ny * (length // 2) * (length // 2))  # the top level's is the largest
        self.levels = []
        for level in range(length.bit_length() - 1, 0, -1):  # the finest level (b = 1) first
            half, pairs = length >> level, 1 << (level - 1)
            (p_first, p_second), (s_first, _) = (t.unbind(2) for t in self.ends.view(bt, 2, pairs, 2, half, dk).unbind(1))
            x, y = x_all.view(bt, pairs, nr, half, dk), y_all.view(bt, pairs, ny, half, dk)
            block = block_all[:bt * pairs * nr * half * ny * half].view(bt * pairs, nr * half, ny * half)
            self.levels.append((
                (self.rows.view(bt, nr, pairs, 2, half, dk).select(3, 1), p_second.unsqueeze(1), x.transpose(1, 2)),
                (self.cols.view(bt, ny, pairs, 2, half, dk).select(3, 0), s_first.unsqueeze(1), y.transpose(1, 2)),
                (x.view(bt * pairs, nr * half, dk), y.view(bt * pairs, ny * half, dk).transpose(1, 2), block),
                (_pair_blocks(self.out, level), block.view(bt, pairs, nr, half, ny, half).permute(2, 4, 0, 3, 5, 1)),
                (s_first, p_second.narrow(2, half - 1, 1)), (p_second, p_first.narrow(2, half - 1, 1))))

    def run(self, g: torch.Tensor):
        """``(products, ends)`` of the operands in :attr:`rows` and :attr:`cols` with log decays ``g [Bt, L, K]``
        (:func:`halving_products_by_operand`'s results and arithmetic, operation for operation)."""
        if self.diagonal is not None:
            rows, cols, products, sums, out = self.diagonal
            torch.sum(torch.mul(rows, cols, out=products), -1, out=sums)
            out.copy_(sums.permute(1, 2, 0, 3))
        torch.exp(g, out=self.first_sums)
        self.last_sums.fill_(1.0)
        for x_args, y_args, bmm_args, (dest, block), s_update, p_update in self.levels:
            torch.mul(*x_args[:2], out=x_args[2])
            torch.mul(*y_args[:2], out=y_args[2])
            torch.bmm(*bmm_args[:2], out=bmm_args[2])
            dest.copy_(block)
            s_update[0].mul_(s_update[1])
            p_update[0].mul_(p_update[1])
        return self.out, self.ends
