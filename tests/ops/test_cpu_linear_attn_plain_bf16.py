"""Linear attention on plain bf16 inputs in inference (no grad): the compiled fp32 kernel
``chunk_linear_attn.cpp`` reads the bf16 q, k, v rows itself, widening them as it gathers each
chunk, and rounds the output to bf16 once as it writes it (before, the front end cast q, k, v to
fp32 in separate passes, which made bf16 inputs about half as fast as fp32 ones).

The arithmetic must be the fp32 kernel's on the widened inputs, so the checks are bitwise against
the path it replaces (q, k, v cast to fp32 first, the fp32 output cast to bf16): T = 1, 63, 100,
K = 60 != V, B > 1, with and without decay and initial state, packed sequences, every ISA path
this machine runs, ``torch.compile(fullgraph=True)``, the PyTorch fallback, a gradient following,
and the options that keep the old path (the normalizer, a feature map). A fixture records the dtype
of q at each kernel call, so a test that silently ran the old path fails. No speed is asserted.
"""

import pytest
import torch

import plain_bf16_checks as checks
from fastweights import ops
from helpers import record_calls, rel_err
from test_cpu_isa import path  # noqa: F401  (the fixture: each ISA path this machine runs)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fwd_calls(kernels, monkeypatch):
    """The dtype of q at each call of the forward kernel."""
    yield record_calls(monkeypatch, kernels, "chunk_linear_attn_fwd", lambda args: args[0].dtype)
    torch._dynamo.reset()


def _inputs(B, T, H, K, V, decay=True, h0=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(B, T, H, K, generator=gen).bfloat16(),
             k=(torch.randn(B, T, H, K, generator=gen) / K ** 0.5).bfloat16(),
             v=torch.randn(B, T, H, V, generator=gen).bfloat16())
    if decay:
        x["g"] = -0.2 * torch.rand(B, T, H, generator=gen)
    if h0:
        x["initial_state"] = torch.randn(B, H, K, V, generator=gen)
    return x


def _run(x, **kwargs):
    return checks.run(ops.chunk_linear_attn, x, **kwargs)


def _widened(x, **kwargs):
    return checks.widened(ops.chunk_linear_attn, x, **kwargs)


def _same_as_widened(x, fwd_calls, label, **kwargs):
    return checks.same_as_widened(ops.chunk_linear_attn, x, fwd_calls, label, **kwargs)


@pytest.mark.parametrize("B,T,H,K,V,decay,h0,C", [
    (2, 1, 2, 32, 40, True, True, 64), (2, 63, 2, 32, 40, True, False, 64), (2, 100, 2, 60, 33, True, True, 32),
    (1, 130, 3, 128, 128, False, False, 64), (2, 77, 2, 16, 24, False, True, 16),
], ids=["T1", "T63-noh0", "T100-K60", "T130-K128-nodecay", "T77-C16"])
def test_plain_bf16_is_bitwise_the_widened_path(fwd_calls, B, T, H, K, V, decay, h0, C):
    _same_as_widened(_inputs(B, T, H, K, V, decay, h0, seed=T), fwd_calls, f"B={B} T={T} K={K} V={V}", chunk_size=C)


def test_within_twice_the_bf16_recurrence_error(fwd_calls):
    """Against float64 on the same bf16 inputs: the bf16 output is within 2x of the recurrent
    form's error computed in fp32 and rounded to bf16, and the fp32 state within 2x of its."""
    x = _inputs(2, 100, 2, 60, 33, seed=12)
    o, h = _run(x, chunk_size=32)
    x64 = {n: t.double() for n, t in x.items()}
    with torch.no_grad():
        o_ref, h_ref = ops.recurrent_linear_attn(**x64, output_final_state=True)
        o_rec, h_rec = ops.recurrent_linear_attn(**{n: t.float() for n, t in x.items()}, output_final_state=True)
    o_rec = o_rec.to(torch.bfloat16)
    assert rel_err(o, o_ref) <= 2 * rel_err(o_rec, o_ref), (rel_err(o, o_ref), rel_err(o_rec, o_ref))
    assert rel_err(h, h_ref) <= 2 * max(rel_err(h_rec, h_ref), 1e-7)


