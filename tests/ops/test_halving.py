"""The decayed pair products by recursive halving (``ops/_halving.py``) and the forward-only
drivers of GDN-2 and DPLR that use them: float64 equality with the products written out pair by
pair, no overflow for strong decays, and the no-grad path (no chunk states kept) equal to the
path that keeps them."""

import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.ops._halving import halving_products, halving_products_backward, halving_products_by_operand
from fastweights.ops.dplr import chunk as dplr_chunk
from fastweights.ops.gdn2 import chunk as gdn2_chunk

from helpers import rel_err


def pairwise(c, rows, cols):
    """``Σ_d x_r y_i e^{c_r − c_i}`` for i <= r, one pair at a time (the exponent clamped to <= 0 above
    the diagonal, where the entry is then zeroed)."""
    length = c.shape[1]
    diff = (c.unsqueeze(2) - c.unsqueeze(1)).clamp_max(0.0)  # [Bt, r, i, K]
    full = torch.einsum("brxd,biyd,brid->xybri", rows, cols, torch.exp(diff))
    return full * torch.ones(length, length, dtype=torch.bool).tril()


@pytest.mark.parametrize("length", [1, 2, 7, 16, 24, 32])
@pytest.mark.parametrize("nr,ny", [(2, 1), (2, 2)])
def test_halving_products_equal_the_pairwise_sums(length, nr, ny):
    gen = torch.Generator().manual_seed(length * 10 + ny)
    bt, dk = 3, 5
    g = -torch.rand(bt, length, dk, dtype=torch.float64, generator=gen)
    c = g.cumsum(1)
    rows = torch.randn(bt, length, nr, dk, dtype=torch.float64, generator=gen)
    cols = torch.randn(bt, length, ny, dk, dtype=torch.float64, generator=gen)
    got = halving_products(c, rows, cols)
    assert got.shape == (nr, ny, bt, length, length)
    assert all(got[x, y].is_contiguous() for x in range(nr) for y in range(ny))
    assert rel_err(got, pairwise(c, rows, cols)) < 1e-14


@pytest.mark.parametrize("length", [1, 2, 7, 16, 24, 32])
def test_halving_products_backward_equals_autograd_of_the_pairwise_sums(length):
    """The adjoint to both operands and to the log decays g (c = cumsum g), float64, strong decays; the
    cotangent's upper triangle is random too (it must be ignored)."""
    gen = torch.Generator().manual_seed(length + 40)
    bt, dk, nr, ny = 2, 5, 2, 2
    g = (-6.9 * torch.rand(bt, length, dk, dtype=torch.float64, generator=gen)).requires_grad_(True)
    rows = torch.randn(bt, length, nr, dk, dtype=torch.float64, generator=gen, requires_grad=True)
    cols = torch.randn(bt, length, ny, dk, dtype=torch.float64, generator=gen, requires_grad=True)
    d_out = torch.randn(nr, ny, bt, length, length, dtype=torch.float64, generator=gen)
    want = torch.autograd.grad((pairwise(g.cumsum(1), rows, cols) * d_out).sum(), (rows, cols, g))
    got = halving_products_backward(g.detach().cumsum(1), rows.detach(), cols.detach(), d_out)
    for name, a, b in zip(("rows", "cols", "g"), got, want):
        err = rel_err(a, b) if b.abs().max() > 0 else a.abs().max().item()
        print(f"L {length} d{name}: {err:.2e}")
        assert err < 1e-13


@pytest.mark.parametrize("length", [1, 2, 7, 16, 24, 32])
@pytest.mark.parametrize("diagonal_from", [0, 1, 2])
def test_operand_major_products_equal_the_pairwise_sums(length, diagonal_from):
    """The operand-major arrangement (the DPLR forward's): the same products, the rows before
    ``diagonal_from`` strictly lower (their diagonal 0), L not a power of two padded inside."""
    gen = torch.Generator().manual_seed(length + 7 * diagonal_from)
    bt, dk = 3, 5
    g = -3 * torch.rand(bt, length, dk, dtype=torch.float64, generator=gen)
    c = g.cumsum(1)
    rows = torch.randn(bt, length, 2, dk, dtype=torch.float64, generator=gen)
    cols = torch.randn(bt, length, 2, dk, dtype=torch.float64, generator=gen)
    want = pairwise(c, rows, cols)
    want[:diagonal_from].diagonal(dim1=-2, dim2=-1).zero_()
    got, ends = halving_products_by_operand(g, rows.transpose(1, 2).contiguous(), cols.transpose(1, 2).contiguous(),
                                            diagonal_from)
    assert got.shape == (2, 2, bt, length, length)
    assert rel_err(got, want) < 1e-14
    assert rel_err(ends, torch.stack([c.exp(), (c[:, -1:] - c).exp()], dim=1)) < 1e-14


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_operand_plan_equals_the_function_bit_for_bit_block_after_block(dtype):
    """OperandPlan (buffers and views made once, for the chunk forward's groups) gives what
    halving_products_by_operand gives, bit for bit, on several blocks run one after another in the same
    buffers, also after its products were negated in place (as the DPLR forward does)."""
    from fastweights.ops._halving import OperandPlan

    gen = torch.Generator().manual_seed(8)
    bt, length, dk = 3, 16, 5
    plan = OperandPlan(torch.empty(0, dtype=dtype), bt, 2, 2, length, dk, diagonal_from=1)
    for _ in range(3):
        g = -2 * torch.rand(bt, length, dk, dtype=torch.float64, generator=gen).to(dtype)
        rows = torch.randn(bt, 2, length, dk, dtype=torch.float64, generator=gen).to(dtype)
        cols = torch.randn(bt, 2, length, dk, dtype=torch.float64, generator=gen).to(dtype)
        want, want_ends = halving_products_by_operand(g, rows, cols, diagonal_from=1)
        plan.rows.copy_(rows)
        plan.cols.copy_(cols)
        got, ends = plan.run(g)
        assert torch.equal(got, want) and torch.equal(ends, want_ends)
        got[0, 0].neg_()
    with pytest.raises(ValueError, match="length"):
        OperandPlan(torch.empty(0), bt, 2, 2, 12, dk)


