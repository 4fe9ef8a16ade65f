"""KDA with bf16 products (``fastweights.ops.bf16_products``): the compiled CPU kernel
``chunk_kda_bf16.cpp`` against the float64 recurrence, judged by the recurrence's own error
under the same mode (``kda_low_products_step``: bf16 product operands, fp32 state).

On the same bf16 inputs, against the float64 recurrence, the chunk form's error (output and fp32
final state) is at most 2× the bf16-products recurrence's: awkward shapes (T = 1, 63, 100, 1000;
K ≠ V; K = 60; B > 1; an initial state), extreme decays (chunks whose cumulative decay passes
e^{±60}, which the kernel sums pair by pair in fp32), packed sequences, and every ISA path this
machine runs. Bitwise: determinism, batch invariance (alone / in a batch of 8), the mode off or a
gradient following (exactly the fp32 path), the kernels off (the fp32 forward on the widened
inputs); ``torch.compile(fullgraph=True)`` runs the same kernel (``test_compile_kernels.py``,
``test_compiled_inference_calls_the_kernels_bitwise``). A fixture counts
the bf16 kernel's calls, so a test that silently ran another path fails. No speed is asserted.
"""

import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.ops import cpu as cpu_kernels
from fastweights.ops.cpu import library
from helpers import record_calls, rel_err, thread_and_batch_runs
from test_cpu_isa import path  # noqa: F401  (the fixture: each ISA path this machine runs)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def bf16_calls(kernels, bf16_kernels, monkeypatch):
    """Counts the bf16-products kernel's calls (the eager call and the custom op's real
    implementation both look it up on the extension by name); the ops take it on every ISA path
    (``bf16_kernels``: also where the path has no bf16 unit)."""
    yield record_calls(monkeypatch, kernels, "chunk_kda_fwd_bf16", lambda args: args[0].shape)
    torch._dynamo.reset()


def _inputs(B, T, H, K, V, decay=0.3, initial_state=True, seed=0):
    """bf16 q, k, v (unit keys), fp32 β in (0, 1), per-channel log decays in (−decay, 0), an fp32
    initial state."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    x = dict(q=rand(B, T, H, K).bfloat16(), k=F.normalize(rand(B, T, H, K), dim=-1).bfloat16(),
             v=rand(B, T, H, V).bfloat16(), g=-torch.rand(B, T, H, K, generator=gen) * decay,
             beta=torch.sigmoid(rand(B, T, H)))
    if initial_state:
        x["initial_state"] = rand(B, H, K, V)
    return x


def _run(op, x, products=True, **kwargs):
    with torch.no_grad(), ops.bf16_products(products):
        return op(**x, output_final_state=True, **kwargs)


def _within_2x(x, label, **kwargs):
    """The chunk form under the mode within 2× of the bf16-products recurrence's error (o, h_T)
    against the float64 recurrence on the same inputs; returns the errors."""
    exact = ops.recurrent_kda(**{n: t.double() for n, t in x.items()}, output_final_state=True,
                              **{n: t for n, t in kwargs.items() if n == "cu_seqlens"})
    fast = _run(ops.chunk_kda, x, **kwargs)
    rec = _run(ops.recurrent_kda, x, **{n: t for n, t in kwargs.items() if n == "cu_seqlens"})
    assert fast[0].dtype == torch.bfloat16 and fast[1].dtype == torch.float32
    errors = []
    for name, f, r, e in zip(("o", "h_T"), fast, rec, exact):
        e_fast, e_rec = rel_err(f, e), rel_err(r, e)
        print(f"{label} {name}: chunk {e_fast:.2e}, recurrence {e_rec:.2e} (bf16 products), ratio {e_fast / e_rec:.2f}")
        assert e_fast <= 2.0 * e_rec, f"{label} {name}: chunk {e_fast:.2e} > 2 x recurrence {e_rec:.2e}"
        errors.append((e_fast, e_rec))
    return errors


@pytest.mark.parametrize("B,T,H,K,V,h0,decay", [
    (2, 1, 2, 32, 40, True, 0.3), (2, 63, 2, 32, 40, False, 0.3), (2, 100, 2, 60, 32, True, 0.3),
    (1, 1000, 2, 16, 24, True, 0.1), (3, 100, 2, 64, 64, True, 3.0),
], ids=["T1", "T63-noh0", "T100-K60", "T1000", "strong"])
def test_bf16_products_within_2x_of_the_recurrence(bf16_calls, B, T, H, K, V, h0, decay):
    """decay 3.0 per token: the chunk's cumulative decay passes e^{60} within the chunk (the
    kernel's pair-by-pair S and P); the others stay within it (one product for S and P)."""
    _within_2x(_inputs(B, T, H, K, V, decay, h0, seed=T), f"B={B} T={T} K={K} V={V}", chunk_size=64)
    assert bf16_calls, "the bf16-products kernel did not run"


def test_chunks_that_pass_the_limit_between_chunks_that_do_not(bf16_calls):
    """One sequence whose second and fourth chunks decay by up to e^{−40} a token (pair by pair)
    and whose others decay mildly (one product): both kinds of chunk, one state carried through."""
    x = _inputs(2, 250, 2, 32, 24, decay=0.5, seed=11)
    x["g"][:, 64:128] *= 80.0
    x["g"][:, 192:250] *= 80.0
    _within_2x(x, "mixed", chunk_size=64)
    assert bf16_calls