def test_packed_sequences(fwd_calls):
    """Uneven cu_seqlens with length-1 segments, an initial state each."""
    lengths = [5, 70, 1, 33, 2]
    x = _inputs(1, sum(lengths), 3, 20, 12, h0=False, seed=8)
    x["initial_state"] = torch.randn(len(lengths), 3, 20, 12, generator=torch.Generator().manual_seed(1))
    _same_as_widened(x, fwd_calls, "packed", cu_seqlens=torch.tensor([0] + lengths).cumsum(0), chunk_size=32)


def test_every_isa_path(path, fwd_calls):  # noqa: F811  (the imported fixture)
    """Strong decays too: chunks whose cumulative decay leaves [-40, 40] take the kernel's plain form."""
    x = _inputs(2, 150, 2, 60, 40, seed=3)
    x["g"][:, 64:100] *= 60.0
    _same_as_widened(x, fwd_calls, path, chunk_size=64)


def test_under_autocast(fwd_calls):
    checks.check_autocast(ops.chunk_linear_attn, _inputs(2, 70, 2, 16, 24, seed=5), fwd_calls)


def test_deterministic_and_batch_invariant(fwd_calls):
    checks.check_deterministic_and_batch_invariant(ops.chunk_linear_attn, _inputs(8, 130, 3, 32, 32, seed=2), fwd_calls)


def test_without_the_kernel_the_inputs_are_widened_in_python(kernels, fwd_calls):
    checks.check_without_the_kernel(ops.chunk_linear_attn, _inputs(2, 70, 2, 16, 24, seed=5), fwd_calls)


def test_a_gradient_takes_the_widened_fp32_path(fwd_calls):
    """Through the decay or through q."""
    checks.check_a_gradient_takes_the_widened_path(ops.chunk_linear_attn, _inputs(2, 100, 2, 32, 24, seed=4), fwd_calls)


@pytest.mark.parametrize("options", [{"normalize": True}, {"feature_map": "elu"}], ids=["normalize", "elu"])
def test_options_that_need_fp32_rows_keep_the_widened_path(fwd_calls, options):
    """The normalizer column and a feature map are computed on fp32 rows in the front end: the
    kernel gets fp32, and the result is the widened path's."""
    x = _inputs(2, 50, 2, 16, 24, h0=False, seed=9)
    plain = _run(x, **options)
    assert fwd_calls == [torch.float32]
    old = _widened(x, **options)
    assert all(torch.equal(a, b) for a, b in zip(plain, old))


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_a_nan_in_a_bf16_input_is_the_ops_value_error(fwd_calls, name):
    checks.check_a_nan_is_the_ops_value_error(ops.chunk_linear_attn, _inputs(1, 40, 2, 16, 16, seed=6), fwd_calls, name)


def test_torch_compile_fullgraph_calls_the_kernel_bitwise(fwd_calls):
    x = _inputs(2, 37, 2, 8, 6, seed=7)

    def call(q, k, v, g, initial_state):
        return ops.chunk_linear_attn(q, k, v, g, initial_state=initial_state, output_final_state=True, chunk_size=16)

    checks.check_torch_compile(call, x, fwd_calls, "chunk_linear_attn_infer")


def test_the_kernel_refuses_bf16_where_it_does_not_apply(kernels):
    """bf16 q, k, v are for inference only (keep false), with fp32 g and h0."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, d, generator=gen).bfloat16() for d in (8, 8, 4))
    g = -torch.rand(1, 2, 9, generator=gen)
    o, h_t, *_ = kernels.chunk_linear_attn_fwd(q, k, v, g, None, 0.5, 4, False)
    assert o.dtype == torch.bfloat16 and h_t.dtype == torch.float32
    for args in [(q, k, v, g, None, 0.5, 4, True), (q, k, v, g.double(), None, 0.5, 4, False),
                 (q, k, v, g, torch.zeros(2, 8, 4, dtype=torch.float64), 0.5, 4, False)]:
        with pytest.raises(RuntimeError, match="chunk_linear_attn_fwd"):
            kernels.chunk_linear_attn_fwd(*args)
