"""Gated DeltaNet-2 on the compiled CPU kernels (``chunk_kda.cpp`` with GDN-2's erase keys
e = b ⊙ k in the place of β k and the written values x = w ⊙ v in the place of β v): forward
and every gradient against the float64 recurrence, against the fp32 recurrence's own error,
against the PyTorch path (``backend="torch"``, ``FASTWEIGHTS_CPU_KERNELS=0``) and against KDA's
kernel when b = w = β. A fixture records the kernels' calls with erase keys, so a test that
silently ran the PyTorch path fails.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.ops import cpu as cpu_kernels
from fastweights.ops.kda import chunk as kda_chunk_module

from helpers import rel_err, thread_and_batch_runs

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64



@pytest.fixture
def gdn2_calls(monkeypatch):
    """``("forward", keep)`` / ``("backward", None)`` for every compiled call with GDN-2's erase keys."""
    seen = []
    for name in ("_native_forward", "_native_backward"):
        original = getattr(kda_chunk_module, name)

        def wrapped(*args, _original=original, _name=name, **kw):
            out = _original(*args, **kw)
            if out is not None and kw.get("erase") is not None:
                seen.append(("forward", args[8] if len(args) > 8 else True) if _name == "_native_forward"
                            else ("backward", None))
            return out

        monkeypatch.setattr(kda_chunk_module, name, wrapped)
    return seen


def gdn2_inputs(B, T, H, K, V, *, seed=0, decay=1.0, initial_state=True, n_states=None):
    """Float64 GDN-2 inputs: unit keys, b in (0, 2), w in (0, 1), g in (−decay, 0) per channel."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    x = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V),
             g=-decay * torch.rand(B, T, H, K, generator=gen, dtype=F64),
             b=2 * torch.rand(B, T, H, K, generator=gen, dtype=F64), w=torch.rand(B, T, H, V, generator=gen, dtype=F64))
    if initial_state:
        x["initial_state"] = rand(n_states or B, H, K, V) * 0.5
    return x


def _run(form, x, kernels_on=True, **kwargs):
    """``form``'s output, final state and the gradient of every input (fixed random cotangents)."""
    cpu_kernels.set_enabled(kernels_on)
    try:
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        o, h = form(**leaves, output_final_state=True, **kwargs)
        gen = torch.Generator().manual_seed(5)
        # float64 cotangents, rounded to the run's dtype: the same for an fp32 run and its float64 truth
        loss = (o * torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype)).sum()
        loss = loss + (h * torch.randn(h.shape, generator=gen, dtype=F64).to(h.dtype)).sum()
        loss.backward()
        return [o, h] + [leaves[n].grad for n in sorted(leaves)]
    finally:
        cpu_kernels.set_enabled(None)


def _names(x):
    return ["o", "h_T"] + ["d" + n for n in sorted(x)]


