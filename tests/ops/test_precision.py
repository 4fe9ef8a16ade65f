"""bf16 / fp16 inputs: the chunk forms meet docs/design.md's 2× / 3× rule.

Inputs are drawn in float64 and rounded to the low precision once; the ground
truth is the recurrent form run in float64 on those same rounded inputs. The
chunk form (fp32 accumulation, fp32 state) may be at most 2× as far from it as
the recurrent form run on the same low-precision inputs (3× for gradients).
The fp32 state h_T is compared too: it exposes any accumulation below fp32,
which the output's final rounding to bf16 would otherwise hide.
"""

import pytest
import torch

from helpers import RULES, call, make_inputs, rel_err

LOW = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def run(form, rule, x, do, dh, **kwargs):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, h = call(form, rule, leaves, output_final_state=True, **kwargs)
    ((o.double() * do).sum() + (h.double() * dh).sum()).backward()
    return o, h, {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("rule_name", ["delta", "gated_delta", "linear_decay"])
def test_low_precision_chunk_within_2x_of_recurrent(rule_name, dtype):
    rule = RULES[rule_name]
    x = make_inputs(rule, 2, 160, 2, 32, 40, initial_state=True, seed=3)
    low = {n: (t.to(dtype) if n != "initial_state" else t.float()) for n, t in x.items()}
    exact = {n: t.double() for n, t in low.items()}
    o_ref, h_ref = call(rule.reference, rule, exact, output_final_state=True)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(h_ref.shape, generator=gen, dtype=torch.float64)
    _, _, g_ref = run(rule.reference, rule, exact, do, dh)
    o_fast, h_fast, g_fast = run(rule.forms[2], rule, low, do, dh, chunk_size=32)
    o_rec, h_rec, g_rec = run(rule.reference, rule, low, do, dh)

    assert o_fast.dtype == dtype and h_fast.dtype == torch.float32
    assert all(g_fast[n].dtype == low[n].dtype for n in low)
    checks = [("o", o_fast, o_rec, o_ref, 2.0), ("h_T", h_fast, h_rec, h_ref, 2.0)]
    checks += [(f"d{n}", g_fast[n], g_rec[n], g_ref[n], 3.0) for n in g_ref]
    for name, fast, rec, ref, factor in checks:
        e_fast, e_rec = rel_err(fast, ref), rel_err(rec, ref)
        print(f"{name}: chunk {e_fast:.2e}, recurrent {e_rec:.2e}, ratio {e_fast / e_rec:.2f} (limit {factor:g})")
        assert e_fast <= factor * e_rec, f"{name}: chunk error {e_fast:.2e} > {factor:g} x recurrent {e_rec:.2e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rule_name", ["delta", "gated_delta", "linear_decay"])
def test_chunk_path_runs_unchanged_on_cuda(rule_name):
    """The same PyTorch code on CUDA tensors: float64 equality with the CPU recurrence, forward and backward."""
    rule = RULES[rule_name]
    x = make_inputs(rule, 2, 100, 2, 16, 24, initial_state=True, seed=7)
    gen = torch.Generator().manual_seed(8)
    o_ref, h_ref = call(rule.reference, rule, x, output_final_state=True)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(h_ref.shape, generator=gen, dtype=torch.float64)
    _, _, g_ref = run(rule.reference, rule, x, do, dh)
    cuda = {n: t.cuda() for n, t in x.items()}
    kwargs = dict(chunk_size=32, backend="torch") if rule.beta else dict(chunk_size=32)
    o, h, g = run(rule.forms[2], rule, cuda, do.cuda(), dh.cuda(), **kwargs)
    assert o.is_cuda and rel_err(o.cpu(), o_ref) < 1e-10 and rel_err(h.cpu(), h_ref) < 1e-10
    for n in g_ref:
        assert rel_err(g[n].cpu(), g_ref[n]) < 1e-10, n