def test_operand_major_products_fp32_exponents_with_strong_decays():
    """The factors formed in the compute dtype as products of the tokens' decays over their spans (no
    float64): with decays down to e^{−80} per token the fp32 products and end factors stay finite and within
    a few fp32 roundings of the float64 pairwise sums, entry by entry relative to each entry's own scale
    (where fp32 can hold it): within 3x of the products whose exponents are float64 differences rounded once
    (a factor carries up to log₂ L + 1 = 6 roundings; measured 1.7e-6 against their 2.5e-6)."""
    gen = torch.Generator().manual_seed(4)
    bt, length, dk = 2, 32, 8
    g = -80 * torch.rand(bt, length, dk, dtype=torch.float64, generator=gen)
    g[:, ::5] = 0.0
    g[:, 1::7] *= 1e-3  # weak decays next to strong ones
    c = g.cumsum(1)
    rows = torch.randn(bt, length, 2, dk, dtype=torch.float64, generator=gen)
    cols = torch.randn(bt, length, 2, dk, dtype=torch.float64, generator=gen)
    want = pairwise(c, rows, cols)
    scale = pairwise(c, rows.abs(), cols.abs())  # Σ |x y| e^{c_r − c_i}: each entry's own size
    got, ends = halving_products_by_operand(g.float(), rows.float().transpose(1, 2).contiguous(),
                                            cols.float().transpose(1, 2).contiguous())
    assert torch.isfinite(got).all() and torch.isfinite(ends).all()
    seen = scale > 1e-30  # entries fp32 can hold (smaller ones may underflow to 0, as the recurrence's do)
    worst = ((got.double() - want).abs() / scale)[seen].max().item()
    # the token-major products with float64 exponents, each rounded once: the baseline
    base = ((halving_products(c, rows.float(), cols.float()).double() - want).abs() / scale)[seen].max().item()
    print(f"fp32 products, worst error relative to each entry's scale: {worst:.2e} (float64 exponents {base:.2e})")
    assert worst <= 3 * base
    assert rel_err(ends[:, 0].double(), c.exp()) < 1e-6


def test_halving_products_never_overflow_with_strong_decays():
    """Decays down to e^{−80} per token (cumulative −2560 over a block of 32): every factor is the
    exponential of a number <= 0, so fp32 stays finite and matches float64 to fp32 rounding."""
    gen = torch.Generator().manual_seed(3)
    bt, length, dk = 2, 32, 8
    g = -80 * torch.rand(bt, length, dk, dtype=torch.float64, generator=gen)
    g[:, ::5] = 0.0  # some tokens without decay: pairs across them stay O(1)
    c = g.cumsum(1)
    rows = torch.randn(bt, length, 2, dk, dtype=torch.float64, generator=gen)
    cols = torch.randn(bt, length, 1, dk, dtype=torch.float64, generator=gen)
    want = pairwise(c, rows, cols)
    got32 = halving_products(c, rows.float(), cols.float())
    assert torch.isfinite(got32).all()
    assert rel_err(got32.double(), want) < 1e-6


def gdn2_heads(n, t_len, nh, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, nh, t_len, dk, dtype=torch.float64, generator=gen)
    k = F.normalize(torch.randn(n, nh, t_len, dk, dtype=torch.float64, generator=gen), dim=-1)
    v = torch.randn(n, nh, t_len, dv, dtype=torch.float64, generator=gen)
    g = -3 * torch.rand(n, nh, t_len, dk, dtype=torch.float64, generator=gen)
    b = 2 * torch.rand(n, nh, t_len, dk, dtype=torch.float64, generator=gen)
    w = torch.rand(n, nh, t_len, dv, dtype=torch.float64, generator=gen)
    h0 = torch.randn(n * nh, dk, dv, dtype=torch.float64, generator=gen)
    return q, k, v, g, b, w, h0


