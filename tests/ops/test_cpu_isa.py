"""The compiled CPU kernels on every instruction-set path this machine can run.

``fastweights/ops/cpu/dispatch.py`` picks one path per process (AMX, AVX512-BF16, AVX2, portable) from
the CPU's flags, the build and ``FASTWEIGHTS_CPU_ISA``, which forces a lower one. The first tests
pin that choice on made-up CPUs (no build needed). The rest run the kernels on each path the
machine reaches — forced through the same variable — against the float64 recurrence: the fp32
and fp64 chunk forward and backward (T = 1, 63, 100; K ≠ V; K = 60; an initial state; packed
sequences with length-1 segments), the bf16-products forward (within 2× of the
bf16-products recurrence), the bf16 GEMM itself, and bitwise determinism and batch invariance.
The AMX path is the oneDNN brgemm call; where the CPU has no AMX, oneDNN runs the same call on
its vector units, so its code (packing, padding, alpha/beta) is tested here too, but it is only
*chosen* where the CPU reports ``amx_bf16``. No speed is asserted anywhere.
"""

import itertools
import os

import pytest
import torch

from fastweights.ops import cpu as cpu_kernels
from fastweights.ops.cpu import dispatch as isa
from helpers import RULES, bf16_op_inputs, call, make_inputs, record_calls, rel_err

AMD_EPYC = frozenset("fma avx2 avx512f avx512bw avx512_bf16".split())
XEON_AMX = AMD_EPYC | {"amx_bf16", "amx_tile"}
NO_ENV = {}


# -- the choice, on made-up CPUs ----------------------------------------------------------------


@pytest.mark.parametrize("flags,machine,want", [
    (XEON_AMX, "x86_64", "amx"), (AMD_EPYC, "x86_64", "avx512bf16"), (frozenset({"avx2", "fma"}), "x86_64", "avx2"),
    (frozenset({"sse2"}), "x86_64", "portable"), (XEON_AMX, "aarch64", "portable"),
    (AMD_EPYC | {"amx_tile"}, "x86_64", "avx512bf16"),  # AMX tiles without the bf16 unit: not AMX bf16
])
def test_the_cpu_decides_the_highest_path(flags, machine, want):
    choice = isa.choose(3, flags=flags, machine=machine, environ=NO_ENV)
    assert choice.name == want and choice.reasons


@pytest.mark.parametrize("flags,machine,system,want", [
    (XEON_AMX, "x86_64", "Linux", True), (AMD_EPYC, "x86_64", "Linux", True),
    (frozenset({"avx2", "fma"}), "x86_64", "Linux", False), (frozenset({"avx512f", "avx512bw"}), "x86_64", "Linux", False),
    (frozenset({"fp", "asimd", "sve", "bf16", "i8mm"}), "aarch64", "Linux", True),  # e.g. Neoverse V1
    (frozenset({"fp", "asimd", "asimddp"}), "aarch64", "Linux", False),  # e.g. Neoverse N1
    (frozenset({"bf16"}), "ppc64le", "Linux", False), (AMD_EPYC, "riscv64", "Linux", False),
])
def test_the_cpu_decides_whether_it_multiplies_bf16(flags, machine, system, want):
    assert isa.bf16_dot_unit(flags, machine, system) is want


def test_without_the_kernels_bf16_products_pay_where_the_cpu_has_a_bf16_unit(monkeypatch):
    """Before the kernels load (or without them) ``bf16_unit()`` reads the CPU: AVX512-BF16 on
    x86-64 within what FASTWEIGHTS_CPU_ISA allows; ``bf16`` among an Arm CPU's Features; else no."""
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: False)
    monkeypatch.delenv(isa.ENV, raising=False)
    monkeypatch.setattr(isa.platform, "system", lambda: "Linux")
    for machine, flags, env, want in [
        ("x86_64", AMD_EPYC, None, True), ("x86_64", AMD_EPYC, "avx2", False), ("x86_64", XEON_AMX, "portable", False),
        ("x86_64", frozenset({"avx2", "fma"}), None, False), ("aarch64", frozenset({"asimd", "bf16"}), None, True),
        ("aarch64", frozenset({"asimd", "bf16"}), "portable", True),  # no kernel path reads bf16 there: the CPU decides
        ("aarch64", frozenset({"asimd"}), None, False), ("ppc64le", frozenset(), None, False),
    ]:
        monkeypatch.setattr(isa.platform, "machine", lambda m=machine: m)
        monkeypatch.setattr(isa, "cpu_flags", lambda f=flags: f)
        if env is None:
            monkeypatch.delenv(isa.ENV, raising=False)
        else:
            monkeypatch.setenv(isa.ENV, env)
        assert cpu_kernels.bf16_unit() is want, (machine, sorted(flags), env)


