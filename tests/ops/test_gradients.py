"""Gradients through every form equal those through the recurrent form (float64).

One backward of ``(o·do).sum() + (h_T·dh).sum()`` is compared for dq, dk, dv,
dβ, dg and dh0, so the final state's cotangent is exercised too; and
``torch.autograd.gradcheck`` checks every form, the reference included, against
finite differences on small shapes.
"""

import pytest
import torch

from helpers import RULES, assert_close, call, make_inputs

TOL = 1e-10

FORMS = [
    pytest.param(rule, form, id=f"{rule.name}-{form.__name__.split('_')[0]}")
    for rule in RULES.values()
    for form in rule.forms
]
FAST_FORMS = [p for p in FORMS if not p.id.endswith("-recurrent")]


def grads(form, rule, x, do, dh, **kwargs):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, h = call(form, rule, leaves, output_final_state=True, **kwargs)
    loss = (o * do).sum() + (h * dh).sum()
    names = list(leaves)
    return dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names])))


@pytest.mark.parametrize(
    "shape", [(2, 63, 2, 60, 20, 16), (1, 100, 3, 16, 24, 32), (2, 1, 1, 5, 3, 64)],
    ids=["B2-T63-K60-V20-C16", "B1-T100-K16-V24-C32", "B2-T1-C64"],
)
@pytest.mark.parametrize("rule,form", FAST_FORMS)
def test_gradients_equal_the_recurrence(rule, form, shape):
    B, T, H, K, V, C = shape
    x = make_inputs(rule, B, T, H, K, V, initial_state=True, seed=11)
    o, h = call(rule.reference, rule, x, output_final_state=True)
    gen = torch.Generator().manual_seed(12)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dh = torch.randn(h.shape, generator=gen, dtype=h.dtype)
    want = grads(rule.reference, rule, x, do, dh)
    got = grads(form, rule, x, do, dh, chunk_size=C)
    for name in want:
        assert_close(f"d{name}", got[name], want[name], TOL)


@pytest.mark.parametrize("rule,form", FAST_FORMS)
def test_varlen_gradients_equal_the_recurrence(rule, form):
    lengths = [20, 3, 41]
    x = make_inputs(rule, 1, sum(lengths), 2, 7, 5, seed=13)
    x["initial_state"] = make_inputs(rule, len(lengths), 1, 2, 7, 5, initial_state=True, seed=14)["initial_state"]
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, h = call(rule.reference, rule, x, cu_seqlens=cu, output_final_state=True)
    do, dh = torch.randn_like(o), torch.randn_like(h)
    want = grads(rule.reference, rule, x, do, dh, cu_seqlens=cu)
    got = grads(form, rule, x, do, dh, cu_seqlens=cu, chunk_size=16)
    for name in want:
        assert_close(f"d{name}", got[name], want[name], TOL)


@pytest.mark.parametrize("rule,form", FORMS)
def test_gradcheck(rule, form):
    x = make_inputs(rule, 1, 5, 1, 3, 2, initial_state=True, seed=15)
    names = list(x)

    def fn(*tensors):
        o, h = call(form, rule, dict(zip(names, tensors)), output_final_state=True, chunk_size=2)
        return o, h

    inputs = tuple(t.detach().clone().requires_grad_(True) for t in x.values())
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
