"""Compiled ops keep their value checks: NaN/Inf in any input, β outside its range and
g > 0 fail under torch.compile too (``torch._assert_async``, kept by the compiler, no graph
break), as do bad ``cu_seqlens`` offsets; ``fastweights.ops.check_inputs`` runs the same
checks by hand. Eager mode raises ``ValueError``; compiled code raises the assert's
``RuntimeError``, whose message names the op and the argument."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import fastweights.ops as ops
from helpers import chunk_option

B, T, H, K = 2, 9, 2, 4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    return {"q": q, "k": k, "v": v, "beta": torch.rand(B, T, H, generator=g, dtype=torch.float64),
            "g": -torch.rand(B, T, H, generator=g, dtype=torch.float64)}


OPS = {
    "chunk_gated_delta_rule": ("q", "k", "v", "g", "beta"),
    "chunk_delta_rule": ("q", "k", "v", "beta"),
    "recurrent_gated_delta_rule": ("q", "k", "v", "g", "beta"),
    "chunk_linear_attn": ("q", "k", "v"),
}
BAD = {  # (argument, how to spoil it, what the message says)
    "nan_q": ("q", lambda t: t.index_put_((torch.tensor([0]),), torch.tensor(float("nan"), dtype=t.dtype)), "`q`"),
    "nan_beta": ("beta", lambda t: t.index_put_((torch.tensor([1]),), torch.tensor(float("nan"), dtype=t.dtype)), "`beta`"),
    "nan_g": ("g", lambda t: t.index_put_((torch.tensor([1]),), torch.tensor(float("nan"), dtype=t.dtype)), "`g`"),
    "g_positive": ("g", lambda t: t.add_(2.0), "`g`"),
    "beta_above_one": ("beta", lambda t: t.add_(1.5), "`beta`"),
}


def _call(op_name, x, **kw):
    args = [x[n] for n in OPS[op_name]]
    op = getattr(ops, op_name)
    return op(*args, **chunk_option(op, 4), **kw)


@pytest.mark.parametrize("op_name", [  # the gated ops take every checked argument; the others in the slow run
    pytest.param(op, marks=() if "gated" in op else pytest.mark.slow) for op in OPS])
def test_bad_values_fail_compiled_as_in_eager(op_name):
    compiled = torch.compile(lambda x: _call(op_name, x), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(inputs())[0], _call(op_name, inputs())[0])
    for _bad, (arg, spoil, named) in BAD.items():
        if arg not in OPS[op_name]:
            continue
        x = inputs()
        spoil(x[arg].view(-1))
        with pytest.raises(ValueError, match=named):
            _call(op_name, x)
        with pytest.raises(RuntimeError, match=f"{op_name}: .*{named}"):
            compiled(x)


@pytest.mark.slow
def test_compiled_inductor_refuses_nan_and_positive_g_and_passes_clean_inputs():
    compiled = torch.compile(lambda x: _call("chunk_gated_delta_rule", x), fullgraph=True)  # inductor
    clean = inputs()
    want = _call("chunk_gated_delta_rule", clean)[0]
    assert torch.allclose(compiled(clean)[0], want, rtol=1e-12, atol=1e-12)
    for bad in ("nan_q", "nan_beta", "g_positive"):
        arg, spoil, named = BAD[bad]
        x = inputs()
        spoil(x[arg].view(-1))
        with pytest.raises(RuntimeError, match=named):
            compiled(x)


def test_checks_add_no_graph_break():
    x = inputs()
    explanation = torch._dynamo.explain(lambda x: _call("chunk_gated_delta_rule", x)[0])(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_switches_turn_the_compiled_checks_off_too():
    x = inputs()
    x["g"].add_(0.5)
    with ops.value_checks(False):
        compiled = torch.compile(lambda x: _call("chunk_gated_delta_rule", x), backend="aot_eager", fullgraph=True)
        assert compiled(x)[0].isfinite().all()


def test_compiled_cu_seqlens_offsets_are_checked():
    x = {n: t[:1] for n, t in inputs().items()}
    fn = torch.compile(lambda x, cu: _call("chunk_delta_rule", x, cu_seqlens=cu, max_seqlen=6),
                       backend="aot_eager", fullgraph=True)
    fn(x, torch.tensor([0, 4, 9]))  # fine
    for cu, why in (([1, 4, 9], "start at 0"), ([0, 5, 4, 9], "increasing"), ([0, 4, 8], "end at"),
                    ([0, 2, 9], "max_seqlen")):
        with pytest.raises(RuntimeError, match=why):
            fn(x, torch.tensor(cu))


def test_check_inputs_is_public_and_checks_by_hand():
    x = inputs()
    ops.check_inputs(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"])
    x["g"].add_(3.0)
    with pytest.raises(ValueError, match="`g`"):
        ops.check_inputs(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"])
