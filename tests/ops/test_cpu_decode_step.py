"""The compiled CPU decode step (``fastweights/ops/cpu/decode_step.cpp``) behind
``delta_rule_step`` / ``gated_delta_rule_step``: equal to the float64 recurrent form and to the
PyTorch step, in place or not, with awkward shapes and strides, batch invariant bitwise, and
the PyTorch step still right when the kernels are off."""

import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.ops import cpu as cpu_kernels
from fastweights.ops import step as step_module
from helpers import assert_close, rel_err

SHAPES = [(1, 1, 60, 20), (3, 1, 60, 60), (1, 3, 16, 24), (2, 3, 128, 128), (2, 2, 130, 72)]  # (N, H, K, V)



def _token(n, h, dk, dv, dtype=torch.float64, seed=0, gated=True):
    """One token's inputs ``[N, H, ·]`` and a state ``[N, H, K, V]``: unit keys, β in (0, 1), g in (-1, 0)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=r(n, h, dk), k=F.normalize(r(n, h, dk), dim=-1), v=r(n, h, dv), beta=torch.sigmoid(r(n, h)),
             g=F.logsigmoid(r(n, h)) if gated else None, state=r(n, h, dk, dv))
    return {name: None if t is None else t.to(dtype) for name, t in x.items()}


def _step(x, inplace=False, state=None):
    state = x["state"] if state is None else state
    if x["g"] is None:
        return ops.delta_rule_step(x["q"], x["k"], x["v"], x["beta"], state, inplace=inplace)
    return ops.gated_delta_rule_step(x["q"], x["k"], x["v"], x["beta"], x["g"], state, inplace=inplace)


def _reference(x):
    """The float64 recurrent form with T = 1 from the state: ``(o [N, H, V], h [N, H, K, V])``."""
    d = {n: None if t is None else t.double() for n, t in x.items()}
    args = [d[n].unsqueeze(1) for n in ("q", "k", "v")]
    if d["g"] is None:
        o, h = ops.recurrent_delta_rule(*args, d["beta"].unsqueeze(1), initial_state=d["state"],
                                        output_final_state=True)
    else:
        o, h = ops.recurrent_gated_delta_rule(*args, d["g"].unsqueeze(1), d["beta"].unsqueeze(1),
                                              initial_state=d["state"], output_final_state=True)
    return o[:, 0], h


def _forbid_pytorch_step(monkeypatch):
    """Make the PyTorch step fail, so a passing call proves the kernel ran."""
    def fail(*args, **kwargs):
        raise AssertionError("the PyTorch step ran where the compiled kernel should have")
    monkeypatch.setattr(step_module, "delta_update", fail)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
def test_float64_equals_the_recurrent_form(kernels_on, monkeypatch, shape, gated, inplace):
    x = _token(*shape, gated=gated, seed=sum(shape))
    want_o, want_h = _reference(x)
    _forbid_pytorch_step(monkeypatch)
    state = x["state"].clone()
    o, h = _step(x, inplace=inplace, state=state)
    assert_close("o", o, want_o, 1e-12)
    assert_close("state", h, want_h, 1e-12)
    assert (h is state) == inplace
    if not inplace:
        assert torch.equal(state, x["state"])  # the caller's state untouched


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
def test_float32_error_at_most_twice_the_pytorch_steps(kernels_on, shape, gated):
    x = _token(*shape, dtype=torch.float32, gated=gated, seed=7 + sum(shape))
    want_o, want_h = _reference(x)
    cpu_kernels.set_enabled(False)
    base_o, base_h = _step(x)
    cpu_kernels.set_enabled(True)
    o, h = _step(x)
    assert o.dtype == h.dtype == torch.float32
    for name, got, base, want in (("o", o, base_o, want_o), ("state", h, base_h, want_h)):
        err, base_err = rel_err(got, want), rel_err(base, want)
        print(f"{name}: kernel {err:.2e}, PyTorch step {base_err:.2e} (vs float64)")
        assert err <= 2 * base_err + 1e-7, f"{name}: {err:.2e} > 2 x {base_err:.2e}"
        assert_close(f"{name} vs the PyTorch step", got, base, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
def test_inplace_and_new_state_agree_bitwise(kernels_on, dtype, gated):
    x = _token(3, 2, 60, 44, dtype=dtype, gated=gated)
    o_new, h_new = _step(x)
    state = x["state"].clone()
    o_in, h_in = _step(x, inplace=True, state=state)
    assert h_in is state and torch.equal(h_in, h_new) and torch.equal(o_in, o_new)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
def test_a_row_alone_equals_the_row_in_a_batch_bitwise(kernels_on, dtype, gated):
    x = _token(8, 3, 60, 72, dtype=dtype, gated=gated, seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the batch split over threads, the row alone on one
        o_all, h_all = _step(x)
        torch.set_num_threads(1)
        for row in (0, 5, 7):
            alone = {n: None if t is None else t[row:row + 1].clone() for n, t in x.items()}
            o, h = _step(alone)
            assert torch.equal(o, o_all[row:row + 1]) and torch.equal(h, h_all[row:row + 1]), f"row {row}"
    finally:
        torch.set_num_threads(threads)


def test_strided_and_low_precision_inputs(kernels_on, monkeypatch):
    """Views with strides (a token out of a [N, T, H, ·] batch, every other feature) and bf16
    inputs with an fp32 state take the kernel and equal the PyTorch step."""
    gen = torch.Generator().manual_seed(5)
    n, t, h, dk, dv = 2, 3, 2, 32, 24
    q = torch.randn(n, t, h, 2 * dk, generator=gen)[:, 1, :, ::2]
    k = F.normalize(torch.randn(n, t, h, dk, generator=gen), dim=-1)[:, 2]
    v = torch.randn(n, t, h, dv, generator=gen)[:, 0]
    beta = torch.sigmoid(torch.randn(n, h, t, generator=gen))[..., 1]
    g = F.logsigmoid(torch.randn(n, h, generator=gen)).t().contiguous().t()
    state = torch.randn(n, h, dk, dv, generator=gen)
    cpu_kernels.set_enabled(False)
    want = [ops.gated_delta_rule_step(q, k, v, beta, g, state),
            ops.gated_delta_rule_step(*(a.bfloat16() for a in (q, k, v, beta, g)), state)]
    cpu_kernels.set_enabled(True)
    with monkeypatch.context() as m:
        _forbid_pytorch_step(m)
        got = [ops.gated_delta_rule_step(q, k, v, beta, g, state),
               ops.gated_delta_rule_step(*(a.bfloat16() for a in (q, k, v, beta, g)), state)]
    for (o, hh), (wo, wh), tol in zip(got, want, (1e-5, 1e-2)):
        assert o.dtype == wo.dtype and hh.dtype == wh.dtype == torch.float32
        assert_close("o", o.float(), wo.float(), tol)
        assert_close("state", hh, wh, 1e-5)


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
def test_fallback_with_the_kernels_off_still_right(gated):
    cpu_kernels.set_enabled(False)
    try:
        x = _token(1, 3, 60, 20, gated=gated, seed=2)
        want_o, want_h = _reference(x)
        calls = []
        original = step_module.delta_update

        def counted(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        step_module.delta_update = counted
        try:
            o, h = _step(x)
            state = x["state"].clone()
            o2, h2 = _step(x, inplace=True, state=state)
        finally:
            step_module.delta_update = original
        assert len(calls) == 2  # the PyTorch step ran
        assert_close("o", o, want_o, 1e-12)
        assert_close("state", h, want_h, 1e-12)
        assert h2 is state and torch.equal(h2, h) and torch.equal(o2, o)
    finally:
        cpu_kernels.set_enabled(None)


def test_gradients_and_noncontiguous_states_take_the_pytorch_step(kernels_on):
    """The kernel has no backward and wants a contiguous state: those calls run the PyTorch step."""
    x = _token(2, 2, 16, 12, seed=4)
    want_o, want_h = _reference(x)
    q = x["q"].clone().requires_grad_(True)
    o, h = ops.gated_delta_rule_step(q, x["k"], x["v"], x["beta"], x["g"], x["state"])
    (o.sum() + h.sum()).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert_close("o", o.detach(), want_o, 1e-12)
    strided = x["state"].transpose(2, 3).contiguous().transpose(2, 3)
    assert not strided.is_contiguous()
    o, h = ops.gated_delta_rule_step(x["q"], x["k"], x["v"], x["beta"], x["g"], strided, inplace=True)
    assert h is strided
    assert_close("o", o, want_o, 1e-12)
    assert_close("state", h, want_h, 1e-12)
