"""``fastweights/ops/cpu/gemm_bf16.h``: the bf16-operand, fp32-accumulating small-tile GEMM.

A bf16 × bf16 product is exact in fp32, so the kernel must equal the fp32 matmul of the
bf16 values up to the order of the fp32 additions: both are compared with the float64
product of the same bf16 values, on awkward shapes (odd m, n, k; 1; padded rows), all four
transposition pairs and alpha/beta. ``to_bf16`` must be bit for bit torch's conversion.
The speed table (bf16 kernel vs MKL ``sgemm_``) is the slow test at the end: printed, never asserted.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fastweights.ops import cpu


@pytest.fixture(scope="module")
def mod():
    m = cpu.build()
    if m is None:
        pytest.skip("the compiled CPU kernels could not be built here")
    return m


def _cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


def _matrix(rows, cols, pad, gen):
    """A bf16 [rows, cols] view with row stride cols + pad (pad > 0: lda > width)."""
    full = torch.randn(rows, cols + pad, generator=gen).bfloat16()
    return full[:, :cols]


def _case(mod, m, n, k, ta, tb, alpha, beta, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    A = _matrix(*((k, m) if ta else (m, k)), pad, gen)
    B = _matrix(*((n, k) if tb else (k, n)), pad, gen)
    C0 = torch.randn(m, n + pad, generator=gen)[:, :n]
    opA, opB = (A.T if ta else A), (B.T if tb else B)
    exact = alpha * (opA.double() @ opB.double()) + beta * C0.double()
    fp32 = alpha * (opA.float() @ opB.float()) + beta * C0
    C = C0.clone() if pad == 0 else torch.randn(m, n + pad, generator=gen)[:, :n].copy_(C0)
    out = mod.gemm_bf16_check(A, B, ta, tb, alpha, beta, C)
    assert out.data_ptr() == C.data_ptr()  # in place
    scale = exact.abs().max().item() or 1.0
    return (out.double() - exact).abs().max().item() / scale, (fp32.double() - exact).abs().max().item() / scale


SIZES = (1, 3, 17, 33, 64, 100, 128)


@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
def test_matches_the_fp32_matmul_of_the_bf16_values(mod, ta, tb):
    """Random (m, n, k) from the awkward sizes, alpha/beta, padded rows: error vs the float64
    product at most 1e-5 relative and within a few times the fp32 matmul's own."""
    gen = torch.Generator().manual_seed(int(ta) * 2 + int(tb))
    shapes = [(64, 128, 128), (128, 64, 33), (1, 1, 1), (3, 17, 100)]
    shapes += [tuple(SIZES[int(i)] for i in torch.randint(len(SIZES), (3,), generator=gen)) for _ in range(10)]
    for i, (m, n, k) in enumerate(shapes):
        alpha, beta = [(1.0, 0.0), (-0.5, 1.0), (2.0, 0.25)][i % 3]
        pad = [0, 3, 16][i % 3]
        err, err32 = _case(mod, m, n, k, ta, tb, alpha, beta, pad, seed=100 * i + 7)
        assert err <= 1e-5, f"m={m} n={n} k={k} alpha={alpha} beta={beta} pad={pad}: {err:.2e}"
        assert err <= 4 * err32 + 1e-7, f"m={m} n={n} k={k}: {err:.2e} vs fp32 matmul {err32:.2e}"


def test_every_edge_tile(mod):
    """Every m in 1..17 and n in 1..33 around the 8 × 32 micro-tile, k odd and even."""
    for m, n, k in itertools.product(range(1, 18), (1, 15, 16, 17, 31, 32, 33), (1, 2, 7)):
        err, _ = _case(mod, m, n, k, m % 2 == 0, n % 2 == 1, 1.5, 0.5, 0, seed=m * 100 + n)
        assert err <= 1e-5, f"m={m} n={n} k={k}: {err:.2e}"