def test_amx_is_chosen_only_where_the_cpu_reports_amx_bf16():
    assert isa.choose(3, flags=XEON_AMX, machine="x86_64", environ=NO_ENV).name == "amx"
    assert isa.choose(3, flags=AMD_EPYC, machine="x86_64", environ=NO_ENV).name == "avx512bf16"
    # the build caps it: without torch's brgemm, or without MKL, whatever the CPU has
    capped = isa.choose(2, True, False, flags=XEON_AMX, machine="x86_64", environ=NO_ENV)
    assert capped.name == "avx512bf16" and "brgemm" in capped.reasons[-1]
    no_mkl = isa.choose(0, False, False, flags=XEON_AMX, machine="x86_64", environ=NO_ENV)
    assert no_mkl.name == "portable" and "MKL" in no_mkl.reasons[-1]


def test_the_variable_forces_a_lower_path_and_never_a_higher_one():
    for name in isa.LEVELS:
        choice = isa.choose(3, flags=XEON_AMX, machine="x86_64", environ={isa.ENV: name.upper()})
        assert choice.name == name and f"{isa.ENV}={name}" in choice.reasons[-1]
    with pytest.warns(RuntimeWarning, match="asks for more"):
        choice = isa.choose(3, flags=AMD_EPYC, machine="x86_64", environ={isa.ENV: "amx"})
    assert choice.name == "avx512bf16" and "ignored" in choice.reasons[-1]
    assert isa.choose(3, flags=AMD_EPYC, machine="x86_64", environ={isa.ENV: "avx512-bf16"}).name == "avx512bf16"
    assert isa.choose(3, flags=AMD_EPYC, machine="x86_64", environ={isa.ENV: " "}).name == "avx512bf16"


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match=r"FASTWEIGHTS_CPU_ISA must be one of portable, avx2, avx512bf16, amx.*'sse9'"):
        isa.requested({isa.ENV: "sse9"})
    with pytest.raises(ValueError, match="`build_max`"):
        isa.choose(7, environ=NO_ENV)
    with pytest.raises(TypeError, match="`name` must be a str"):
        cpu_kernels.set_isa(3)


def test_every_kernel_is_reported_on_every_path():
    for level in range(len(isa.LEVELS)):
        report = isa.kernel_paths(level, flags=AMD_EPYC)
        assert {"chunk_delta_fwd_bf16 (bf16 products)", "delta_step (decode)", "kda_step (decode)"} <= set(report)
        assert any(name.startswith("chunk_kda_fwd") for name in report)
        assert any(name.startswith("chunk_linear_attn_fwd") for name in report)
        assert all(isinstance(v, str) and v for v in report.values())
    assert "AMX" in isa.kernel_paths(3)["chunk_delta_fwd_bf16 (bf16 products)"]
    assert "vdpbf16ps" in isa.kernel_paths(2)["chunk_delta_fwd_bf16 (bf16 products)"]
    assert "portable" in isa.kernel_paths(0)["chunk_delta_fwd / chunk_delta_bwd (fp32, fp64)"]
    plain = "plain bf16 inputs (inference: delta, gated, KDA, linear attention)"
    assert "AVX-512, 16 lanes" in isa.kernel_paths(1, flags=AMD_EPYC)[plain]
    assert "AVX2, 8 lanes" in isa.kernel_paths(1, flags=frozenset({"avx2", "fma"}))[plain]
    assert "scalar loops" in isa.kernel_paths(0, flags=AMD_EPYC)[plain]


# -- the kernels on each path this machine runs -------------------------------------------------



