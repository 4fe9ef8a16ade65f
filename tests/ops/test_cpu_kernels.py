"""The compiled CPU chunk forward (``fastweights/ops/cpu/chunk_delta.cpp``) against the float64
recurrence, against the PyTorch path it replaces, and its fallback when it cannot be built.

The default suite runs every CPU chunk call through the compiled kernel where it builds; these
tests pin what the kernel itself must do: float64 agreement to ~1e-13 on awkward shapes (so the
algebra is exact, not merely close), fp32 error within 2× (gradients 3×) of the fp32
recurrence, bitwise agreement across thread counts, and a build that fails without breaking
anything.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fastweights.ops import cpu as cpu_kernels
from helpers import RULES, call, make_inputs, rel_err

DELTA_RULES = ["delta", "gated_delta"]



def _run(rule, x, kernels_on: bool, grads: bool = True, **kwargs):
    cpu_kernels.set_enabled(kernels_on)
    try:
        leaves = {n: t.detach().clone().requires_grad_(grads) for n, t in x.items()}
        o, h = call(rule.forms[2], rule, leaves, output_final_state=True, **kwargs)
        if not grads:
            return [o, h]
        gen = torch.Generator().manual_seed(5)
        (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum().add((h * h).sum()).backward()
        return [o, h] + [leaves[n].grad for n in sorted(leaves)]
    finally:
        cpu_kernels.set_enabled(None)


def _reference(rule, x):
    """The recurrent form's output, final state and gradients (the same cotangents as :func:`_run`)."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, h = call(rule.reference, rule, leaves, output_final_state=True)
    gen = torch.Generator().manual_seed(5)
    (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum().add((h * h).sum()).backward()
    return [o, h] + [leaves[n].grad for n in sorted(leaves)]


def _names(x):
    return ["o", "h_T"] + ["d" + n for n in sorted(x)]


@pytest.mark.parametrize("rule_name", DELTA_RULES)
@pytest.mark.parametrize("T,K,V,C,h0", [(1, 16, 24, 32, True), (63, 60, 33, 64, False), (100, 16, 24, 32, True),
                                       (1000, 8, 12, 64, True)])
def test_float64_kernel_equals_the_recurrence(kernels, rule_name, T, K, V, C, h0, one_thread):
    """The kernel's forward (and the backward that uses what it keeps) in float64: ~1e-13 of the recurrence."""
    rule = RULES[rule_name]
    x = make_inputs(rule, 2, T, 2, K, V, initial_state=h0, seed=T)
    got, want = _run(rule, x, True, chunk_size=C), _reference(rule, x)
    for name, a, b in zip(_names(x), got, want):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("rule_name", DELTA_RULES)
@pytest.mark.parametrize("T,K,V", [(63, 32, 40), (1000, 16, 24)])
def test_fp32_kernel_error_within_2x_of_the_fp32_recurrence(kernels, rule_name, T, K, V, one_thread):
    rule = RULES[rule_name]
    x64 = make_inputs(rule, 2, T, 2, K, V, initial_state=True, seed=3)
    x32 = {n: t.float() for n, t in x64.items()}
    exact = _run(rule, x64, True)
    fast, rec = _run(rule, x32, True), _reference(rule, x32)
    for i, (name, f, r, e) in enumerate(zip(_names(x64), fast, rec, exact)):
        factor = 2.0 if i < 2 else 3.0
        e_fast, e_rec = rel_err(f, e), rel_err(r, e)
        assert e_fast <= factor * max(e_rec, 1e-7), f"{name}: kernel {e_fast:.2e} > {factor} x recurrent {e_rec:.2e}"


@pytest.mark.parametrize("rule_name", DELTA_RULES)
def test_kernel_matches_the_pytorch_path_with_packed_sequences(kernels, rule_name, one_thread):
    """Uneven packed sequences (cu_seqlens), an initial state each: the kernel and the PyTorch
    path agree (float64: 1e-13), forward and every gradient."""
    rule = RULES[rule_name]
    lengths = [5, 70, 1, 33]
    x = make_inputs(rule, 1, sum(lengths), 3, 20, 12, initial_state=False, seed=8)
    x["initial_state"] = torch.randn(len(lengths), 3, 20, 12, dtype=torch.float64)
    cu = torch.tensor([0] + lengths).cumsum(0)
    on = _run(rule, x, True, cu_seqlens=cu, chunk_size=32)
    off = _run(rule, x, False, cu_seqlens=cu, chunk_size=32)
    for name, a, b in zip(_names(x), on, off):
        assert rel_err(a, b) < 1e-13, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("rule_name", DELTA_RULES)
def test_kernel_is_bitwise_the_same_on_one_and_two_threads(kernels, rule_name):
    rule = RULES[rule_name]
    x = {n: t.float() for n, t in make_inputs(rule, 3, 130, 3, 32, 32, initial_state=True, seed=2).items()}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(rule, x, True, grads=False)
        torch.set_num_threads(2)
        two = _run(rule, x, True, grads=False)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_kernel_status_names_the_path(kernels):
    assert cpu_kernels.status().startswith("compiled CPU kernels")
    cpu_kernels.set_enabled(False)
    try:
        assert cpu_kernels.kernels() is None and "turned off" in cpu_kernels.status()
    finally:
        cpu_kernels.set_enabled(None)


def _child(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), os.path.join(os.getcwd(), "tests"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300)


def test_import_builds_nothing(tmp_path):
    r = _child("import fastweights, fastweights.ops, fastweights.layers; print('ok')", {"FASTWEIGHTS_CACHE": str(tmp_path)})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert not (tmp_path / "cpu_kernels").exists(), "import fastweights must not compile anything"


def test_a_failed_build_falls_back_with_one_warning(tmp_path):
    """A compiler that fails (CXX=false, empty cache): one RuntimeWarning line, the PyTorch path's
    results, and later calls quiet."""
    code = """
        import warnings, torch
        from fastweights import ops
        from fastweights.ops import cpu
        from helpers import RULES, call, make_inputs
        rule = RULES["gated_delta"]
        x = make_inputs(rule, 1, 40, 2, 8, 8, initial_state=True, seed=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            o1, _ = call(rule.forms[2], rule, x, output_final_state=True)
            o2, _ = call(rule.forms[2], rule, x, output_final_state=True)
        lines = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        o_ref, _ = call(rule.reference, rule, x, output_final_state=True)
        print(len(lines), lines[0] if lines else "", float((o1 - o_ref).abs().max()), torch.equal(o1, o2))
        print(cpu.status())
    """
    r = _child(code, {"FASTWEIGHTS_CACHE": str(tmp_path), "CXX": "false"})
    assert r.returncode == 0, r.stderr
    first, status = r.stdout.strip().splitlines()[-2:]
    count, rest = first.split(" ", 1)
    assert count == "1", r.stdout
    assert "compiled CPU kernels are unavailable" in rest and "using the PyTorch path" in rest
    err, same = rest.rsplit(" ", 2)[-2:]
    assert float(err) < 1e-12 and same == "True"
    assert status.startswith("PyTorch path (compiled CPU kernels unavailable")


def test_environment_switch_turns_the_kernels_off(tmp_path):
    r = _child("from fastweights.ops import cpu; print(cpu.enabled(), cpu.kernels(), cpu.status())",
               {"FASTWEIGHTS_CACHE": str(tmp_path), "FASTWEIGHTS_CPU_KERNELS": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False None PyTorch path (compiled CPU kernels turned off)"
    assert not (tmp_path / "cpu_kernels").exists()


@pytest.mark.parametrize("decay", [0.05, 3.0])
def test_float64_kernel_with_mild_and_strong_decays(kernels, decay, one_thread):
    """Per-token log decays of −0.05 (within a chunk |b| ≤ 60: Γ from 2C exponentials) and −3
    (|b| reaches 192: Γ from each difference's exponential): float64 equal to the recurrence."""
    rule = RULES["gated_delta"]
    x = make_inputs(rule, 1, 150, 2, 16, 20, initial_state=True, seed=6)
    x["g"] = torch.full_like(x["g"], -decay) + 0.01 * torch.rand_like(x["g"])
    got, want = _run(rule, x, True, chunk_size=64), _reference(rule, x)
    for name, a, b in zip(_names(x), got, want):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("rule_name", DELTA_RULES)
def test_bf16_products_kernel_within_2x_of_the_recurrence_and_closer_than_the_pytorch_path(kernels, bf16_kernels, rule_name,
                                                                                       one_thread):
    """Under ``ops.bf16_products()`` on bf16 inputs the kernel's products take bf16 operands with
    fp32 results (the PyTorch path's CPU ``bmm`` rounds each product's result to bf16): within 2×
    of the bf16-products recurrence and no worse than the PyTorch path, against float64."""
    from fastweights import ops

    rule = RULES[rule_name]
    x = make_inputs(rule, 2, 300, 2, 64, 48, initial_state=True, seed=12)
    low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v") else t.float()) for n, t in x.items()}
    exact = {n: t.double() for n, t in low.items()}
    o_ref, h_ref = call(rule.reference, rule, exact, output_final_state=True)
    errors = {}
    with torch.no_grad(), ops.bf16_products():
        o_rec, h_rec = call(rule.reference, rule, low, output_final_state=True)
        for on in (True, False):
            cpu_kernels.set_enabled(on)
            try:
                o, h = call(rule.forms[2], rule, low, output_final_state=True, chunk_size=64)
            finally:
                cpu_kernels.set_enabled(None)
            assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
            errors[on] = (rel_err(o, o_ref), rel_err(h, h_ref))
    rec = (rel_err(o_rec, o_ref), rel_err(h_rec, h_ref))
    print(f"bf16 products, o / h_T error: kernel {errors[True]}, PyTorch path {errors[False]}, recurrent {rec}")
    for i, name in enumerate(("o", "h_T")):
        assert errors[True][i] <= 2 * rec[i], f"{name}: kernel {errors[True][i]:.2e} > 2 x recurrent {rec[i]:.2e}"
        assert errors[True][i] <= 1.1 * errors[False][i], f"{name}: kernel {errors[True][i]:.2e}, PyTorch {errors[False][i]:.2e}"


@pytest.mark.parametrize("B,T,C,W,state", [(2, 7, 5, 4, True), (3, 1, 40, 4, False), (2, 2, 33, 3, True),
                                           (1, 9, 70, 1, False), (2, 40, 96, 4, True)])
def test_short_convolution_kernel_matches_the_pytorch_code(kernels, B, T, C, W, state, one_thread):
    """The layers' short convolution (``short_conv.cpp``) against the PyTorch code it replaces, in
    float64: output and the gradients of x, the weight and the carried state; T shorter than the
    window, a window of 1, channel counts off the kernel's block of 32."""
    from fastweights.layers.common import causal_conv1d

    gen = torch.Generator().manual_seed(C)
    x = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, W, generator=gen, dtype=torch.float64)
    s = torch.randn(B, W - 1, C, generator=gen, dtype=torch.float64) if state else None
    cot = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    runs = {}
    for on in (True, False):
        cpu_kernels.set_enabled(on)
        try:
            leaves = [t.clone().requires_grad_(True) for t in (x, w) + (() if s is None else (s,))]
            y = causal_conv1d(leaves[0], leaves[1], None, leaves[2] if s is not None else None)
            (y * cot).sum().backward()
            runs[on] = [y] + [t.grad for t in leaves]
        finally:
            cpu_kernels.set_enabled(None)
    for a, b in zip(runs[True], runs[False]):
        assert a.shape == b.shape and rel_err(a, b) < 1e-14


def test_short_convolution_kernel_gradcheck_and_threads(kernels):
    from fastweights.layers.common import causal_conv1d

    gen = torch.Generator().manual_seed(3)
    x, w, s = (torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
               for shape in ((2, 6, 5), (5, 4), (2, 3, 5)))
    assert torch.autograd.gradcheck(lambda a, b, c: causal_conv1d(a, b, None, c), (x, w, s))
    x32 = torch.randn(4, 64, 130, generator=gen)
    w32 = torch.randn(130, 4, generator=gen, requires_grad=True)
    threads = torch.get_num_threads()
    grads = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            w32.grad = None
            y = causal_conv1d(x32, w32)
            y.pow(2).sum().backward()
            grads.append((y.detach(), w32.grad.clone()))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_compiled_l2_norm_matches_the_formula_and_keeps_double_backward_elsewhere(kernels):
    """``normalize_qk(x, "l2", compiled=True)`` (what the chunk ops use on the CPU: ``l2norm.cpp``)
    equals ``x·rsqrt(Σx² + ε)`` forward and backward in float64, on a strided input and an all-zero
    row; the default (``compiled=False``, the recurrent and parallel forms) keeps autograd's
    formula, so second derivatives still work there."""
    from fastweights.ops.feature_maps import normalize_qk

    gen = torch.Generator().manual_seed(4)
    base = torch.randn(3, 7, 2, 40, generator=gen, dtype=torch.float64)
    base[0, 0, 0] = 0.0
    x = base[..., ::2]  # strided: K = 20
    cot = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    outs = []
    for compiled in (True, False):
        leaf = x.clone().requires_grad_(True)
        y = normalize_qk(leaf, "l2", compiled=compiled)
        (y * cot).sum().backward()
        outs.append((y, leaf.grad))
    assert rel_err(outs[0][0], outs[1][0]) < 1e-15 and rel_err(outs[0][1], outs[1][1]) < 1e-14
    assert outs[0][0].grad_fn is not None and "L2Norm" in type(outs[0][0].grad_fn).__name__
    assert torch.equal(outs[0][0][0, 0, 0], torch.zeros(20, dtype=torch.float64))
    small = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: normalize_qk(t, "l2", compiled=True), (small,))
    assert torch.autograd.gradgradcheck(lambda t: normalize_qk(t, "l2"), (small,))