@pytest.mark.parametrize("chunk_size", [8, 16])
def test_gdn2_forward_without_states_equals_the_one_keeping_them(chunk_size):
    """``keep_states=False`` reuses one group buffer for the entry states: same o and h_T, bit for bit,
    over several groups (T/C chunks > the group's), T not a multiple of C, B > 1, K != V."""
    q, k, v, g, b, w, h0 = gdn2_heads(2, 150, 3, 12, 7, seed=1)
    kept = gdn2_chunk.gdn2_chunk_fwd(q, k, b * k, w * v, g, h0, 0.4, chunk_size, True)
    free = gdn2_chunk.gdn2_chunk_fwd(q, k, b * k, w * v, g, h0, 0.4, chunk_size, False)
    assert kept[2].shape[0] == -(-150 // chunk_size) and free[2].shape[0] == 0
    assert torch.equal(kept[0], free[0]) and torch.equal(kept[1], free[1])


@pytest.mark.parametrize("chunk_size", [8, 16])
def test_dplr_forward_without_states_equals_the_one_keeping_them(chunk_size, monkeypatch):
    """As GDN-2's, over several groups: 100 token-heads a group (C 8: 2 chunks of 6 chunk-heads, C 16: 1),
    the last group partial and its last chunk zero-padded."""
    monkeypatch.setattr(dplr_chunk, "GROUP_TOKENS", 100)
    gen = torch.Generator().manual_seed(2)
    n, nh, t_len, dk, dv = 2, 3, 150, 12, 7
    q, k = (torch.randn(n, nh, t_len, dk, dtype=torch.float64, generator=gen) for _ in range(2))
    v = torch.randn(n, nh, t_len, dv, dtype=torch.float64, generator=gen)
    kappa = F.normalize(torch.randn(n, nh, t_len, dk, dtype=torch.float64, generator=gen), dim=-1)
    ab = torch.stack([-kappa, kappa * torch.rand(n, nh, t_len, dk, dtype=torch.float64, generator=gen)], dim=-2)
    gk = -0.6 * torch.rand(n, nh, t_len, dk, dtype=torch.float64, generator=gen)
    h0 = torch.randn(n * nh, dk, dv, dtype=torch.float64, generator=gen)
    kept = dplr_chunk.chunk_dplr_fwd(q, k, v, ab, gk, h0, 0.4, chunk_size, True)
    free = dplr_chunk.chunk_dplr_fwd(q, k, v, ab, gk, h0, 0.4, chunk_size, False)
    assert kept[2].shape[0] == -(-t_len // chunk_size) and free[2].shape[0] == 0
    assert torch.equal(kept[0], free[0]) and torch.equal(kept[1], free[1])


@pytest.mark.parametrize("family", ["gdn2", "dplr"])
def test_no_grad_call_equals_the_differentiable_call_and_the_recurrence(family):
    """The public chunk ops without grad (no chunk states) and with grad (states kept for the backward)
    give the same outputs, both equal to the float64 recurrence; T = 100, C = 16, H = 2, K = 60, V = 20,
    B = 2, an initial state."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, K, V = 2, 100, 2, 60, 20
    x = dict(q=torch.randn(B, T, H, K, dtype=torch.float64, generator=gen),
             k=F.normalize(torch.randn(B, T, H, K, dtype=torch.float64, generator=gen), dim=-1),
             v=torch.randn(B, T, H, V, dtype=torch.float64, generator=gen),
             initial_state=torch.randn(B, H, K, V, dtype=torch.float64, generator=gen))
    if family == "gdn2":
        x.update(g=-2 * torch.rand(B, T, H, K, dtype=torch.float64, generator=gen),
                 b=2 * torch.rand(B, T, H, K, dtype=torch.float64, generator=gen),
                 w=torch.rand(B, T, H, V, dtype=torch.float64, generator=gen))
        chunk, recurrent = ops.chunk_gdn2, ops.recurrent_gdn2
    else:
        kappa = F.normalize(torch.randn(B, T, H, K, dtype=torch.float64, generator=gen), dim=-1)
        x.update(a=-kappa, b=kappa * torch.rand(B, T, H, K, dtype=torch.float64, generator=gen),
                 gk=-0.6 * torch.rand(B, T, H, K, dtype=torch.float64, generator=gen))
        chunk, recurrent = ops.chunk_dplr_delta_rule, ops.recurrent_dplr_delta_rule
    want = recurrent(**x, output_final_state=True)
    with torch.no_grad():
        free = chunk(**x, output_final_state=True, chunk_size=16)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    kept = chunk(**leaves, output_final_state=True, chunk_size=16)
    for a, b_, w_ in zip(free, kept, want):
        assert torch.equal(a, b_.detach())
        assert rel_err(a, w_) < 1e-12