def test_packed_sequences_under_the_mode(bf16_calls):
    """Uneven cu_seqlens with length-1 segments, an initial state each: the front end pads the
    sequences into a batch for the kernel (zero gk, β, k on the padding: no-op tokens)."""
    lengths = [5, 70, 1, 33, 2]
    x = _inputs(1, sum(lengths), 3, 20, 12, initial_state=False, seed=8)
    x["initial_state"] = torch.randn(len(lengths), 3, 20, 12)
    cu = torch.tensor([0] + lengths).cumsum(0)
    _within_2x(x, "packed", cu_seqlens=cu, chunk_size=32)
    assert bf16_calls


def test_every_isa_path(path, bf16_calls):  # noqa: F811  (the imported fixture)
    """Each ISA path this machine runs (AMX tiles, AVX512-BF16, the widened fp32 products), with a
    chunk of extreme decays among mild ones, K = 60 ≠ V."""
    x = _inputs(2, 150, 2, 60, 40, decay=0.4, seed=3)
    x["g"][:, 64:100] *= 40.0
    _within_2x(x, path, chunk_size=64)
    assert bf16_calls


def test_deterministic_and_batch_invariant(bf16_calls):
    """Bitwise: the same call twice, one or two threads, and a sequence alone or in a batch of 8."""
    x = _inputs(8, 130, 3, 32, 32, seed=2)

    def op(**kw):
        with ops.bf16_products():
            return ops.chunk_kda(**kw)

    one, two, alone = thread_and_batch_runs(op, x)
    again = _run(ops.chunk_kda, x)
    assert all(torch.equal(a, b) for a, b in zip(one, two)) and all(torch.equal(a, b) for a, b in zip(one, again))
    assert torch.equal(alone[0], one[0][:1]) and torch.equal(alone[1], one[1][:1])
    assert bf16_calls


def test_mode_off_or_a_gradient_gives_exactly_the_fp32_path(kernels, bf16_calls):
    """Without the mode, with fp32 inputs, or when a backward may follow, the mode changes nothing
    (bitwise); with it, on bf16 inputs in inference, it does change the arithmetic."""
    x = _inputs(2, 100, 2, 32, 24, seed=4)
    off = _run(ops.chunk_kda, x, products=False)
    assert not bf16_calls
    fp32 = {n: t.float() for n, t in x.items()}
    assert all(torch.equal(a, b) for a, b in zip(_run(ops.chunk_kda, fp32, products=False), _run(ops.chunk_kda, fp32)))
    assert not bf16_calls
    for name in ("g", "q"):  # a gradient through the decays or through q: the fp32 path
        leaves = {n: (t.clone().requires_grad_() if n == name else t) for n, t in x.items()}
        with ops.bf16_products():
            o, h = ops.chunk_kda(**leaves, output_final_state=True)
        plain = {n: (t.clone().requires_grad_() if n == name else t) for n, t in x.items()}
        o_off, h_off = ops.chunk_kda(**plain, output_final_state=True)
        assert torch.equal(o, o_off) and torch.equal(h, h_off), name
        o.float().sum().backward()
        assert leaves[name].grad is not None
    assert not bf16_calls
    on = _run(ops.chunk_kda, x)
    assert bf16_calls and not torch.equal(on[1], off[1])
    exact = ops.recurrent_kda(**{n: t.double() for n, t in x.items()}, output_final_state=True)
    print(f"h_T: bf16 products {rel_err(on[1], exact[1]):.2e}, fp32 {rel_err(off[1], exact[1]):.2e}")
    assert rel_err(on[1], exact[1]) > 10 * rel_err(off[1], exact[1])


def test_without_the_kernels_the_fp32_forward_runs(kernels, bf16_calls):
    """Kernels off (or another device): the mode's chunk form is the fp32 forward on the inputs
    widened, bitwise the mode-off result; the recurrence keeps its bf16-products step."""
    x = _inputs(2, 70, 2, 16, 24, seed=5)
    cpu_kernels.set_enabled(False)
    try:
        on, off = _run(ops.chunk_kda, x), _run(ops.chunk_kda, x, products=False)
        torch_backend = _run(ops.chunk_kda, x, backend="torch")
    finally:
        cpu_kernels.set_enabled(None)
    assert not bf16_calls
    assert on[0].dtype == torch.bfloat16 and on[1].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(on, off)) and all(torch.equal(a, b) for a, b in zip(on, torch_backend))


def test_the_kernel_checks_the_inputs_it_reads(kernels, bf16_calls):
    """The fused checks: a NaN in k and a positive log decay are the ops' ValueErrors, by name."""
    x = _inputs(1, 40, 2, 16, 16, seed=6)
    bad = dict(x, k=x["k"].clone())
    bad["k"][0, 3, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="`k`"):
        _run(ops.chunk_kda, bad)
    bad = dict(x, g=x["g"].clone())
    bad["g"][0, 5, 0, 1] = 0.5
    with pytest.raises(ValueError, match="`g`"):
        _run(ops.chunk_kda, bad)
    assert len(bf16_calls) == 2


def test_the_kernels_fake_matches_it(kernels):
    """opcheck: the registered op's fake gives the real outputs' shapes, dtypes and strides (T not
    a multiple of C, K != V, with and without the initial state and the decay check)."""
    gen = torch.Generator().manual_seed(0)
    n, h, t, dk, dv, c = 2, 3, 10, 6, 4, 4
    q, k, v = (torch.randn(n, h, t, d, generator=gen).bfloat16() for d in (dk, dk, dv))
    beta, gk = torch.rand(n, h, t, generator=gen), -torch.rand(n, h, t, dk, generator=gen)
    for args in [(q, k, v, beta, gk, torch.randn(n * h, dk, dv, generator=gen), 0.5, c, "op", True),
                 (q, k, v, beta, gk, None, 0.5, c)]:
        torch.library.opcheck(library.OPS["chunk_kda_fwd_bf16"], args, test_utils=("test_schema", "test_faketensor"))