def test_beta_zero_does_not_read_c_and_k_zero_scales_it(mod):
    gen = torch.Generator().manual_seed(3)
    A, B = torch.randn(5, 9, generator=gen).bfloat16(), torch.randn(9, 6, generator=gen).bfloat16()
    C = torch.full((5, 6), float("nan"))
    out = mod.gemm_bf16_check(A, B, False, False, 1.0, 0.0, C)
    torch.testing.assert_close(out, A.float() @ B.float(), rtol=1e-6, atol=1e-6)
    C = torch.randn(5, 6, generator=gen)
    expected = 0.5 * C
    out = mod.gemm_bf16_check(torch.empty(5, 0, dtype=torch.bfloat16), torch.empty(0, 6, dtype=torch.bfloat16),
                              False, False, 1.0, 0.5, C)
    assert torch.equal(out, expected)


def test_shape_errors(mod):
    A, B, C = torch.zeros(4, 5, dtype=torch.bfloat16), torch.zeros(6, 3, dtype=torch.bfloat16), torch.zeros(4, 3)
    with pytest.raises(RuntimeError, match="op\\(A\\) is 4×5 but op\\(B\\) is 6×3"):
        mod.gemm_bf16_check(A, B, False, False, 1.0, 0.0, C)
    with pytest.raises(RuntimeError, match="`A` must be BFloat16"):
        mod.gemm_bf16_check(A.float(), B, False, False, 1.0, 0.0, C)


def test_to_bf16_is_torchs_conversion_bit_for_bit(mod):
    from plain_bf16_checks import rounding_cases

    gen = torch.Generator().manual_seed(0)
    # every rounding case: ties to even both ways, denormals, overflow to inf, signed zeros
    x, special = rounding_cases(gen, 100_003)
    for t in (x, special, torch.randn(37, generator=gen), torch.randn(1, generator=gen)):
        assert torch.equal(mod.to_bf16_check(t).view(torch.int16), t.to(torch.bfloat16).view(torch.int16))
    nan = mod.to_bf16_check(torch.tensor([float("nan"), 1.0]))
    assert torch.isnan(nan[0]) and nan[1] == 1.0


def test_build_reports_the_bf16_kernel_the_cpu_has(mod):
    """The build compiles the vdpbf16ps kernel exactly where the CPU has AVX512-BF16 (it uses
    -march=native), and the benchmark entry point runs and says which one it timed. No speed is
    asserted: which kernel is faster depends on the CPU (speed is ``fastweights bench`` and the
    slow table below)."""
    assert mod.has_fast_bf16 == _cpu_has_avx512_bf16()
    bf16, sgemm, level = mod.gemm_bf16_bench(16, 16, 16, 2, rounds=1)
    assert math.isfinite(bf16) and math.isfinite(sgemm) and bf16 > 0 and sgemm > 0
    assert int(level) == mod.isa()


SPEED_SHAPES = [  # (m, n, k, ta, tb): the chunk forward's tiles
    (64, 128, 128, False, False), (64, 64, 128, False, True), (64, 64, 128, False, False),
    (128, 128, 64, True, False), (32, 32, 32, False, False), (64, 128, 64, False, False),
]


@pytest.mark.slow
def test_speed_table(mod, capsys):
    """GFLOP/s, one thread, best of 5 × 5 rounds, bf16 kernel (packing included) vs sgemm_
    on the same shape, printed: a table, not a pass/fail (the ratio is about 4.5× on an AMD EPYC
    with AVX512-BF16 and 0.55× on an Intel Xeon whose sgemm_ is twice as fast)."""
    if mod.isa() < 2:
        pytest.skip(f"the ISA path here is {cpu.isa()}: bf16 operands are widened and run at the fp32 rate")
    rows = []
    for m, n, k, ta, tb in SPEED_SHAPES:
        runs = [mod.gemm_bf16_bench(m, n, k, 200, ta, tb, 5) for _ in range(5)]
        bf16, sgemm = max(r[0] for r in runs), max(r[1] for r in runs)
        rows.append((m, n, k, ta, tb, bf16, sgemm))
    with capsys.disabled():
        for m, n, k, ta, tb, bf16, sgemm in rows:
            print(f"\n{m}x{n}x{k} ta={ta} tb={tb}: bf16 {bf16:.0f} GFLOP/s, sgemm {sgemm:.0f}, ratio {bf16 / sgemm:.2f}")
    assert all(math.isfinite(r[5]) and r[5] > 0 for r in rows)
