"""The finite check of q, k, v made inside the compiled chunk kernels.

The delta-rule and linear-attention chunk ops leave the NaN/Inf check of q, k and v to their CPU solver
(``OpSpec.fused_finite_check``): the compiled kernel counts the bad entries while it copies the
rows it reads anyway, and raises the same ValueError the front end's check raises. Every path
that can take the check is tried here against the PyTorch path's message: fp32 and fp64 with and
without a backward to come, plain bf16 inputs, bf16 products, packed sequences, T not a multiple
of the chunk, and the switch that turns the check off.
"""

import re

import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.ops import cpu as cpu_kernels

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the compiled CPU kernels are not built here")


def inputs(T=50, H=2, K=12, V=10, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(1, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, H, V, generator=g, dtype=torch.float64)
    beta = torch.rand(1, T, H, generator=g, dtype=torch.float64)
    gate = -torch.rand(1, T, H, generator=g, dtype=torch.float64)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return ([t.to(dtype) for t in (q, k, v)], beta.to(state_dtype), gate.to(state_dtype))


def spoil(t, where, value):
    t = t.clone()
    for idx in where:
        t[idx] = value
    return t


def call(gated, q, k, v, beta, g, backend, **kw):
    if gated == "linear":
        return ops.chunk_linear_attn(q, k, v, g=g, chunk_size=16, backend=backend, **kw)
    if gated:
        return ops.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, backend=backend, **kw)
    return ops.chunk_delta_rule(q, k, v, beta, chunk_size=16, backend=backend, **kw)


def message(gated, args, backend, **kw):
    with pytest.raises(ValueError) as info:
        call(gated, *args, backend=backend, **kw)
    return str(info.value)


BAD = {  # (which input, entries, value) -> how many entries are bad
    "q-nan": (0, [(0, 3, 1, 5), (0, 49, 0, 0)], float("nan")),
    "k-inf": (1, [(0, 17, 1, 2)], float("inf")),
    "v-neg-inf": (2, [(0, 0, 0, 0), (0, 31, 1, 9), (0, 32, 1, 9)], float("-inf")),
}


@needs_kernels
@pytest.mark.parametrize("gated", [False, True, "linear"], ids=["delta", "gated", "linear"])
@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("dtype,grad", [(torch.float32, False), (torch.float32, True), (torch.float64, False),
                                        (torch.float64, True), (torch.bfloat16, False)],
                         ids=["fp32", "fp32-grad", "fp64", "fp64-grad", "bf16"])
def test_the_kernel_raises_the_front_ends_error(gated, case, dtype, grad):
    (q, k, v), beta, g = inputs(dtype=dtype)
    which, where, value = BAD[case]
    args = [q, k, v]
    args[which] = spoil(args[which], where, value)
    if grad:
        args = [t.requires_grad_() for t in args]
    name = "qkv"[which]
    want = message(gated, (*args, beta, g), "torch")
    got = message(gated, (*args, beta, g), "cpu")
    assert re.search(rf"`{name}` contains {len(where)} non-finite value\(s\)", want)
    assert got == want


@needs_kernels
@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
def test_bf16_products_and_packed_sequences(gated):
    """bf16 inputs under bf16_products, three packed sequences (one of length 1)."""
    (q, k, v), beta, g = inputs(dtype=torch.bfloat16, T=61)
    v = spoil(v, [(0, 60, 0, 1), (0, 7, 1, 0)], float("nan"))
    cu = torch.tensor([0, 1, 20, 61])
    with ops.bf16_products():
        want = message(gated, (q, k, v, beta, g), "torch", cu_seqlens=cu)
        got = message(gated, (q, k, v, beta, g), "cpu", cu_seqlens=cu)
    assert "`v` contains 2 non-finite value(s)" in want and got == want


@needs_kernels
def test_a_huge_finite_input_is_not_refused_under_bf16_products():
    """fp32 q rounded to bf16 for the products can overflow to Inf; the check is of what was given."""
    (q, k, v), beta, g = inputs(dtype=torch.float32)
    q = spoil(q, [(0, 4, 0, 0)], 3.4e38)  # finite in fp32, Inf once rounded to bf16
    assert torch.isfinite(q).all() and not torch.isfinite(q.bfloat16()).all()
    with ops.bf16_products(), torch.no_grad():
        call(True, q, k, v, beta, g, "cpu")  # no error


@needs_kernels
@pytest.mark.parametrize("gated", [True, "linear"], ids=["gated", "linear"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_switched_off_the_nan_goes_through(backend, gated):
    (q, k, v), beta, g = inputs()
    k = spoil(k, [(0, 20, 0, 3)], float("nan"))
    with ops.finite_checks(False):
        o, h = call(gated, q, k, v, beta, g, backend, output_final_state=True)
    assert torch.isnan(o[0, 20:]).any() and torch.isnan(h).any()
    assert torch.isfinite(o[0, :16]).all()  # the chunks before its chunk are untouched


@needs_kernels
@pytest.mark.parametrize("gated", [True, "linear"], ids=["gated", "linear"])
def test_clean_inputs_give_the_same_output_with_the_check_in_the_kernel(gated):
    """The fused check changes no result: the same call with the check on and off is bitwise equal."""
    (q, k, v), beta, g = inputs()
    o_on, h_on = call(gated, q, k, v, beta, g, "cpu", output_final_state=True)
    with ops.finite_checks(False):
        o_off, h_off = call(gated, q, k, v, beta, g, "cpu", output_final_state=True)
    assert torch.equal(o_on, o_off) and torch.equal(h_on, h_off)


@needs_kernels
@pytest.mark.parametrize("gated", [True, "linear"], ids=["gated", "linear"])
@pytest.mark.parametrize("K,V", [(12, 10), (60, 20), (128, 33)])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_bad_entry_in_any_column_is_found_in_its_chunk(gated, K, V, grad):
    """The kernels check a chunk's rows in vector lanes and a scalar tail: one bad entry per chunk,
    in a different column of q (and of v) in each chunk, at a different row, the last chunk partial,
    is found and counted every time (a column the check skipped would lose its chunk's count)."""
    T = 16 * max(K, V) - 5
    (q, k, v), beta, g = inputs(T=T, H=1, K=K, V=V)
    bad = {"q": spoil(q, [(0, 16 * j + (j * 7) % min(16, T - 16 * j), 0, j) for j in range(K)], float("nan")),
           "v": spoil(v, [(0, 16 * j + (j * 5) % min(16, T - 16 * j), 0, j) for j in range(V)], float("inf"))}
    for name, width in (("q", K), ("v", V)):  # one input spoiled at a time: the error names the first bad one
        args = [bad["q"] if name == "q" else q, k, bad["v"] if name == "v" else v]
        if grad:
            args = [t.detach().clone().requires_grad_() for t in args]
        got = message(gated, (*args, beta, g), "cpu")
        assert got == message(gated, (*args, beta, g), "torch")
        assert f"`{name}` contains {width} non-finite value(s)" in got
