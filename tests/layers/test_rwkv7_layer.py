"""The RWKV7Attention mixer and ``LMConfig(mixer="rwkv7")``: prefill by chunks equals the recurrent
form, decoding one token at a time continues the prefill (float64, the value residual carried
across layers), packed and padded rows equal each row alone, and the LM (hybrids included) trains,
decodes from its cache, recomputes under gradient checkpointing and compiles without a graph break.
(fla's own layer against ours with its weights: tests/layers/test_fla_family_layers.py; rollback
and the session pool: tests/models/.)"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from fastweights import ops
from fastweights.layers import MIXERS, FastWeightState, RWKV7Attention
from fastweights.models import LM, LMConfig

from helpers import in_chunk_place, assert_close, assert_decode_matches_forward

pytestmark = pytest.mark.usefixtures("one_thread")

RANKS = dict(decay_low_rank_dim=8, a_low_rank_dim=8, v_low_rank_dim=6, gate_low_rank_dim=10)


def pair(**kw):
    """The first RWKV-7 layer of a stack and a later one (which mixes in the first one's values)."""
    torch.manual_seed(0)
    first = RWKV7Attention(24, 2, layer_idx=0, num_hidden_layers=2, chunk_size=8, **RANKS, **kw).double()
    second = RWKV7Attention(24, 2, layer_idx=1, num_hidden_layers=2, chunk_size=8, **RANKS, **kw).double()
    return first, second


def run(layers, x, states=None, **kw):
    """Both layers on the same input, one value-residual dict: ``(outputs, states)``."""
    shared, ys, out = {}, [], []
    for i, layer in enumerate(layers):
        y, s = layer(x, None if states is None else states[i], value_residual=shared, **kw)
        ys.append(y)
        out.append(s)
    return ys, out


def test_chunk_prefill_equals_the_recurrent_form_and_decoding_continues_it(monkeypatch):
    layers = pair()
    x = torch.randn(2, 21, 24, dtype=torch.float64)
    ys, states = run(layers, x)
    with monkeypatch.context() as patch:  # the same layers on the recurrent op
        patch.setattr("fastweights.layers.rwkv7.chunk_dplr_delta_rule", in_chunk_place(ops.recurrent_dplr_delta_rule))
        ys_ref, states_ref = run(layers, x)
    for i in range(2):
        assert_close(f"layer {i} chunk vs recurrent", ys[i], ys_ref[i], 1e-12)
        assert_close(f"layer {i} state", states[i].memory, states_ref[i].memory, 1e-12)
    _, s = run(layers, x[:, :13])
    outs = [[], []]
    for t in range(13, 21):
        y_t, s = run(layers, x[:, t:t + 1], s)  # one decoding step per layer (dplr_step)
        for i in range(2):
            outs[i].append(y_t[i])
        assert s[0].memory.shape == (2, 2, 12, 12) and s[0].conv.shape == (2, 1, 24)  # constant size
    for i in range(2):
        assert_close(f"layer {i} decode steps vs prefill", torch.cat(outs[i], 1), ys[i][:, 13:], 1e-12)


def test_prefill_continues_from_a_state_and_packed_and_padded_rows_equal_each_row_alone():
    layers = pair()
    x = torch.randn(1, 30, 24, dtype=torch.float64)
    ys, states = run(layers, x, cu_seqlens=torch.tensor([0, 7, 8, 30]))  # uneven, one of a single token
    for n, (a, b) in enumerate([(0, 7), (7, 8), (8, 30)]):
        ys_n, states_n = run(layers, x[:, a:b])
        for i in range(2):
            assert_close(f"packed row {n}, layer {i}", ys[i][:, a:b], ys_n[i], 1e-12)
            assert_close(f"packed state {n}, layer {i}", states[i].memory[n:n + 1], states_n[i].memory, 1e-12)
            assert torch.equal(states[i].conv[n:n + 1], states_n[i].conv)
    _, first = run(layers, x[:, :11])  # a prefill continued from a state equals one prefill
    ys_more, _ = run(layers, x[:, 11:], first)
    ys_all, _ = run(layers, x)
    for i in range(2):
        assert_close(f"continued prefill, layer {i}", ys_more[i], ys_all[i][:, 11:], 1e-12)
    pad = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])  # left padding: pads are never read
    xb = torch.randn(2, 8, 24, dtype=torch.float64)
    ys_pad, _ = run(layers, xb, attention_mask=pad)
    ys_alone, _ = run(layers, xb[:1, 3:])
    assert_close("padded row vs alone", ys_pad[1][:1, 3:], ys_alone[1], 1e-12)


