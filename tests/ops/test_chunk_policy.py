"""The chunk length is decided in one place (``fastweights.ops.default_chunk_size``): a layer and a
direct op call with the defaults run the same C, and an explicit ``chunk_size`` reaches the solver."""

import pytest
import torch

from fastweights import ops
from fastweights.layers import DeltaNet, GatedDeltaNet, LinearAttention
from fastweights.ops.delta_rule.chunk import CHUNK_DELTA_RULE
from fastweights.ops.gated_delta_rule.chunk import CHUNK_GATED_DELTA_RULE
from fastweights.ops.linear_attn.chunk import CHUNK_LINEAR_ATTN

CASES = [(DeltaNet, ops.chunk_delta_rule, CHUNK_DELTA_RULE), (GatedDeltaNet, ops.chunk_gated_delta_rule, CHUNK_GATED_DELTA_RULE),
         (LinearAttention, ops.chunk_linear_attn, CHUNK_LINEAR_ATTN)]


def _spy(monkeypatch, op, spec):
    """Record the chunk length the op's solver runs (its last argument; the compiled-CPU solver,
    what ``backend="auto"`` runs on the CPU)."""
    seen, real = [], spec.cpu
    monkeypatch.setattr(spec, "cpu", lambda *a, chunk_size, **kw: seen.append(chunk_size) or real(*a, chunk_size=chunk_size, **kw))
    return seen


@pytest.mark.parametrize("layer_cls, op, spec", CASES, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("head_dim", [16, 96])
def test_a_layer_and_a_direct_op_call_run_the_same_chunk_length(layer_cls, op, spec, head_dim, monkeypatch):
    seen = _spy(monkeypatch, op, spec)
    layer = layer_cls(2 * head_dim, 2)
    layer(torch.randn(1, 200, 2 * head_dim))
    q, k, v = (torch.randn(1, 200, 2, head_dim) for _ in range(3))
    beta, g = torch.rand(1, 200, 2), -torch.rand(1, 200, 2)
    extra = {"chunk_gated_delta_rule": dict(g=g, beta=beta), "chunk_delta_rule": dict(beta=beta)}.get(op.__name__, {})
    op(q, k, v, **extra)
    want = ops.default_chunk_size(head_dim, torch.device("cpu"))
    print(f"{layer_cls.__name__} K={head_dim}: layer ran C={seen[0]}, op ran C={seen[1]}, policy {want}")
    assert seen == [want, want] and want == (32 if head_dim <= 64 else 64)
    assert layer.chunk_length(q) == want


def test_an_explicit_chunk_size_reaches_the_solver(monkeypatch):
    seen = _spy(monkeypatch, ops.chunk_delta_rule, CHUNK_DELTA_RULE)
    DeltaNet(32, 2, chunk_size=16)(torch.randn(1, 50, 32))
    q, k, v = (torch.randn(1, 50, 2, 16) for _ in range(3))
    ops.chunk_delta_rule(q, k, v, torch.rand(1, 50, 2), chunk_size=8)
    assert seen == [16, 8]
