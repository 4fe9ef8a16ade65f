"""Checks shared by the tests of plain bf16 inputs read by an fp32 kernel (KDA's and linear
attention's forwards: ``test_cpu_kda_plain_bf16.py``, ``test_cpu_linear_attn_plain_bf16.py``).

Each takes the public op and ``fwd_calls``, the list that records the dtype of q at each call of
the op's forward kernel (``helpers.record_calls``), so a check that silently ran the old path
(q, k, v cast to fp32 first) fails. "Widened" is that old path: q, k, v cast to fp32, the fp32
output cast to bf16; the new one must give it bit for bit.
"""

from typing import Callable, Dict

import pytest
import torch

from fastweights.ops import cpu as cpu_kernels
from helpers import thread_and_batch_runs

Inputs = Dict[str, torch.Tensor]


def run(op: Callable, x: Inputs, **kwargs):
    with torch.no_grad():
        return op(**x, output_final_state=True, **kwargs)


def widened(op: Callable, x: Inputs, **kwargs):
    """The old path: q, k, v cast to fp32 first, the fp32 output cast to bf16."""
    o, h = run(op, {n: (t.float() if n in ("q", "k", "v") else t) for n, t in x.items()}, **kwargs)
    return o.to(torch.bfloat16), h


def same_as_widened(op: Callable, x: Inputs, fwd_calls: list, label: str, **kwargs):
    """The op on bf16 ``x`` calls the kernel on bf16 rows once and gives the widened path's o (bf16)
    and h_T (fp32) bit for bit; returns them."""
    plain = run(op, x, **kwargs)
    assert fwd_calls == [torch.bfloat16], f"{label}: the kernel did not read bf16 inputs: {fwd_calls}"
    old = widened(op, x, **kwargs)
    assert fwd_calls[1:] == [torch.float32]
    assert plain[0].dtype == torch.bfloat16 and plain[1].dtype == torch.float32
    assert plain[0].shape == old[0].shape and plain[1].shape == old[1].shape
    for name, a, b in zip(("o", "h_T"), plain, old):
        assert torch.equal(a, b), f"{label} {name}: max |diff| {(a.float() - b.float()).abs().max():.3e}"
    fwd_calls.clear()
    return plain


def check_autocast(op: Callable, x: Inputs, fwd_calls: list):
    """bf16 inputs under ``torch.autocast("cpu", bf16)`` (what an autocast model's projections hand
    the op): the same kernel call on the bf16 rows, bitwise the result without autocast."""
    plain = run(op, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = run(op, x)
    assert fwd_calls == [torch.bfloat16] * 2
    assert cast[0].dtype == torch.bfloat16 and cast[1].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(plain, cast))


def check_deterministic_and_batch_invariant(op: Callable, x: Inputs, fwd_calls: list):
    """Bitwise: one or two threads, and a sequence alone or in the batch ``x``."""
    one, two, alone = thread_and_batch_runs(op, x)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(alone[0], one[0][:1]) and torch.equal(alone[1], one[1][:1])
    assert fwd_calls == [torch.bfloat16] * 3


def check_without_the_kernel(op: Callable, x: Inputs, fwd_calls: list):
    """Kernels off, or backend "torch": the PyTorch forward on the inputs widened in Python, bitwise
    the widened path's result on the same backend; o bf16 and h_T fp32 as from the kernel."""
    torch_plain, torch_old = run(op, x, backend="torch"), widened(op, x, backend="torch")
    cpu_kernels.set_enabled(False)
    try:
        off_plain, off_old = run(op, x), widened(op, x)
    finally:
        cpu_kernels.set_enabled(None)
    assert not fwd_calls
    for plain, old in ((torch_plain, torch_old), (off_plain, off_old)):
        assert plain[0].dtype == torch.bfloat16 and plain[1].dtype == torch.float32
        assert all(torch.equal(a, b) for a, b in zip(plain, old))


def check_a_gradient_takes_the_widened_path(op: Callable, x: Inputs, fwd_calls: list, names=("g", "q")):
    """A backward may follow (through each of ``names`` in turn): q, k, v widened before the kernel,
    the widened path's values, and the backward runs."""
    for name in names:
        leaves = {n: (t.clone().requires_grad_() if n == name else t) for n, t in x.items()}
        o, h = op(**leaves, output_final_state=True)
        assert fwd_calls == [torch.float32], (name, fwd_calls)
        old = widened(op, x)
        assert torch.equal(o.detach(), old[0]) and torch.equal(h.detach(), old[1]), name
        o.float().sum().backward()
        assert leaves[name].grad is not None and torch.isfinite(leaves[name].grad).all()
        fwd_calls.clear()


def check_a_nan_is_the_ops_value_error(op: Callable, x: Inputs, fwd_calls: list, name: str):
    """The kernel's fused finite check on the widened rows: the ops' ValueError naming the input."""
    bad = dict(x, **{name: x[name].clone()})
    bad[name][0, 3, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=f"`{name}`"):
        run(op, bad)
    assert fwd_calls == [torch.bfloat16]


def rounding_cases(gen: torch.Generator, n: int):
    """fp32 values for checks of a conversion to bf16: ``n`` random bit patterns (NaN dropped: ties
    both ways, subnormals, huge values) and the special cases (signed zeros, infinities, values next
    to overflow, subnormals, exact ties)."""
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-40, -1e-45,
                            1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20])
    return x[~torch.isnan(x)], special


def check_torch_compile(call: Callable, x: Inputs, fwd_calls: list, infer_op: str):
    """``torch.compile(fullgraph=True)`` of ``call(**x)`` (the op with its options) on bf16 inputs:
    one graph with the inference op ``infer_op`` in it, the kernel called on the bf16 rows, the
    eager outputs bitwise."""
    from test_compile_kernels import Graphs

    graphs = Graphs()
    with torch.no_grad():
        compiled = torch.compile(call, backend=graphs, fullgraph=True)(**x)
        traced = list(fwd_calls)
        eager = call(**x)
    assert graphs.count == 1 and graphs.has(infer_op), (graphs.count, graphs.targets)
    assert traced == [torch.bfloat16] and fwd_calls == [torch.bfloat16] * 2
    assert compiled[0].dtype == torch.bfloat16 and compiled[1].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