def _assert_equal_to(got, want, x, tol):
    errors = {name: rel_err(a, b) for name, a, b in zip(_names(x), got, want)}
    print(" ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    for name, err in errors.items():
        assert err < tol, f"{name}: {err:.2e}"


@pytest.mark.parametrize("B,T,H,K,V,C,h0", [
    (2, 1, 2, 16, 24, 64, True), (2, 63, 2, 60, 20, 64, False), (3, 100, 2, 32, 48, 32, True),
    (1, 1000, 2, 16, 8, 64, True), (2, 130, 1, 60, 60, 128, True),
], ids=["T1", "T63-K60", "T100-KneV-B3", "T1000", "T130-C128"])
def test_float64_kernel_equals_the_recurrence(kernels, gdn2_calls, B, T, H, K, V, C, h0):
    """The compiled forward and backward: output, final state and every gradient (q, k, v, g, b, w,
    the initial state) ~1e-12 of the recurrence's autograd."""
    x = gdn2_inputs(B, T, H, K, V, seed=T, initial_state=h0)
    got = _run(ops.chunk_gdn2, x, chunk_size=C)
    want = _run(ops.recurrent_gdn2, x, kernels_on=False)
    _assert_equal_to(got, want, x, 1e-12)
    assert gdn2_calls == [("forward", True), ("backward", None)]


@pytest.mark.parametrize("decay,C", [(12.0, 64), (12.0, 100), (200.0, 64)], ids=["g12-C64", "g12-C100", "g200-C64"])
def test_float64_kernel_with_strong_decays(kernels, gdn2_calls, decay, C):
    """α down to e^{-12} per token and channel (a sub-block of 8 or 10 tokens spans up to e^{-96} or
    e^{-120}: its own pairs by the split factors, one of them that large), and down to e^{-200} (the
    span passes the float64 kernel's e^{±600} limit: those pairs are summed one by one); ~1e-12."""
    x = gdn2_inputs(1, 150, 2, 16, 20, seed=6, decay=decay)
    got = _run(ops.chunk_gdn2, x, chunk_size=C)
    want = _run(ops.recurrent_gdn2, x, kernels_on=False)
    _assert_equal_to(got, want, x, 1e-12)
    assert ("backward", None) in gdn2_calls


@pytest.mark.parametrize("decay", [1.0, 12.0])
def test_fp32_kernel_error_within_2x_of_the_fp32_recurrence(kernels, gdn2_calls, decay):
    """fp32: the kernel's error against float64 (on the same fp32 values) within 2× the fp32
    recurrence's, gradients within 3×; strong decays (12) take the pair-by-pair branch in fp32."""
    x32 = {n: t.float() for n, t in gdn2_inputs(2, 300, 2, 32, 40, seed=3, decay=decay).items()}
    exact = _run(ops.recurrent_gdn2, {n: t.double() for n, t in x32.items()}, kernels_on=False)
    ref32 = _run(ops.recurrent_gdn2, x32, kernels_on=False)
    got = _run(ops.chunk_gdn2, x32)
    assert gdn2_calls
    for i, (name, a, r, e) in enumerate(zip(_names(x32), got, ref32, exact)):
        err, base = rel_err(a.double(), e), rel_err(r.double(), e)
        print(f"{name}: kernel {err:.2e}, fp32 recurrence {base:.2e}")
        assert err <= (2.0 if i < 2 else 3.0) * max(base, 1e-7), name


def test_packed_sequences_with_length_one_segments(kernels, gdn2_calls):
    """Uneven packed sequences with length-1 segments and an initial state each: the kernel equals
    the recurrence (1e-12) and the PyTorch path (1e-13), forward and every gradient."""
    lengths = [5, 70, 1, 33, 1, 2]
    x = gdn2_inputs(1, sum(lengths), 3, 20, 12, seed=8, n_states=len(lengths))
    cu = torch.tensor([0] + lengths).cumsum(0)
    on = _run(ops.chunk_gdn2, x, cu_seqlens=cu, chunk_size=32)
    assert gdn2_calls
    off = _run(ops.chunk_gdn2, x, False, cu_seqlens=cu, chunk_size=32)
    want = _run(ops.recurrent_gdn2, x, False, cu_seqlens=cu)
    _assert_equal_to(on, off, x, 1e-13)
    _assert_equal_to(on, want, x, 1e-12)


def test_no_grad_runs_the_kernel_keeping_nothing(kernels, gdn2_calls):
    """Without a gradient to record, the kernel keeps no chunk states (keep False); output and final
    state still ~1e-12 of the recurrence, with the initial state, B > 1, K != V, T not a multiple of C."""
    x = gdn2_inputs(2, 100, 3, 60, 40, seed=11)
    with torch.no_grad():
        o, h = ops.chunk_gdn2(**x, output_final_state=True, chunk_size=64)
        o_ref, h_ref = ops.recurrent_gdn2(**x, output_final_state=True)
    print(f"o {rel_err(o, o_ref):.1e} h_T {rel_err(h, h_ref):.1e}")
    assert rel_err(o, o_ref) < 1e-12 and rel_err(h, h_ref) < 1e-12
    assert gdn2_calls == [("forward", False)]


def test_backend_torch_and_kernels_off_run_the_pytorch_path_and_agree(kernels, gdn2_calls):
    """``backend="torch"`` and ``FASTWEIGHTS_CPU_KERNELS=0`` never reach the kernel; ``backend="cpu"``
    does, and all agree to 1e-13 in float64."""
    x = gdn2_inputs(2, 70, 2, 24, 16, seed=12)
    torch_path = _run(ops.chunk_gdn2, x, chunk_size=32, backend="torch")
    off = _run(ops.chunk_gdn2, x, False, chunk_size=32, backend="auto")
    assert gdn2_calls == []
    cpu_path = _run(ops.chunk_gdn2, x, chunk_size=32, backend="cpu")
    assert gdn2_calls == [("forward", True), ("backward", None)]
    _assert_equal_to(cpu_path, torch_path, x, 1e-13)
    _assert_equal_to(off, torch_path, x, 0.5e-15)


def test_kernel_with_b_and_w_equal_to_beta_is_kdas_kernel(kernels, gdn2_calls):
    """b = w = β (every channel) is KDA: the kernel with erase keys β k and values β v (GDN-2's
    call) equals the same kernel's KDA call (β inside the UT solve) to rounding, forward and gradients."""
    x = gdn2_inputs(2, 90, 2, 20, 12, seed=13)
    beta = torch.rand(2, 90, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
    x.update(b=beta[..., None].expand(-1, -1, -1, 20).clone(), w=beta[..., None].expand(-1, -1, -1, 12).clone())
    got = _run(ops.chunk_gdn2, x, chunk_size=32)
    assert gdn2_calls == [("forward", True), ("backward", None)]
    kda_x = {n: t for n, t in x.items() if n not in ("b", "w")}
    kda = _run(ops.chunk_kda, dict(kda_x, beta=beta), chunk_size=32)
    names = _names(x)
    for name in ("o", "h_T", "dq", "dk", "dv", "dg", "dinitial_state"):
        i = names.index(name)
        kda_i = _names(dict(kda_x, beta=beta)).index(name)
        print(f"{name}: {rel_err(got[i], kda[kda_i]):.1e}")
        assert rel_err(got[i], kda[kda_i]) < 1e-12, name
    # dβ = Σ over the channels of db and dw
    d_beta = got[names.index("db")].sum(-1) + got[names.index("dw")].sum(-1)
    assert rel_err(d_beta, kda[_names(dict(kda_x, beta=beta)).index("dbeta")]) < 1e-12


def test_kernel_is_bitwise_the_same_on_one_and_two_threads_and_in_a_batch(kernels, gdn2_calls):
    x = {n: t.float() for n, t in gdn2_inputs(3, 130, 3, 32, 32, seed=2).items()}
    one, two, alone = thread_and_batch_runs(ops.chunk_gdn2, x)
    assert len(gdn2_calls) == 3
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(alone[0], one[0][:1]) and torch.equal(alone[1], one[1][:1])

