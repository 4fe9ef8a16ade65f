"""The compiled CPU chunk kernels (the delta rules', KDA's, linear attention's) take every shape and
layout the PyTorch path takes.

A fuzz over small shapes (B, T, H, K, V down to 1), the cotangents that real losses make
(``o.sum()``: a scalar expanded to every position, stride 0 everywhere; a weight broadcast
over batch and time; a loss on a strided slice; the final state's cotangent or none) and
inputs handed over as views (transposed, sliced, β expanded over the heads). Every case runs
the compiled path and the PyTorch path (``fastweights.ops.cpu.set_enabled(False)``) in float64:
outputs and every gradient agree to 1e-12, and both to 1e-10 of the recurrent form (relative to
max(‖reference‖, 1): some gradients are exactly 0, e.g. dg at T = 1 without an initial state),
and a spy checks that the compiled backward really ran.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.ops import cpu as cpu_kernels
from fastweights.ops.delta_rule import chunk as chunk_module
from fastweights.ops.kda import chunk as kda_chunk_module
from fastweights.ops.linear_attn import chunk as la_chunk_module

FAST_CASES, LONG_CASES = 150, 1500
OTHER_CASES = 30  # each of KDA and linear attention (ungated, gated)
COTANGENTS = ("sum", "broadcast_weight", "strided_slice", "random")



def _view_of(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (values unchanged) as a tensor of another layout: a transpose of a copy, or a stride-2 slice."""
    if layout == "transposed":  # stored [B, H, T, D], seen [B, T, H, D]
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":  # every other element of a buffer twice as wide
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / max(‖b‖, 1): relative for the O(1) and larger tensors here, absolute for exact zeros."""
    return ((a.detach() - b.detach()).norm() / b.detach().norm().clamp_min(1.0)).item()


def _case(rng: random.Random):
    """One random case: the rule, shapes, input layouts, cotangent kind, options."""
    return dict(
        gated=rng.random() < 0.5,
        B=rng.choice([1, 1, 2, 3]), T=rng.choice([1, 1, 2, 5, 17, 33]), H=rng.choice([1, 1, 2, 3]),
        K=rng.choice([1, 2, 3, 8]), V=rng.choice([1, 1, 2, 5]),
        chunk_size=rng.choice([16, 32]), h0=rng.random() < 0.5, final=rng.random() < 0.5,
        layout=rng.choice(["plain", "transposed", "strided"]), beta_expanded=rng.random() < 0.3,
        cotangent=rng.choice(COTANGENTS), seed=rng.randrange(1 << 30),
    )


def _inputs(c):
    gen = torch.Generator().manual_seed(c["seed"])
    B, T, H, K, V = (c[n] for n in "BTHKV")

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V))
    if not c.get("la"):  # linear attention has no write strength
        x["beta"] = torch.sigmoid(rand(B, T, 1)).expand(B, T, H) if c["beta_expanded"] else torch.sigmoid(rand(B, T, H))
    if c.get("kda"):  # KDA: a log decay per key channel
        x["g"] = F.logsigmoid(rand(B, T, H, K) + 2.0)
    elif c["gated"]:
        x["g"] = F.logsigmoid(rand(B, T, H) + 2.0)
    if c["h0"]:
        x["initial_state"] = rand(B, H, K, V)
    weights = dict(o=rand(B, T, H, V), h=rand(B, H, K, V), head=rand(H, V))
    return x, weights


def _run(form, c, x, weights, compiled=None):
    """Output, final state and every gradient of the case's loss; ``compiled`` True/False sets the kernels."""
    if compiled is not None:
        cpu_kernels.set_enabled(compiled)
    try:
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        args = {n: _view_of(t, c["layout"]) if n in ("q", "k", "v") else t for n, t in leaves.items()}
        if c["beta_expanded"] and "beta" in leaves:  # the leaf is [B, T, 1]'s expansion: hand the op a stride-0 head dim
            args["beta"] = leaves["beta"][..., :1].expand_as(leaves["beta"])
        kwargs = dict(chunk_size=c["chunk_size"]) if compiled is not None else {}
        o, h = form(**args, output_final_state=True, **kwargs)
        kind = c["cotangent"]
        if kind == "sum":  # autograd hands the op a scalar expanded to o's shape (all strides 0)
            loss = o.sum()
        elif kind == "broadcast_weight":  # a cotangent of stride 0 over batch and time
            loss = (o * weights["head"]).sum()
        elif kind == "strided_slice":  # a cotangent that is zero off a stride-2 slice in time
            loss = (o[:, ::2] * weights["o"][:, ::2]).sum()
        else:
            loss = (o * weights["o"]).sum()
        if c["final"]:
            loss = loss + (h * weights["h"]).sum() if kind == "random" else loss + h.sum()
        loss.backward()
        return [o, h] + [leaves[n].grad for n in sorted(leaves)]
    finally:
        cpu_kernels.set_enabled(None)