def test_bad_input_and_options():
    first, second = pair()
    x = torch.randn(1, 5, 24, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"layer_idx=1 mixes in the first RWKV-7 layer's values: pass the dict"):
        second(x)
    with pytest.raises(ValueError, match=r"`cp_group`\) is not supported by the DPLR ops"):
        first(x, cp_group=object())
    _, state = first(x)
    with pytest.raises(ValueError, match=r"`state.memory` must have shape \[N, H, K, V\] = \[2, 2, 12, 12\]"):
        first(torch.randn(2, 1, 24, dtype=torch.float64), state)
    with pytest.raises(ValueError, match=r"`state.conv` \(the last token, for the token shift\)"):
        first(x[:, :1], FastWeightState(state.memory, None))
    with pytest.raises(ValueError, match=r"RWKV7Attention: `d_model`=24 must be divisible by `n_heads`=5"):
        RWKV7Attention(24, 5)
    with pytest.raises(ValueError, match=r"`layer_idx` must be an int >= 0"):
        RWKV7Attention(24, 2, layer_idx=-1)
    with pytest.raises(ValueError, match=r"`d_model` and `hidden_size` disagree"):
        RWKV7Attention(24, 2, hidden_size=32)
    assert RWKV7Attention(hidden_size=128, head_dim=64).n_heads == 2  # fla's names
    layer = RWKV7Attention(64, 4)  # the paper's low-rank sizes (at least 32)
    assert layer.w_lora.down.out_features == 32 and layer.v_lora is None


def tiny_lm(mixer, **kw):
    config = LMConfig(vocab_size=31, d_model=16, n_layers=len(mixer), n_heads=2, mixer=mixer, chunk_size=8, **kw)
    torch.manual_seed(0)
    return LM(config)


@pytest.mark.parametrize("mixer", [["rwkv7", "rwkv7"], ["softmax", "rwkv7", "deltanet", "rwkv7"]], ids=["rwkv7", "hybrid"])
def test_lm_trains_decodes_and_recomputes(mixer):
    assert "rwkv7" in MIXERS
    model = tiny_lm(mixer)
    assert [b.mixer.layer_idx for b in model.blocks if b.mixer_name == "rwkv7"] == [0, 1]
    ids = torch.randint(0, 31, (2, 19))
    logits, _ = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    first = next(i for i, m in enumerate(mixer) if m == "rwkv7")
    grads = {n: p.grad for n, p in model.named_parameters() if f"blocks.{first}.mixer" in n}
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads.values())
    model64 = tiny_lm(mixer).double()
    loss = model64(ids)[0].square().mean()
    plain = torch.autograd.grad(loss, list(model64.parameters()))
    model64.gradient_checkpointing = True
    model64.train()
    loss_ckpt = model64(ids)[0].square().mean()
    ckpt = torch.autograd.grad(loss_ckpt, list(model64.parameters()))
    assert all((a - b).abs().max() <= 1e-12 * (1 + a.abs().max()) for a, b in zip(plain, ckpt))
    model64.eval()
    assert_decode_matches_forward(model64, ids, 12, 19)


def test_lm_compiles_without_a_graph_break():
    ids = torch.randint(0, 31, (2, 19))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(tiny_lm(["rwkv7", "rwkv7"]))(ids)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
