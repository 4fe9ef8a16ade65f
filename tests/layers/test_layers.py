"""The mixer layers: prefill + step decoding equals one full pass (float64), varlen
packing equals separate sequences, states have the documented size, the short
convolution equals a causal conv1d, and bad input gets a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.layers import (
    MIXERS, DeltaNet, FastWeightState, GatedDeltaNet, LinearAttention, ShortConvolution, SoftmaxAttention,
)
from fastweights.layers import deltanet as deltanet_module

D_MODEL, HEADS = 60, 3  # head size 20: not a power of two
TOL = 1e-10

VARIANTS = {
    "softmax": lambda: SoftmaxAttention(D_MODEL, HEADS),  # RoPE on (the default)
    "softmax-nope": lambda: SoftmaxAttention(D_MODEL, HEADS, rope_theta=None),
    "softmax-conv": lambda: SoftmaxAttention(D_MODEL, HEADS, use_short_conv=True),
    "softmax-conv3-nope": lambda: SoftmaxAttention(D_MODEL, HEADS, rope_theta=None, use_short_conv=True, conv_size=3),
    "linear-elu-norm": lambda: LinearAttention(D_MODEL, HEADS, feature_map="elu", normalize=True, chunk_size=8),
    "linear-dpfp-conv": lambda: LinearAttention(D_MODEL, HEADS, feature_map="dpfp", normalize=True, qk_norm="sum",
                                                use_short_conv=True, chunk_size=8),
    "linear-identity-plain": lambda: LinearAttention(D_MODEL, HEADS, feature_map="identity", normalize=False,
                                                     use_short_conv=False, use_output_gate=False, chunk_size=8),
    "deltanet": lambda: DeltaNet(D_MODEL, HEADS, chunk_size=8),
    "deltanet-negeig-sum-relu": lambda: DeltaNet(D_MODEL, HEADS, activation="relu", qk_norm="sum",
                                                 allow_neg_eigval=True, chunk_size=8),
    "deltanet-elu-noconv-nogate": lambda: DeltaNet(D_MODEL, HEADS, activation="elu", use_short_conv=False,
                                                   use_output_gate=False, chunk_size=8),
    "deltanet-identity": lambda: DeltaNet(D_MODEL, HEADS, activation="identity", chunk_size=8),
    "gated_deltanet": lambda: GatedDeltaNet(D_MODEL, HEADS, chunk_size=8),
    "gated_deltanet-negeig": lambda: GatedDeltaNet(D_MODEL, HEADS, allow_neg_eigval=True, conv_size=3, chunk_size=8),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def _layer(name):
    return VARIANTS[name]().double()


def _err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_then_decode_equals_full_pass(name):
    layer = _layer(name)
    x = torch.randn(2, 37, D_MODEL, dtype=torch.float64)
    full, _ = layer(x)
    y, state = layer(x[:, :19])  # chunk form, 19 tokens: not a multiple of C = 8
    outs = [y]
    for t in range(19, 37):  # recurrent form, one token at a time
        y, state = layer(x[:, t:t + 1], state)
        outs.append(y)
    err = _err(torch.cat(outs, 1), full)
    print(f"{name}: prefill + decode vs full pass, max abs error {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("name", list(VARIANTS))
def test_split_prefill_carries_the_state(name):
    layer = _layer(name)
    x = torch.randn(2, 30, D_MODEL, dtype=torch.float64)
    full, _ = layer(x)
    a, state = layer(x[:, :2])  # shorter than the conv kernel: the conv state mixes old and new
    b, state = layer(x[:, 2:13], state)
    c, _ = layer(x[:, 13:], state)
    err = _err(torch.cat([a, b, c], 1), full)
    print(f"{name}: three-part prefill vs full pass {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("name", list(VARIANTS))
def test_packed_sequences_equal_separate_ones(name):
    layer = _layer(name)
    lengths = [11, 3, 25]
    xs = [torch.randn(1, n, D_MODEL, dtype=torch.float64) for n in lengths]
    cu = torch.tensor([0, 11, 14, 39])
    packed, state = layer(torch.cat(xs, 1), cu_seqlens=cu)
    separate = [layer(x) for x in xs]
    err = max(_err(packed[:, a:b], y) for (a, b), (y, _) in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), separate))
    print(f"{name}: packed vs separate {err:.2e}")
    assert err <= TOL
    # the packed state continues each sequence exactly like its own state
    nxt = torch.randn(3, 1, D_MODEL, dtype=torch.float64)
    y_packed, _ = layer(nxt.reshape(1, 3, D_MODEL), state, cu_seqlens=torch.arange(4))
    for i, (_, s) in enumerate(separate):
        y_own, _ = layer(nxt[i:i + 1], s)
        assert _err(y_packed[:, i], y_own[:, 0]) <= TOL


@pytest.mark.parametrize("name", list(MIXERS))
def test_state_size_is_fixed_except_for_softmax(name):
    layer = MIXERS[name](32, 2)
    sizes = [layer(torch.randn(1, t, 32))[1].nbytes for t in (10, 200)]
    print(f"{name}: state bytes at 10 and 200 tokens: {sizes}")
    if name == "softmax":
        assert sizes[1] > sizes[0]
        assert sizes[1] - sizes[0] == 190 * 2 * 32 * 4  # keys + values, fp32, per extra token
    else:
        assert sizes[0] == sizes[1]


def test_fast_weight_state_layout():
    _, state = DeltaNet(32, 2)(torch.randn(3, 7, 32))
    assert isinstance(state, FastWeightState)
    assert state.memory.shape == (3, 2, 16, 16) and state.memory.dtype == torch.float32
    assert state.conv.shape == (3, 3, 96)  # W − 1 = 3 inputs of the 3·d_model conv channels
    _, state = LinearAttention(32, 2, normalize=True)(torch.randn(3, 7, 32))
    assert state.memory.shape == (3, 2, 16, 17)  # the normalizer z is the extra value column


def test_short_convolution_equals_causal_conv1d():
    conv = ShortConvolution(12, kernel_size=4).double()
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    y, state = conv(x)
    reference = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight[:, None, :], groups=12).transpose(1, 2)
    assert _err(y, reference) <= 1e-14
    assert torch.equal(state, x[:, -3:])
    y2, _ = conv(x[:, 5:], conv(x[:, :5])[1])
    assert _err(y2, reference[:, 5:]) <= 1e-14


def test_decode_step_uses_the_recurrent_ops_step(monkeypatch):
    """Prefill runs the chunk op; a decoding step runs the op's one-token update
    (``delta_rule_step``, the body of the recurrent form), never the chunk op."""
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(deltanet_module, "delta_rule_step", spy("step", deltanet_module.delta_rule_step))
    monkeypatch.setattr(deltanet_module, "chunk_delta_rule", spy("chunk", ops.chunk_delta_rule))
    layer = DeltaNet(32, 2)
    _, state = layer(torch.randn(1, 5, 32))
    layer(torch.randn(1, 1, 32), state)
    assert calls == ["chunk", "step"]


@pytest.mark.parametrize("name", [n for n in VARIANTS if not n.startswith("softmax")])
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
def test_fused_step_equals_the_recurrent_op_path(name, batch):
    """The fused decoding step (``layer.step``) against the layer's general path with the
    public recurrent op (taken for a one-token call with ``cu_seqlens``), three steps, float64."""
    torch.manual_seed(0)
    layer = _layer(name)
    x = torch.randn(batch, 7, D_MODEL, dtype=torch.float64)
    _, fast = layer(x[:, :4])
    slow = [FastWeightState(fast.memory[b:b + 1], None if fast.conv is None else fast.conv[b:b + 1]) for b in range(batch)]
    one = torch.tensor([0, 1])
    for t in range(4, 7):
        y_fast, fast = layer(x[:, t:t + 1], fast)
        for b in range(batch):  # the general path takes B = 1 with cu_seqlens
            y_slow, slow[b] = layer(x[b:b + 1, t:t + 1], slow[b], cu_seqlens=one)
            err, err_h = _err(y_fast[b:b + 1], y_slow), _err(fast.memory[b:b + 1], slow[b].memory)
            print(f"{name} B={batch} t={t} b={b}: output error {err:.2e}, state error {err_h:.2e}")
            assert err <= 1e-12 and err_h <= 1e-12
            if fast.conv is not None:  # the projections, by one fused matmul vs three
                assert _err(fast.conv[b:b + 1], slow[b].conv) <= 1e-12


def test_deltanet_layer_is_the_op_on_its_projections():
    """The layer adds projections, conv, activation and output norm; the memory is the op's."""
    layer = DeltaNet(32, 2, use_short_conv=False, use_output_gate=False).double()
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    q, k, v = (F.silu(p(x)).reshape(2, 13, 2, 16) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    beta = torch.sigmoid(layer.b_proj(x))
    o, _ = ops.recurrent_delta_rule(q, k, v, beta, qk_norm="l2")
    expected = layer.o_proj(layer.o_norm(o).reshape(2, 13, 32))
    assert _err(layer(x)[0], expected) <= TOL


@pytest.mark.parametrize("allow_neg_eigval, upper", [(False, 1.0), (True, 2.0)])
def test_write_strength_range_reaches_the_op(monkeypatch, allow_neg_eigval, upper):
    seen = []

    def spy(q, k, v, beta, **kwargs):
        seen.append(beta.detach())
        return ops.chunk_delta_rule(q, k, v, beta, **kwargs)

    monkeypatch.setattr(deltanet_module, "chunk_delta_rule", spy)
    layer = DeltaNet(32, 2, allow_neg_eigval=allow_neg_eigval)
    torch.nn.init.normal_(layer.b_proj.weight, std=0.5)
    layer(torch.randn(1, 300, 32))
    beta = seen[0]
    print(f"allow_neg_eigval={allow_neg_eigval}: beta in [{beta.min():.3f}, {beta.max():.3f}]")
    assert beta.min() > 0 and beta.max() < upper
    assert beta.max() > 0.9 * upper  # the range is used, not just bounded


def test_gated_deltanet_decay():
    layer = GatedDeltaNet(32, 4).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    g = layer.log_decay(x)
    expected = -torch.exp(layer.A_log) * F.softplus(layer.a_proj(x) + layer.dt_bias)
    assert g.shape == (2, 5, 4) and torch.equal(g, expected) and (g <= 0).all()
    assert (torch.exp(layer.A_log) >= 1).all() and (torch.exp(layer.A_log) <= 16).all()
    dt = F.softplus(layer.dt_bias)
    assert (dt >= 1e-3 - 1e-12).all() and (dt <= 1e-1 + 1e-12).all()


def test_float32_layers_keep_float32_states():
    y, state = GatedDeltaNet(32, 2)(torch.randn(1, 4, 32))
    assert y.dtype == torch.float32 and state.memory.dtype == torch.float32


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", list(MIXERS.values()), ids=list(MIXERS))
def test_heads_must_divide_width(cls):
    with pytest.raises(ValueError, match="divisible by `n_heads`"):
        cls(30, 4)


@pytest.mark.parametrize("name", list(MIXERS))
def test_wrong_input_width(name):
    layer = MIXERS[name](32, 2)
    with pytest.raises(ValueError, match=r"`x` must have shape \[B, T, d_model=32\], got \[2, 5, 31\]"):
        layer(torch.randn(2, 5, 31))
    with pytest.raises(TypeError, match="`x` must be a floating-point tensor"):
        layer(torch.ones(2, 5, 32, dtype=torch.long))


def test_state_of_the_wrong_kind():
    _, cache = SoftmaxAttention(32, 2)(torch.randn(1, 3, 32))
    with pytest.raises(TypeError, match="`state` must be a FastWeightState"):
        DeltaNet(32, 2)(torch.randn(1, 1, 32), cache)
    _, state = DeltaNet(32, 2)(torch.randn(1, 3, 32))
    with pytest.raises(TypeError, match="`state` must be a KVCache"):
        SoftmaxAttention(32, 2)(torch.randn(1, 1, 32), state)


def test_state_for_another_batch_size():
    layer = DeltaNet(32, 2)
    _, state = layer(torch.randn(2, 3, 32))
    with pytest.raises(ValueError, match=r"`state` must have shape \[N, W-1, C\] = \[3, 3, 96\]"):
        layer(torch.randn(3, 1, 32), state)


@pytest.mark.parametrize("kwargs, match", [
    ({"activation": "gelu"}, "unknown `activation` 'gelu'"),
    ({"qk_norm": "l1"}, "unknown `qk_norm` 'l1'"),
])
def test_unknown_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeltaNet(32, 2, **kwargs)


def test_unknown_feature_map():
    with pytest.raises(ValueError, match="unknown `feature_map` 'cosine'"):
        LinearAttention(32, 2, feature_map="cosine")
