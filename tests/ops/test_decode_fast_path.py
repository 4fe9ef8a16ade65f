"""The decoding fast paths: softmax's KV cache written in place (and safe to branch from), the
fast-weight layers' fused step (its cached weights follow the parameters, its state is checked)."""

import pytest
import torch

from fastweights import ops
from fastweights.layers import DeltaNet, GatedDeltaNet, LinearAttention
from fastweights.models import LM, LMConfig
from helpers import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-12


def qkv(B, T, H, K, V, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, H, d, generator=gen, dtype=torch.float64).requires_grad_(kw.get("grad", False)) for d in (K, K, V))


def decode(q, k, v, start, stop, cache):
    outs = []
    for t in range(start, stop):
        o, cache = ops.softmax_attn(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], initial_state=cache, output_final_state=True)
        outs.append(o)
    return torch.cat(outs, 1), cache


def test_kv_cache_is_written_in_place_with_amortised_growth():
    q, k, v = qkv(2, 200, 2, 8, 4)
    _, cache = ops.softmax_attn(q[:, :10], k[:, :10], v[:, :10], output_final_state=True)
    buffers = []
    with torch.no_grad():
        for t in range(10, 200):
            _, cache = ops.softmax_attn(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], initial_state=cache, output_final_state=True)
            buffers.append(cache.keys.untyped_storage().data_ptr())
    regrowths = len(set(buffers))
    print(f"190 decode steps after a 10-token prefill: {regrowths} buffers, reserved {cache.reserved_nbytes} B for {cache.nbytes} B")
    assert regrowths <= 4  # 1.5x growth: 64, 128, 256 rows
    assert cache.keys.shape == (2, 2, 200, 8) and cache.lengths.tolist() == [200, 200]
    assert torch.equal(cache.keys, k.transpose(1, 2)) and torch.equal(cache.values, v.transpose(1, 2))
    assert cache.nbytes == 2 * 2 * 200 * (8 + 4) * 8 + 2 * 8 and cache.reserved_nbytes >= cache.nbytes


def test_branching_from_an_older_cache_is_exact():
    """Continuing twice from the same cache (beam search) must not let one branch overwrite the other's rows."""
    q, k, v = qkv(1, 30, 2, 8, 8, seed=1)
    q2, k2, v2 = qkv(1, 30, 2, 8, 8, seed=2)
    full_a, _ = ops.softmax_attn(q, k, v)
    full_b, _ = ops.softmax_attn(torch.cat([q[:, :20], q2[:, 20:]], 1), torch.cat([k[:, :20], k2[:, 20:]], 1),
                                 torch.cat([v[:, :20], v2[:, 20:]], 1))
    _, cache = ops.softmax_attn(q[:, :18], k[:, :18], v[:, :18], output_final_state=True)
    with torch.no_grad():
        _, root = decode(q, k, v, 18, 20, cache)  # root now lives in a growing buffer
        out_a, end_a = decode(q, k, v, 20, 30, root)
        out_b, _ = decode(q2, k2, v2, 20, 30, root)  # from the same root again
        again_a, _ = decode(q, k, v, 20, 30, root)
    assert_close("branch a", out_a, full_a[:, 20:], TOL)
    assert_close("branch b", out_b, full_b[:, 20:], TOL)
    assert_close("branch a again", again_a, full_a[:, 20:], TOL)
    assert torch.equal(end_a.keys, k.transpose(1, 2)) and torch.equal(end_a.values, v.transpose(1, 2))  # untouched by b
    assert torch.equal(root.keys, k[:, :20].transpose(1, 2))


def test_decode_with_autograd_keeps_gradients_exact():
    """With inputs that need gradients the rows are concatenated, not written in place,
    so a backward through several decoding steps sees the values each step used."""
    q, k, v = qkv(1, 12, 2, 4, 4, seed=3, grad=True)
    o_full, _ = ops.softmax_attn(q, k, v)
    g_full = torch.autograd.grad(o_full[:, 8:].square().sum(), (q, k, v))
    _, cache = ops.softmax_attn(q[:, :8], k[:, :8], v[:, :8], output_final_state=True)
    out, _ = decode(q, k, v, 8, 12, cache)
    g_steps = torch.autograd.grad(out.square().sum(), (q, k, v))
    for name, a, b in zip("qkv", g_steps, g_full):
        assert_close(f"d{name}", a, b, TOL)


LAYERS = {
    "deltanet": lambda: DeltaNet(32, 2, chunk_size=8),
    "gated_deltanet": lambda: GatedDeltaNet(32, 2, chunk_size=8),
    "linear": lambda: LinearAttention(32, 2, chunk_size=8),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_step_weights_follow_parameter_updates(name):
    """The fused step caches its concatenated projection weights; an in-place update (an
    optimizer step) must be seen by the next step."""
    layer = LAYERS[name]().double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with torch.no_grad():
        _, state = layer(x[:, :5])
        layer(x[:, 5:], state)  # fills the weight cache
        for p in layer.parameters():
            p.add_(0.01 * torch.randn_like(p))
        full, _ = layer(x)
        _, state = layer(x[:, :5])
        y_step, _ = layer(x[:, 5:], state)
    err = (y_step - full[:, 5:]).abs().max().item()
    print(f"{name}: step after a parameter update vs full pass: {err:.2e}")
    assert err <= 1e-10


@pytest.mark.parametrize("name", list(LAYERS))
def test_step_refuses_a_state_of_the_wrong_shape_or_dtype(name):
    layer = LAYERS[name]()
    _, state = layer(torch.randn(2, 3, 32))
    bad = type(state)(state.memory[:, :1], state.conv)
    with pytest.raises(ValueError, match=r"`state.memory` must have shape \[N, H, K, V\]"):
        layer(torch.randn(2, 1, 32), bad)
    bad = type(state)(state.memory.double(), state.conv)
    with pytest.raises(ValueError, match="dtype torch.float32"):
        layer(torch.randn(2, 1, 32), bad)


def test_lm_decode_with_grad_enabled_matches_no_grad():
    """The fused step under autograd (weights concatenated per call, gradients flow) equals the cached one."""
    model = LM(LMConfig(vocab_size=17, d_model=32, n_layers=2, n_heads=2, mixer=["deltanet", "softmax"], chunk_size=8))
    ids = torch.randint(0, 17, (2, 9))
    _, cache = model(ids[:, :8])
    logits, _ = model(ids[:, 8:], cache)
    logits.sum().backward()
    assert model.blocks[0].mixer.q_proj.weight.grad is not None
    with torch.no_grad():
        logits_ng, _ = model(ids[:, 8:], cache)
    assert_close("grad vs no_grad step", logits, logits_ng, 1e-6)