@pytest.fixture(params=isa.LEVELS)
def path(request, kernels, monkeypatch):
    """The kernels forced onto one path through FASTWEIGHTS_CPU_ISA (AMX on a CPU without it: the
    brgemm call, which oneDNN runs on the vector units), back to the machine's choice after."""
    level = isa.LEVELS.index(request.param)
    if level > kernels.build_max_isa:
        pytest.skip(f"this build runs up to {isa.LEVELS[kernels.build_max_isa]}")
    cpu_has = isa.cpu_level()[0]
    if level > cpu_has and request.param != "amx":
        pytest.skip(f"this CPU runs up to {isa.LEVELS[cpu_has]}")
    monkeypatch.setenv(isa.ENV, request.param)
    try:
        assert cpu_kernels.set_isa(None, check_cpu=level <= cpu_has) == request.param
        assert kernels.isa() == level and request.param in cpu_kernels.status()
        if level > cpu_has:  # oneDNN may refuse the call on a CPU with neither AMX nor AVX512-BF16
            try:
                kernels.gemm_bf16_check(torch.ones(2, 2).bfloat16(), torch.ones(2, 2).bfloat16(), False, False,
                                        1.0, 0.0, torch.zeros(2, 2))
            except RuntimeError as exc:
                pytest.skip(f"oneDNN's brgemm does not run on this CPU: {exc}")
        yield request.param
    finally:
        monkeypatch.delenv(isa.ENV)
        cpu_kernels.set_isa(None)


def _gemm_case(mod, m, n, k, ta, tb, alpha, beta, seed):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(*((k, m) if ta else (m, k)), generator=gen).bfloat16()
    B = torch.randn(*((n, k) if tb else (k, n)), generator=gen).bfloat16()
    C0 = torch.randn(m, n, generator=gen)
    opA, opB = (A.T if ta else A), (B.T if tb else B)
    exact = alpha * (opA.double() @ opB.double()) + beta * C0.double()
    fp32 = alpha * (opA.float() @ opB.float()) + beta * C0
    out = mod.gemm_bf16_check(A, B, ta, tb, alpha, beta, C0.clone())
    scale = exact.abs().max().item() or 1.0
    return (out.double() - exact).abs().max().item() / scale, (fp32.double() - exact).abs().max().item() / scale


def test_bf16_gemm_on_every_path(path, kernels):
    """The bf16 GEMM equals the fp32 matmul of the bf16 values (vs float64: 1e-5 relative and
    within 4× the fp32 matmul's own error), every transposition, odd and tiny sizes, alpha/beta
    (incl. the in-place alpha = 1, beta ∈ {0, 1} the AMX path writes directly)."""
    shapes = [(64, 128, 128), (64, 60, 60), (1, 1, 1), (3, 17, 33), (17, 31, 7), (128, 64, 64), (5, 9, 2)]
    for i, ((m, n, k), (ta, tb)) in enumerate(itertools.product(shapes, itertools.product([False, True], repeat=2))):
        alpha, beta = [(1.0, 0.0), (1.0, 1.0), (-0.5, 1.0), (2.0, 0.25)][i % 4]
        err, err32 = _gemm_case(kernels, m, n, k, ta, tb, alpha, beta, seed=i)
        where = f"{path}: m={m} n={n} k={k} ta={ta} tb={tb} alpha={alpha} beta={beta}"
        assert err <= 1e-5 and err <= 4 * err32 + 1e-7, f"{where}: {err:.2e} vs fp32 matmul {err32:.2e}"


