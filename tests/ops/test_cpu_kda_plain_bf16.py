"""KDA on plain bf16 inputs in inference (no grad, no ``bf16_products``): the compiled fp32 kernel
``chunk_kda.cpp`` reads the bf16 q, k, v rows itself, widening them as it gathers each chunk, and
rounds the output to bf16 once as it writes it (the front end no longer converts the inputs first).

The arithmetic must be the fp32 kernel's on the widened inputs, so every check here is bitwise
against the path it replaces (q, k, v cast to fp32 first, the fp32 output cast to bf16): awkward
shapes (T = 1, 63, 100; K ≠ V; K = 60; B > 1; with and without an initial state), strong decays
(chunks past e^{±60}, the sub-block products), packed sequences, every ISA path this machine runs,
``torch.compile(fullgraph=True)``, the PyTorch fallback (kernels off, backend ``"torch"``), and a
gradient following (the widened fp32 path). A fixture records the dtype of q each call of the
kernel receives, so a test that silently ran the old path fails. No speed is asserted.
"""

import pytest
import torch

import plain_bf16_checks as checks
from fastweights import ops
from helpers import record_calls
from test_cpu_isa import path  # noqa: F401  (the fixture: each ISA path this machine runs)
from test_cpu_kda_bf16 import _inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fwd_calls(kernels, monkeypatch):
    """The dtype of q at each call of the fp32 forward kernel (eager and compiled graphs both reach
    it on the extension by name)."""
    yield record_calls(monkeypatch, kernels, "chunk_kda_fwd", lambda args: args[0].dtype)
    torch._dynamo.reset()


def _run(x, **kwargs):
    return checks.run(ops.chunk_kda, x, **kwargs)


def _same_as_widened(x, fwd_calls, label, **kwargs):
    return checks.same_as_widened(ops.chunk_kda, x, fwd_calls, label, **kwargs)


@pytest.mark.parametrize("B,T,H,K,V,h0,decay", [
    (2, 1, 2, 32, 40, True, 0.3), (2, 63, 2, 32, 40, False, 0.3), (2, 100, 2, 60, 32, True, 0.3),
    (1, 300, 2, 16, 24, True, 0.1), (3, 100, 2, 64, 64, True, 3.0),
], ids=["T1", "T63-noh0", "T100-K60", "T300", "strong"])
def test_plain_bf16_is_bitwise_the_widened_path(fwd_calls, B, T, H, K, V, h0, decay):
    """decay 3.0 per token: the cumulative decay passes e^{60} inside the chunk (the sub-block
    products); the others take one product for S and P."""
    _same_as_widened(_inputs(B, T, H, K, V, decay, h0, seed=T), fwd_calls, f"B={B} T={T} K={K} V={V}",
                     chunk_size=64)


def test_mixed_chunks_and_the_default_chunk_size(fwd_calls):
    """Chunks past the limit between mild ones, one state carried through; the op's own chunk size."""
    x = _inputs(2, 250, 2, 32, 24, decay=0.5, seed=11)
    x["g"][:, 64:128] *= 80.0
    _same_as_widened(x, fwd_calls, "mixed")


def test_packed_sequences(fwd_calls):
    """Uneven cu_seqlens with length-1 segments, an initial state each."""
    lengths = [5, 70, 1, 33, 2]
    x = _inputs(1, sum(lengths), 3, 20, 12, initial_state=False, seed=8)
    x["initial_state"] = torch.randn(len(lengths), 3, 20, 12, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0] + lengths).cumsum(0)
    _same_as_widened(x, fwd_calls, "packed", cu_seqlens=cu, chunk_size=32)


