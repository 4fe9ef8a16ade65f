"""The fast-weight layers' training paths (the CPU-fast short convolution and chunk choices) against plain references in float64:
the short convolution's hand-written backward against autograd through ``F.conv1d``,
and the per-key-size default chunk length against token-by-token decoding (the
recurrent op's one-token update), outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.layers import DeltaNet, GatedDeltaNet, LinearAttention, ShortConvolution
from fastweights.layers.common import _CausalConv
from fastweights.models import LM, LMConfig
from fastweights.ops._chunk import default_chunk_size

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

TOL = 1e-12


def _err(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _conv_reference(x, state, weight, bias):
    """Depthwise cross-correlation of [state | x] by ``F.conv1d`` (float64): ``(y, new state)``."""
    padded = torch.cat([state, x], dim=1)  # [B, W − 1 + T, C]
    y = F.conv1d(padded.transpose(1, 2), weight[:, None, :], bias, groups=weight.shape[0]).transpose(1, 2)
    return y, padded[:, padded.shape[1] - (weight.shape[1] - 1):]


@pytest.mark.parametrize("T", [1, 2, 5, 63], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("W", [1, 3, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_short_convolution_and_its_backward_equal_conv1d(T, W, with_state, bias):
    torch.manual_seed(T * 10 + W)
    B, C = 3, 7
    conv = ShortConvolution(C, kernel_size=W, bias=bias).double()
    if bias:
        torch.nn.init.normal_(conv.bias)
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    state = torch.randn(B, W - 1, C, dtype=torch.float64, requires_grad=True) if with_state else None
    dy, ds = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, W - 1, C, dtype=torch.float64)

    y, new_state = conv(x, state)
    leaves = [x, conv.weight] + ([state] if with_state else []) + ([conv.bias] if bias else [])
    grads = torch.autograd.grad((y * dy).sum() + (new_state * ds).sum(), leaves)

    ref_state = state if with_state else torch.zeros(B, W - 1, C, dtype=torch.float64)
    y_ref, state_ref = _conv_reference(x, ref_state, conv.weight, conv.bias)
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + (state_ref * ds).sum(), leaves)
    errors = [_err(y, y_ref), _err(new_state, state_ref)] + [_err(g, r) for g, r in zip(grads, grads_ref)]
    print(f"T={T} W={W} state={with_state} bias={bias}: max errors (y, state, grads...) {errors}")
    assert max(errors) <= TOL


def test_short_convolution_gradcheck():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_CausalConv.apply, (x, state, weight))


@pytest.mark.parametrize("key_dim, device_type, want", [(32, "cpu", 32), (60, "cpu", 32), (64, "cpu", 32), (128, "cpu", 64),
                                                        (32, "cuda", 64), (128, "cuda", 64)])
def test_default_chunk_size_per_key_size_and_device(key_dim, device_type, want):
    assert default_chunk_size(key_dim, torch.device(device_type)) == want


MIXER_LAYERS = {
    "deltanet": DeltaNet,
    "gated_deltanet": GatedDeltaNet,
    "linear": LinearAttention,
}


@pytest.mark.parametrize("name", list(MIXER_LAYERS))
@pytest.mark.parametrize("heads", [1, 2], ids=["K60", "K30"])
def test_default_chunk_size_layer_equals_token_by_token(name, heads):
    """chunk_size=None (C = 32 here, T = 100 is not a multiple) against decoding token by
    token from the start (the recurrent op's one-token update), outputs and input gradients."""
    torch.manual_seed(heads)
    layer = MIXER_LAYERS[name](60, heads).double()
    assert layer.chunk_size is None and layer.chunk_length(torch.zeros(1)) == 32
    x = torch.randn(2, 100, 60, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 100, 60, dtype=torch.float64)
    y, _ = layer(x)
    (dx,) = torch.autograd.grad((y * dy).sum(), x)

    y_ref, state = layer(x[:, :1])
    outs = [y_ref]
    for t in range(1, 100):
        out, state = layer(x[:, t:t + 1], state)
        outs.append(out)
    y_ref = torch.cat(outs, 1)
    (dx_ref,) = torch.autograd.grad((y_ref * dy).sum(), x)
    print(f"{name} K={60 // heads}: output error {_err(y, y_ref):.2e}, dx error {_err(dx, dx_ref):.2e}")
    assert _err(y, y_ref) <= 1e-10 and _err(dx, dx_ref) <= 1e-10


def test_lm_config_chunk_size_none_is_the_default_and_checked():
    config = LMConfig(vocab_size=11, d_model=32, n_layers=1, n_heads=2)
    assert config.chunk_size is None
    assert LM(config).blocks[0].mixer.chunk_length(torch.zeros(1)) == 32
    with pytest.raises(ValueError, match="chunk_size"):
        LMConfig(vocab_size=11, d_model=32, n_layers=1, n_heads=2, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        DeltaNet(32, 2, chunk_size=-4)
    with pytest.raises(ValueError, match="chunk_size"):
        DeltaNet(32, 2, chunk_size=True)


CHUNK_OPS = {
    "delta": (ops.recurrent_delta_rule, ops.chunk_delta_rule, dict(beta=True)),
    "gated_delta": (ops.recurrent_gated_delta_rule, ops.chunk_gated_delta_rule, dict(beta=True, g=True)),
    "linear_decay": (ops.recurrent_linear_attn, ops.chunk_linear_attn, dict(g=True)),
}


@pytest.mark.parametrize("used", ["state-only", "output-only"])
@pytest.mark.parametrize("rule", list(CHUNK_OPS))
def test_chunk_op_gradients_when_one_output_is_unused(rule, used):
    """The chunk ops' backward receives ``None`` for an output that got no gradient (its
    kept tensors are marked backward-only): with only h_T, or only o, in the loss the
    gradients still equal the float64 recurrence's (T = 100, C = 32, K = 60, B = 2, h0 given)."""
    recurrent, chunk, needs = CHUNK_OPS[rule]
    torch.manual_seed(1)
    B, T, H, K, V = 2, 100, 2, 60, 12
    q, k = (F.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1) for _ in range(2))
    inputs = dict(q=q, k=k, v=torch.randn(B, T, H, V, dtype=torch.float64),
                  initial_state=torch.randn(B, H, K, V, dtype=torch.float64))
    if needs.get("beta"):
        inputs["beta"] = torch.rand(B, T, H, dtype=torch.float64)
    if needs.get("g"):
        inputs["g"] = -torch.rand(B, T, H, dtype=torch.float64) * 0.2
    leaves = {name: t.requires_grad_(True) for name, t in inputs.items()}
    dh = torch.randn(B, H, K, V, dtype=torch.float64)
    do = torch.randn(B, T, H, V, dtype=torch.float64)

    def grads(op, **kw):
        o, h = op(**leaves, output_final_state=True, **kw)
        loss = (h * dh).sum() if used == "state-only" else (o * do).sum()
        got = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)  # (h_T does not read q)
        return [torch.zeros_like(t) if d is None else d for t, d in zip(leaves.values(), got)]

    got, want = grads(chunk, chunk_size=32), grads(recurrent)
    errors = {name: _err(a, b) for name, a, b in zip(leaves, got, want)}
    print(f"{rule}, {used}: gradient errors {errors}")
    assert max(errors.values()) <= 1e-10