def _grads(rule, x, **kwargs):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, h = call(rule.forms[2], rule, leaves, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(5)
    (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum().add((h * h).sum()).backward()
    return [o, h] + [leaves[n].grad for n in sorted(leaves)]


def _recurrent(rule, x, cu_seqlens=None):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    o, h = call(rule.reference, rule, leaves, output_final_state=True, **extra)
    gen = torch.Generator().manual_seed(5)
    (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum().add((h * h).sum()).backward()
    return [o, h] + [leaves[n].grad for n in sorted(leaves)]


def _names(x):
    return ["o", "h_T"] + ["d" + n for n in sorted(x)]


@pytest.mark.parametrize("rule_name", ["delta", "gated_delta"])
def test_float64_forward_and_gradients_on_every_path(path, kernels, rule_name, one_thread):
    """fp64: the kernel's forward and every gradient within 1e-12 of the recurrence (T = 1, 63,
    100; K ≠ V, K = 60; with and without an initial state)."""
    rule = RULES[rule_name]
    for T, K, V, C, h0 in [(1, 16, 24, 32, True), (63, 60, 33, 64, False), (100, 16, 24, 32, True)]:
        x = make_inputs(rule, 2, T, 2, K, V, initial_state=h0, seed=T)
        for name, a, b in zip(_names(x), _grads(rule, x, chunk_size=C), _recurrent(rule, x)):
            assert rel_err(a, b) < 1e-12, f"{path} T={T} K={K} V={V} {name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("rule_name", ["delta", "gated_delta"])
def test_fp32_within_2x_of_the_fp32_recurrence_on_every_path(path, kernels, rule_name, one_thread):
    """fp32: error against the float64 recurrence at most 2× (gradients 3×) the fp32 recurrence's."""
    rule = RULES[rule_name]
    x64 = make_inputs(rule, 2, 100, 2, 60, 33, initial_state=True, seed=3)
    x32 = {n: t.float() for n, t in x64.items()}
    exact, fast, rec = _recurrent(rule, x64), _grads(rule, x32), _recurrent(rule, x32)
    for i, (name, f, r, e) in enumerate(zip(_names(x64), fast, rec, exact)):
        factor = 2.0 if i < 2 else 3.0
        e_fast, e_rec = rel_err(f, e), rel_err(r, e)
        assert e_fast <= factor * max(e_rec, 1e-7), f"{path} {name}: kernel {e_fast:.2e} > {factor} x recurrent {e_rec:.2e}"


@pytest.mark.parametrize("rule_name", ["delta", "gated_delta"])
def test_packed_sequences_with_length_one_segments_on_every_path(path, kernels, rule_name, one_thread):
    """Uneven cu_seqlens with length-1 segments (first inside, one last; an empty segment is refused
    by the ops' checks), an initial state each: fp64, forward and every gradient, within 1e-12
    of the recurrence."""
    rule = RULES[rule_name]
    lengths = [5, 1, 70, 33, 1]
    x = make_inputs(rule, 1, sum(lengths), 3, 20, 12, initial_state=False, seed=8)
    x["initial_state"] = torch.randn(len(lengths), 3, 20, 12, dtype=torch.float64)
    cu = torch.tensor([0] + lengths).cumsum(0)
    got, want = _grads(rule, x, cu_seqlens=cu, chunk_size=32), _recurrent(rule, x, cu_seqlens=cu)
    for name, a, b in zip(_names(x), got, want):
        assert rel_err(a, b) < 1e-12, f"{path} {name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("rule_name", ["delta", "gated_delta"])
def test_bf16_products_within_2x_of_the_recurrence_on_every_path(path, kernels, bf16_kernels, rule_name, one_thread):
    """bf16 inputs under ``bf16_products()``: output and fp32 final state within 2× of the
    bf16-products recurrence's error against float64 (T = 63 and 100, K = 60 ≠ V, h0); the bf16
    kernel also on a path with no bf16 unit (``bf16_kernels``)."""
    from fastweights import ops

    rule = RULES[rule_name]
    for T, K, V in [(63, 60, 33), (100, 64, 48)]:
        x = make_inputs(rule, 2, T, 2, K, V, initial_state=True, seed=12 + T)
        low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v") else t.float()) for n, t in x.items()}
        o_ref, h_ref = call(rule.reference, rule, {n: t.double() for n, t in low.items()}, output_final_state=True)
        with torch.no_grad(), ops.bf16_products():
            o_rec, h_rec = call(rule.reference, rule, low, output_final_state=True)
            o, h = call(rule.forms[2], rule, low, output_final_state=True, chunk_size=32)
        assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
        for name, fast, rec, ref in (("o", o, o_rec, o_ref), ("h_T", h, h_rec, h_ref)):
            e_fast, e_rec = rel_err(fast, ref), rel_err(rec, ref)
            assert e_fast <= 2 * e_rec, f"{path} T={T} {name}: kernel {e_fast:.2e} > 2 x recurrent {e_rec:.2e}"


@pytest.mark.parametrize("low", [False, True], ids=["fp32", "bf16_products"])
def test_deterministic_and_batch_invariant_on_every_path(path, kernels, bf16_kernels, low, one_thread):
    """One sequence alone, in a batch of 8 and packed among others: bitwise the same output and
    state, and the same again on a second run."""
    from fastweights import ops

    rule = RULES["gated_delta"]
    x = make_inputs(rule, 8, 70, 2, 32, 24, initial_state=True, seed=4)
    x = {n: (t.to(torch.bfloat16) if low and n in ("q", "k", "v") else t.float()) for n, t in x.items()}
    with ops.bf16_products() if low else torch.no_grad():
        _assert_alone_batched_packed_equal(rule, x)


def _assert_alone_batched_packed_equal(rule, x, length=70):
    """``x``: 8 sequences of ``length``. Sequence 3 alone, in the batch and packed among the others
    (cu_seqlens) gives bitwise the same output and final state, and the batch the same on a rerun."""
    with torch.no_grad():
        batch_o, batch_h = call(rule.forms[2], rule, x, output_final_state=True)
        again_o, again_h = call(rule.forms[2], rule, x, output_final_state=True)
        alone_o, alone_h = call(rule.forms[2], rule, {n: t[3:4] for n, t in x.items()}, output_final_state=True)
        packed = {n: (t.reshape(1, -1, *t.shape[2:]) if n != "initial_state" else t) for n, t in x.items()}
        cu = torch.arange(0, 8 * length + 1, length)
        packed_o, packed_h = call(rule.forms[2], rule, packed, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(batch_o, again_o) and torch.equal(batch_h, again_h)
    assert torch.equal(alone_o[0], batch_o[3]) and torch.equal(alone_h[0], batch_h[3])
    assert torch.equal(packed_o[0, 3 * length:4 * length], batch_o[3]) and torch.equal(packed_h[3], batch_h[3])


@pytest.mark.parametrize("op_name", ["chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda"])
def test_bf16_products_take_the_fp32_kernel_where_the_path_has_no_bf16_unit(path, kernels, monkeypatch, op_name,
                                                                           one_thread):
    """``bf16_products()`` is leave to use bf16 products: on a path with a bf16 unit (amx,
    avx512bf16) the ops call the bf16 kernel; on one without (avx2, portable), where a bf16 product
    is an fp32 product of rounded operands, slower and less accurate, they call the fp32 kernel on
    the bf16 rows: bitwise the same call without the mode. Inference, T 70, K 32 != V 24, h0."""
    from fastweights import ops

    kernel = "chunk_kda_fwd" if op_name == "chunk_kda" else "chunk_delta_fwd"
    seen = {name: record_calls(monkeypatch, kernels, name, lambda args: 1) for name in (kernel, kernel + "_bf16")}
    x = bf16_op_inputs(op_name)
    op = getattr(ops, op_name)
    with torch.no_grad():
        o, h = op(**x, output_final_state=True)
        with ops.bf16_products():
            o_mode, h_mode = op(**x, output_final_state=True)
    has_unit = isa.LEVELS.index(path) >= isa.LEVELS.index("avx512bf16")
    assert cpu_kernels.bf16_unit() == has_unit
    if has_unit:
        assert (len(seen[kernel]), len(seen[kernel + "_bf16"])) == (1, 1), f"{path}: {seen}"
        assert not torch.equal(o_mode, o)  # bf16 operands: another result
    else:
        assert (len(seen[kernel]), len(seen[kernel + "_bf16"])) == (2, 0), f"{path}: {seen}"
        assert torch.equal(o_mode, o) and torch.equal(h_mode, h), path


@pytest.mark.parametrize("rule_name", ["delta", "gated_delta"])
def test_plain_bf16_inputs_are_widened_in_the_kernel_on_every_path(path, kernels, rule_name, one_thread):
    """Plain bf16 q, k, v in inference reach the fp32 kernel as they are (no cast pass first) and
    are widened in its gather: bitwise the fp32 kernel on the widened inputs (output rounded to
    bf16 the way ``.to(torch.bfloat16)`` does, the same fp32 state) — so exactly the fp32 path's
    accuracy, which the tests above hold to the rule — and the bf16 output within 2× of the
    recurrence's error on the same inputs. T = 1, 63, 100; K = 60 ≠ V; packed; with h0."""
    rule = RULES[rule_name]
    for T, K, V, packed in [(1, 16, 24, False), (63, 60, 33, False), (100, 32, 40, True)]:
        x = make_inputs(rule, 1 if packed else 2, T, 2, K, V, initial_state=not packed, seed=T)
        low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v") else t.float()) for n, t in x.items()}
        wide = {n: t.float() for n, t in low.items()}
        extra = {"cu_seqlens": torch.tensor([0, 1, 40, T])} if packed else {}
        with torch.no_grad():
            o, h = call(rule.forms[2], rule, low, output_final_state=True, **extra)
            o32, h32 = call(rule.forms[2], rule, wide, output_final_state=True, **extra)
            o_rec, h_rec = call(rule.reference, rule, low, output_final_state=True, **extra)
        o_ref, h_ref = call(rule.reference, rule, {n: t.double() for n, t in low.items()}, output_final_state=True,
                            **extra)
        assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
        assert torch.equal(o, o32.to(torch.bfloat16)) and torch.equal(h, h32), f"{path} T={T}"
        e_fast, e_rec = rel_err(o, o_ref), rel_err(o_rec, o_ref)
        assert e_fast <= 2 * e_rec, f"{path} T={T} o: {e_fast:.2e} > 2 x recurrent {e_rec:.2e}"
        assert rel_err(h, h_ref) < 1e-5 and rel_err(h_rec, h_ref) < 1e-5  # fp32-level state: no bf16 rounding in it


@pytest.mark.parametrize("rule_name", ["linear_decay", "linear_elu_normalized"])
def test_linear_attn_float64_on_every_path(path, kernels, rule_name, one_thread):
    """Linear attention's kernel (a decay; elu features with the normalizer column): fp64, the
    training forward with every gradient and the no-grad forward (rows read in place) within 1e-12
    of the recurrence. T = 1, 63, 100; K ≠ V, K = 60, K = V = 128 (whole tiles of the key
    transpose); an initial state."""
    rule = RULES[rule_name]
    for T, K, V, C, h0 in [(1, 16, 24, 32, True), (63, 60, 33, 64, False), (100, 128, 128, 32, True)]:
        x = make_inputs(rule, 2, T, 2, K, V, initial_state=h0, seed=T)
        want = _recurrent(rule, x)
        for name, a, b in zip(_names(x), _grads(rule, x, chunk_size=C), want):
            assert rel_err(a, b) < 1e-12, f"{path} T={T} K={K} V={V} {name}: {rel_err(a, b):.2e}"
        with torch.no_grad():
            inferred = call(rule.forms[2], rule, x, output_final_state=True, chunk_size=C)
        for name, a, b in zip(["o", "h_T"], inferred, want):
            assert rel_err(a, b) < 1e-12, f"{path} T={T} K={K} V={V} no grad {name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("rule_name", ["linear_decay", "linear_elu_normalized"])
def test_linear_attn_fp32_within_2x_of_the_fp32_recurrence_on_every_path(path, kernels, rule_name, one_thread):
    """fp32, K = V = 128, T = 100 with C 64 (a partial last chunk): the no-grad forward and the
    training forward and gradients within 2× (gradients 3×) of the fp32 recurrence's error against
    float64."""
    rule = RULES[rule_name]
    x64 = make_inputs(rule, 2, 100, 2, 128, 128, initial_state=True, seed=3)
    x32 = {n: t.float() for n, t in x64.items()}
    exact, fast, rec = _recurrent(rule, x64), _grads(rule, x32), _recurrent(rule, x32)
    with torch.no_grad():
        inferred = call(rule.forms[2], rule, x32, output_final_state=True)
    for i, (name, f, r, e) in enumerate(zip(_names(x64), fast, rec, exact)):
        factor = 2.0 if i < 2 else 3.0
        e_fast, e_rec = rel_err(f, e), rel_err(r, e)
        assert e_fast <= factor * max(e_rec, 1e-7), f"{path} {name}: kernel {e_fast:.2e} > {factor} x recurrent {e_rec:.2e}"
        if i < 2:
            e_inf = rel_err(inferred[i], e)
            assert e_inf <= 2.0 * max(e_rec, 1e-7), f"{path} no grad {name}: {e_inf:.2e} > 2 x recurrent {e_rec:.2e}"


def test_linear_attn_deterministic_and_batch_invariant_on_every_path(path, kernels, one_thread):
    """Linear attention with a decay, fp32, no grad: one sequence alone, in a batch of 8 and packed
    among others gives bitwise the same output and state, and the same again on a second run."""
    rule = RULES["linear_decay"]
    x = {n: t.float() for n, t in make_inputs(rule, 8, 70, 2, 32, 24, initial_state=True, seed=4).items()}
    _assert_alone_batched_packed_equal(rule, x)


def test_plain_bf16_inputs_without_the_kernels_and_with_grad(kernels, one_thread):
    """The same call with the kernels off (the PyTorch path widens the inputs itself), and with a
    backward to follow (the training path: widened by the front end), agrees with the kernel."""
    rule = RULES["gated_delta"]
    x = make_inputs(rule, 2, 70, 2, 32, 24, initial_state=True, seed=6)
    low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v") else t.float()) for n, t in x.items()}
    with torch.no_grad():
        o, h = call(rule.forms[2], rule, low, output_final_state=True)
        cpu_kernels.set_enabled(False)
        try:
            o_off, h_off = call(rule.forms[2], rule, low, output_final_state=True)
        finally:
            cpu_kernels.set_enabled(None)
    assert o_off.dtype == torch.bfloat16 and rel_err(h_off, h) < 1e-5 and rel_err(o_off, o) < 1e-2
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in low.items()}
    o_g, h_g = call(rule.forms[2], rule, leaves, output_final_state=True)
    (o_g.float().sum() + h_g.sum()).backward()
    assert leaves["q"].grad.dtype == torch.bfloat16 and torch.isfinite(leaves["q"].grad.float()).all()
    assert rel_err(h_g, h) < 1e-5 and rel_err(o_g, o) < 1e-2


def test_the_variable_is_read_when_the_kernels_load(kernels, monkeypatch):
    """A fresh process with FASTWEIGHTS_CPU_ISA=portable takes the portable path from its first
    call and says so; in a running process a misspelt value is a ValueError naming the variable."""
    import subprocess
    import sys

    code = ("from fastweights.ops import cpu; print(cpu.isa()); print(cpu.status()); "
            "print(cpu.kernel_report()['chunk_delta_fwd_bf16 (bf16 products)'])")
    env = dict(os.environ, **{isa.ENV: "portable"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "portable" and "forced by FASTWEIGHTS_CPU_ISA=portable" in lines[1]
    assert "portable" in lines[2]
    monkeypatch.setenv(isa.ENV, "sse9")
    try:
        with pytest.raises(ValueError, match="FASTWEIGHTS_CPU_ISA must be one of"):
            cpu_kernels.set_isa(None)
    finally:
        monkeypatch.delenv(isa.ENV)
        cpu_kernels.set_isa(None)


def test_exponentials_on_every_path(path, kernels):
    """The KDA kernels' e^x of float64 exponents (chunk_rows.h's exp_of: a polynomial in vector
    lanes above the portable level, the C library's exp on it), against float64's e^x: within
    2 ulp of float32 wherever e^x is a normal float, at most the smallest normal below (0 or a
    subnormal), +Inf past float's range; lengths that leave lanes to the scalar tail."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-87.3, 88.7228, 20011, dtype=torch.float64),
                   (torch.rand(4099, generator=gen, dtype=torch.float64) - 0.5) * 180,
                   torch.tensor([0.0, -0.0, 1e-300, -1e-300, 88.37, 88.72, 88.73, 89.0, 100.0, 200.0, -87.31,
                                 -100.0, -200.0], dtype=torch.float64)])
    for n in (x.numel(), 13, 7, 2):
        xs = x[-n:]
        out = kernels.exp_check(xs)
        assert out.dtype == torch.float32 and out.shape == xs.shape
        exact = xs.exp()
        normal = (exact >= torch.finfo(torch.float32).tiny) & (exact <= torch.finfo(torch.float32).max)
        rel = ((out.double() - exact).abs() / exact)[normal]
        assert rel.numel() == 0 or rel.max().item() <= 2.4e-7, f"{path}: {rel.max().item():.2e} at x = {xs[normal][rel.argmax()].item()}"
        assert (out[exact < torch.finfo(torch.float32).tiny] <= torch.finfo(torch.float32).tiny).all(), path
        assert torch.isposinf(out[exact > torch.finfo(torch.float32).max]).all(), path
    with pytest.raises(RuntimeError, match="`x` must be float64"):
        kernels.exp_check(torch.zeros(3))


def test_bf16_rounding_on_every_path(path, kernels):
    """fp32 -> bf16 as the kernels write a bf16 output (gemm_bf16.h's to_bf16: 16 lanes with AVX-512,
    8 with AVX2, the scalar loop on the portable path and in the tails) is torch's conversion bit
    for bit: random bit patterns (ties both ways, subnormals, overflow to inf, signed zeros) and
    lengths that leave lanes to the tail; NaN stays NaN."""
    from plain_bf16_checks import rounding_cases

    x, special = rounding_cases(torch.Generator().manual_seed(1), 20_011)
    for t in (x, special, x[:7], x[:9], x[:17]):
        assert torch.equal(kernels.to_bf16_check(t).view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), path
    nan = kernels.to_bf16_check(torch.tensor([1.0, float("nan")] * 8 + [float("nan")]))
    assert torch.isnan(nan[1::2]).all() and (nan[0:16:2] == 1.0).all(), path