def test_grouped_value_heads_and_the_gate_in_kernel(fwd_calls):
    """fla's options: 2 value heads per key head, the decay from the raw gate (A_log, dt_bias), β
    through a sigmoid, bf16 gate and β inputs (the front end computes them in fp32)."""
    gen = torch.Generator().manual_seed(9)
    B, T, H, HV, K, V = 2, 77, 2, 4, 32, 24
    x = dict(q=torch.randn(B, T, H, K, generator=gen).bfloat16(),
             k=torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).bfloat16(),
             v=torch.randn(B, T, HV, V, generator=gen).bfloat16(), g=torch.randn(B, T, HV, K, generator=gen).bfloat16(),
             beta=torch.randn(B, T, HV, generator=gen).bfloat16(), initial_state=torch.randn(B, HV, K, V, generator=gen))
    _same_as_widened(x, fwd_calls, "grouped", use_gate_in_kernel=True, A_log=0.1 * torch.randn(HV, generator=gen),
                     dt_bias=0.1 * torch.randn(HV * K, generator=gen), use_beta_sigmoid_in_kernel=True, chunk_size=32)


def test_under_autocast(fwd_calls):
    checks.check_autocast(ops.chunk_kda, _inputs(2, 70, 2, 16, 24, seed=5), fwd_calls)


def test_every_isa_path(path, fwd_calls):  # noqa: F811  (the imported fixture)
    x = _inputs(2, 150, 2, 60, 40, decay=0.4, seed=3)
    x["g"][:, 64:100] *= 40.0
    _same_as_widened(x, fwd_calls, path, chunk_size=64)


def test_deterministic_and_batch_invariant(fwd_calls):
    checks.check_deterministic_and_batch_invariant(ops.chunk_kda, _inputs(8, 130, 3, 32, 32, seed=2), fwd_calls)


def test_without_the_kernel_the_inputs_are_widened_in_python(kernels, fwd_calls):
    checks.check_without_the_kernel(ops.chunk_kda, _inputs(2, 70, 2, 16, 24, seed=5), fwd_calls)


def test_a_gradient_takes_the_widened_fp32_path(fwd_calls):
    """Through the decays or through q."""
    checks.check_a_gradient_takes_the_widened_path(ops.chunk_kda, _inputs(2, 100, 2, 32, 24, seed=4), fwd_calls)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_a_nan_in_a_bf16_input_is_the_ops_value_error(fwd_calls, name):
    checks.check_a_nan_is_the_ops_value_error(ops.chunk_kda, _inputs(1, 40, 2, 16, 16, seed=6), fwd_calls, name)


def test_a_positive_log_decay_is_the_ops_value_error(fwd_calls):
    x = _inputs(1, 40, 2, 16, 16, seed=6)
    bad = dict(x, g=x["g"].clone())
    bad["g"][0, 5, 0, 1] = 0.5
    with pytest.raises(ValueError, match="`g`"):
        _run(bad)
    assert fwd_calls == [torch.bfloat16]


def test_torch_compile_fullgraph_calls_the_kernel_bitwise(fwd_calls):
    x = _inputs(2, 37, 2, 8, 6, seed=7)

    def call(q, k, v, g, beta, initial_state):
        return ops.chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True, chunk_size=16)

    checks.check_torch_compile(call, x, fwd_calls, "chunk_kda_infer")


def test_the_kernel_refuses_bf16_where_it_does_not_apply(kernels):
    """bf16 q, k, v are for inference only (keep false), with fp32 beta, gk, h0 and no erase keys."""
    gen = torch.Generator().manual_seed(0)
    n, h, t, dk, dv = 1, 2, 9, 8, 4
    q, k, v = (torch.randn(n, h, t, d, generator=gen).bfloat16() for d in (dk, dk, dv))
    beta, gk = torch.rand(n, h, t, generator=gen), -torch.rand(n, h, t, dk, generator=gen)
    o, h_t, states, _ = kernels.chunk_kda_fwd(q, k, v, beta, gk, None, 0.5, 4, 2, False)
    assert o.dtype == torch.bfloat16 and h_t.dtype == torch.float32 and states.numel() == 0
    for args, kw in [((q, k, v, beta, gk, None, 0.5, 4, 2, True), {}),
                     ((q, k, v, beta.double(), gk.double(), None, 0.5, 4, 2, False), {}),
                     ((q, k.float(), v, beta, gk, None, 0.5, 4, 2, False), {}),
                     ((q, k, v, None, gk, None, 0.5, 4, 2, False), {"erase": k})]:
        with pytest.raises(RuntimeError, match="chunk_kda_fwd"):
            kernels.chunk_kda_fwd(*args, **kw)