def _check(c, spy):
    if c.get("kda"):
        form, reference = ops.chunk_kda, ops.recurrent_kda
    elif c.get("la"):
        form, reference = ops.chunk_linear_attn, ops.recurrent_linear_attn
    else:
        form = ops.chunk_gated_delta_rule if c["gated"] else ops.chunk_delta_rule
        reference = ops.recurrent_gated_delta_rule if c["gated"] else ops.recurrent_delta_rule
    x, weights = _inputs(c)
    spy.clear()
    compiled = _run(form, c, x, weights, compiled=True)
    assert spy == [True], f"the compiled backward did not run: {spy} for {c}"
    torch_path = _run(form, c, x, weights, compiled=False)
    recurrent = _run(reference, c, x, weights)
    names = ["o", "h_T"] + ["d" + n for n in sorted(x)]
    for name, a, b, r in zip(names, compiled, torch_path, recurrent):
        assert a.shape == b.shape == r.shape, f"{name}: shapes {a.shape} / {b.shape} / {r.shape} for {c}"
        assert _err(a, b) < 1e-12, f"{name}: compiled vs PyTorch path {_err(a, b):.2e} for {c}"
        assert _err(a, r) < 1e-10, f"{name}: compiled vs recurrence {_err(a, r):.2e} for {c}"


@pytest.fixture
def spy(monkeypatch):
    """Records, per backward, whether the compiled kernel computed it (not None from ``_native_backward``,
    the delta rules', KDA's or linear attention's)."""
    calls = []
    for module in (chunk_module, kda_chunk_module, la_chunk_module):
        def recording(*args, _native=module._native_backward, **kwargs):
            out = _native(*args, **kwargs)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(module, "_native_backward", recording)
    return calls


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("cotangent", ["sum", "broadcast_weight"])
def test_compiled_backward_with_every_dim_one_and_stride_0_cotangents(kernels_on, spy, one_thread, gated, cotangent):
    """B = T = H = V = 1 with ``o.sum()`` (all strides 0, last dim 1, which PyTorch calls contiguous)."""
    c = dict(gated=gated, B=1, T=1, H=1, K=1, V=1, chunk_size=32, h0=False, final=False, layout="plain",
             beta_expanded=False, cotangent=cotangent, seed=1)
    _check(c, spy)
    _check(dict(c, layout="strided"), spy)  # q, k, v of last stride 2 that PyTorch calls contiguous (every dim 1)
    _check(dict(c, K=4, h0=True, final=True), spy)


def test_compiled_backward_fuzz(kernels_on, spy, one_thread):
    rng = random.Random(1234)
    for _ in range(FAST_CASES):
        _check(_case(rng), spy)


@pytest.mark.slow
def test_compiled_backward_fuzz_long(kernels_on, spy, one_thread):
    rng = random.Random(98765)
    for _ in range(LONG_CASES):
        _check(_case(rng), spy)


#: The other rules on kernels of their own: KDA (a decay per key channel), linear attention (no β;
#: ungated, and with a per-head decay).
OTHER_RULES = {"kda": dict(kda=True, gated=True), "linear_attn": dict(la=True, gated=False),
               "gated_linear_attn": dict(la=True, gated=True)}


@pytest.mark.parametrize("rule", sorted(OTHER_RULES))
@pytest.mark.parametrize("cotangent", ["sum", "broadcast_weight"])
def test_other_rules_compiled_backward_with_every_dim_one_and_stride_0_cotangents(kernels_on, spy, one_thread, rule,
                                                                                  cotangent):
    """B = T = H = V = 1 with ``o.sum()`` (a cotangent of last stride 0 that PyTorch calls contiguous)."""
    c = dict(OTHER_RULES[rule], B=1, T=1, H=1, K=1, V=1, chunk_size=32, h0=False, final=False, layout="plain",
             beta_expanded=False, cotangent=cotangent, seed=2)
    _check(c, spy)
    _check(dict(c, layout="strided"), spy)
    _check(dict(c, K=4, T=5, h0=True, final=True), spy)


@pytest.mark.parametrize("rule", sorted(OTHER_RULES))
def test_other_rules_compiled_backward_fuzz(kernels_on, spy, one_thread, rule):
    rng = random.Random(4321)
    for _ in range(OTHER_CASES):
        _check(dict(_case(rng), **OTHER_RULES[rule]), spy)
