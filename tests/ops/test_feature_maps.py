"""Feature maps φ and the q/k normalizations."""

import math

import pytest
import torch

from fastweights import ops


def test_dpfp_dimension_and_quadrant_orthogonality():
    """Schlag et al. 2021: keys in different quadrants map to orthogonal features."""
    phi = ops.DPFP(nu=1)
    keys = torch.tensor([[0.9, 0.2], [-0.3, 0.8], [-0.5, -0.6], [0.4, -0.7]], dtype=torch.float64)
    f = phi(keys)
    assert f.shape == (4, phi.output_dim(2)) == (4, 4)
    gram = f @ f.T
    off = gram - torch.diag(torch.diag(gram))
    print("raw key Gram off-diagonal max:", (keys @ keys.T - torch.diag(torch.diag(keys @ keys.T))).abs().max().item())
    assert off.abs().max() == 0.0 and torch.diag(gram).min() > 0
    assert ops.DPFP(nu=3)(torch.randn(5, 64)).shape == (5, 384)  # 2·K·ν: the 128/256/384 of ch. 3


def test_favor_plus_is_seeded_unbiased_and_redraws():
    d = 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(d, generator=gen, dtype=torch.float64) * 0.5
    k = torch.randn(d, generator=gen, dtype=torch.float64) * 0.5
    exact = math.exp(q @ k / math.sqrt(d))
    a, b = ops.FavorPlus(d, 64, seed=3), ops.FavorPlus(d, 64, seed=3)
    assert torch.equal(a(q), b(q)), "the same seed gives the same features"
    before = a(q).clone()
    a.redraw()
    assert not torch.allclose(before, a(q)), "redraw() draws new directions"
    assert (a(q) > 0).all(), "FAVOR+ features are positive"
    errors = []
    for m in (8, 512, 8192):
        phi = ops.FavorPlus(d, m, seed=1)
        errors.append(abs(phi(q) @ phi(k) - exact) / exact)
    print("FAVOR+ relative kernel error for m = 8, 512, 8192:", errors)
    assert errors[2] < 0.02 and errors[2] < errors[0]
    # Orthogonal blocks: within a block of K directions the rows are mutually orthogonal.
    omega = ops.FavorPlus(d, d, seed=5).omega
    gram = omega @ omega.T
    assert (gram - torch.diag(torch.diag(gram))).abs().max() < 1e-10


def test_taylor_kernel_is_the_second_order_series():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 6, generator=gen, dtype=torch.float64)
    phi = ops.Taylor()
    s = q @ k
    assert phi.output_dim(6) == 43
    assert abs(phi(q) @ phi(k) - (1 + s + s * s / 2)) < 1e-12


def test_positive_maps_are_positive():
    x = torch.linspace(-20, 20, 101)[:, None]
    assert (ops.EluPlusOne()(x) > 0).all()
    assert (ops.ReLU()(x) >= 0).all()


def test_normalizations():
    x = torch.tensor([[3.0, 1.0], [0.0, 0.0], [3.0, 4.0]])
    assert torch.allclose(ops.normalize_qk(x, "sum")[0], torch.tensor([0.75, 0.25]))
    assert torch.equal(ops.normalize_qk(x, "sum")[1], torch.zeros(2)), "a zero vector stays zero, not NaN"
    assert torch.allclose(ops.normalize_qk(x, "l2")[2], torch.tensor([0.6, 0.8]))
    assert torch.equal(ops.normalize_qk(x, None), x)
    with pytest.raises(ValueError, match="unknown `qk_norm` 'max'"):
        ops.normalize_qk(x, "max")


@pytest.mark.parametrize("bad", [dict(nu=0), dict(nu=1.5)])
def test_dpfp_rejects_bad_nu(bad):
    with pytest.raises(ValueError, match="DPFP: `nu` must be a positive int"):
        ops.DPFP(**bad)


def test_favor_rejects_bad_sizes():
    with pytest.raises(ValueError, match="FavorPlus: `num_features` must be a positive int, got 0"):
        ops.FavorPlus(4, 0)
