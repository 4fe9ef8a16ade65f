"""The optional short convolution of softmax attention (``SoftmaxAttention(use_short_conv=True)``,
``LMConfig(softmax_short_conv=True)``): off by default, exact in prefill + decode, its state
carried next to the KV cache. The layer-level equivalences (prefill + decode, split prefill,
packed and left-padded rows) run in tests/layers/test_layers.py and tests/models/test_lm_features.py
with the ``softmax-conv`` variants; here: the LM, the state, the defaults and the errors."""

from __future__ import annotations

import pytest
import torch

from fastweights.layers import AttentionState, ShortConvolution, SoftmaxAttention
from fastweights.models import LM, LMConfig
from fastweights.ops import KVCache

TOL = 1e-10
VOCAB = 29

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

MODELS = {
    "softmax": "softmax",
    "softmax-deltanet": ["softmax", "deltanet"],
    "deltanet-softmax-linear": ["deltanet", "softmax", "linear"],
}


def _model(mixer, seed=0, **kw):
    torch.manual_seed(seed)
    n_layers = len(mixer) if isinstance(mixer, list) else 2
    config = LMConfig(vocab_size=VOCAB, d_model=36, n_layers=n_layers, n_heads=3, mixer=mixer, chunk_size=8,
                      max_seq_len=128, softmax_short_conv=True, **{"init_std": 0.3, **kw})
    return LM(config).double()


def _err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("prefill", [1, 2, 13, 40], ids=lambda n: f"prefill{n}")
@pytest.mark.parametrize("case", list(MODELS))
def test_lm_prefill_plus_decode_equals_full_forward(case, prefill):
    """Prefill (shorter than the kernel, too), one token at a time, and a multi-token continuation."""
    model = _model(MODELS[case], conv_size=3 if case == "softmax" else 4)
    ids = torch.randint(0, VOCAB, (3, 63), generator=torch.Generator().manual_seed(prefill))
    full, _ = model(ids)
    logits, cache = model(ids[:, :prefill])
    outs = [logits]
    for t in range(prefill, prefill + 9):
        logits, cache = model(ids[:, t:t + 1], cache)
        outs.append(logits)
    logits, cache = model(ids[:, prefill + 9:], cache)  # a multi-token call after decoding
    outs.append(logits)
    err = _err(torch.cat(outs, 1), full)
    kinds = sorted({type(s).__name__ for s in cache.states})
    print(f"{case}: prefill {prefill} + 9 steps + {63 - prefill - 9} tokens vs full, max abs logit error {err:.2e}; "
          f"states {kinds}")
    assert err <= TOL
    assert all(isinstance(s, AttentionState) for s, m in zip(cache.states, model.config.mixers) if m == "softmax")


def test_convolution_changes_the_output_and_its_state_is_carried():
    """The convolution is really applied (a zero kernel except the current tap gives plain attention),
    and its state holds the last W − 1 projected q, k, v inputs."""
    torch.manual_seed(1)
    plain = SoftmaxAttention(24, 2).double()
    conv = SoftmaxAttention(24, 2, use_short_conv=True).double()
    conv.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    y_plain, kv = plain(x)
    y_conv, state = conv(x)
    print(f"plain vs convolved output {_err(y_plain, y_conv):.2e}")
    assert _err(y_plain, y_conv) > 1e-3
    with torch.no_grad():
        conv.conv.weight.zero_()
        conv.conv.weight[:, -1] = 1.0  # identity kernel: y_t = x_t
    y_id, state = conv(x)
    print(f"identity kernel vs plain attention {_err(y_id, y_plain):.2e}")
    assert _err(y_id, y_plain) <= TOL
    qkv = torch.nn.functional.linear(x[:, -3:], torch.cat([conv.q_proj.weight, conv.k_proj.weight, conv.v_proj.weight]))
    assert state.conv.shape == (2, 3, 72) and _err(state.conv, qkv) <= TOL
    assert torch.equal(state.kv.keys, kv.keys) and torch.equal(state.lengths, kv.lengths)
    assert state.nbytes == kv.nbytes + 2 * 3 * 72 * 8


def test_off_by_default_state_dict_and_cache_unchanged():
    """Existing softmax models and checkpoints: no convolution, a bare KVCache, the same weights."""
    assert LMConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2).softmax_short_conv is False
    assert LMConfig.fill_legacy({"vocab_size": 8}).get("softmax_short_conv", False) is False
    model = LM(LMConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, mixer="softmax"))
    assert all(b.mixer.conv is None for b in model.blocks)
    assert not any("conv" in name for name in model.state_dict())
    _, cache = model(torch.randint(0, VOCAB, (2, 5)))
    assert all(type(s) is KVCache for s in cache.states)
    with_conv = _model("softmax")
    conv_names = sorted(n for n in with_conv.state_dict() if "conv" in n)
    assert conv_names == ["blocks.0.mixer.conv.weight", "blocks.1.mixer.conv.weight"]
    assert all(isinstance(b.mixer.conv, ShortConvolution) for b in with_conv.blocks)


def test_state_of_the_wrong_kind_is_refused():
    x = torch.randn(1, 3, 16)
    _, kv = SoftmaxAttention(16, 2)(x)
    _, state = SoftmaxAttention(16, 2, use_short_conv=True)(x)
    with pytest.raises(TypeError, match=r"`state` must be a AttentionState .*with a short convolution.*got KVCache"):
        SoftmaxAttention(16, 2, use_short_conv=True)(x[:, :1], kv)
    with pytest.raises(TypeError, match=r"`state` must be a KVCache .*without a short convolution.*got AttentionState"):
        SoftmaxAttention(16, 2)(x[:, :1], state)
    with pytest.raises(ValueError, match=r"ShortConvolution: `state` must have shape \[N, W-1, C\] = \[2, 3, 48\]"):
        SoftmaxAttention(16, 2, use_short_conv=True)(torch.randn(2, 1, 16), state)
    with pytest.raises(TypeError, match=r"`use_short_conv` must be true or false, got 1"):
        SoftmaxAttention(16, 2, use_short_conv=1)
    with pytest.raises(TypeError, match=r"LMConfig: `softmax_short_conv` must be true or false, got 'yes'"):
        LMConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, mixer="softmax", softmax_short_conv="yes")


def test_the_stacked_qkv_weight_is_cached_and_follows_weight_changes():
    """Without gradients the layer stacks q, k, v's weights once (the fast-weight layers' cache,
    `layers.common.cached_weights`), and an in-place change of a weight (an optimizer step, a
    load) is seen by the next call: it equals a fresh layer holding the changed weights."""
    torch.manual_seed(0)
    layer = SoftmaxAttention(24, 2, use_short_conv=True).double()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
        stacked = layer.__dict__["_qkv_weight_cache"][1][0]
        layer(x)
        assert layer.__dict__["_qkv_weight_cache"][1][0] is stacked  # not rebuilt
        layer.k_proj.weight.mul_(1.5)
        y, _ = layer(x)
        fresh = SoftmaxAttention(24, 2, use_short_conv=True).double()
        fresh.load_state_dict(layer.state_dict())
        y_fresh, _ = fresh(x)
    err = _err(y, y_fresh)
    print("after an in-place weight change: max |y - fresh layer's y| =", err)
    assert err <= TOL
