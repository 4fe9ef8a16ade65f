"""The KimiDeltaAttention mixer and ``LMConfig(mixer="kda")``: prefill by chunks equals the
recurrent form, decoding through the fused one-token step equals prefill with a constant-size
state, packed sequences equal each row alone, and the LM trains, decodes and compiles without
a graph break."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from fastweights import ops
from fastweights.layers import KimiDeltaAttention, MIXERS
from fastweights.models import LM, LMConfig

from helpers import in_chunk_place, assert_close

pytestmark = pytest.mark.usefixtures("one_thread")


def layer(**kw):
    torch.manual_seed(0)
    return KimiDeltaAttention(d_model=24, n_heads=2, chunk_size=8, **kw).double()


def test_chunk_prefill_equals_the_recurrent_form_and_decoding_continues_it(monkeypatch):
    mixer = layer()
    x = torch.randn(2, 21, 24, dtype=torch.float64)
    y, state = mixer(x)
    with monkeypatch.context() as patch:  # the same layer on the recurrent op
        import fastweights.layers.kda as kda_layer

        patch.setattr(kda_layer, "chunk_kda", in_chunk_place(ops.recurrent_kda))
        y_ref, state_ref = mixer(x)
    assert_close("KDA layer chunk vs recurrent", y, y_ref, 1e-12)
    assert_close("KDA layer state", state.memory, state_ref.memory, 1e-12)
    # prefill 16 tokens, then 5 decoding steps (the fused step): equal to prefilling all 21
    _, s = mixer(x[:, :16])
    outs = []
    for t in range(16, 21):
        y_t, s = mixer(x[:, t:t + 1], s)
        outs.append(y_t)
        assert s.memory.shape == (2, 2, 12, 12)  # constant, whatever the context
    assert_close("KDA decode steps vs prefill", torch.cat(outs, 1), y[:, 16:], 1e-12)


def test_grouped_value_heads_and_packed_rows():
    mixer = layer(num_v_heads=4, expand_v=0.5)
    x = torch.randn(1, 30, 24, dtype=torch.float64)
    cu = torch.tensor([0, 7, 30])
    y, state = mixer(x, cu_seqlens=cu)
    for i, (a, b) in enumerate([(0, 7), (7, 30)]):
        y_i, s_i = mixer(x[:, a:b])
        assert_close(f"packed row {i}", y[:, a:b], y_i, 1e-12)
        assert_close(f"packed state {i}", state.memory[i:i + 1], s_i.memory, 1e-12)


def test_lm_with_kda_trains_decodes_and_compiles():
    assert "kda" in MIXERS
    config = LMConfig(vocab_size=31, d_model=16, n_layers=2, n_heads=2, mixer=["kda", "softmax"], chunk_size=8)
    torch.manual_seed(0)
    model = LM(config)
    ids = torch.randint(0, 31, (2, 19))
    logits, _ = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    grads = [p.grad for n, p in model.named_parameters() if "mixer" in n and "blocks.0" in n]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    out = model.generate(ids[:, :5], 6, temperature=0)
    assert out.shape == (2, 11)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(LM(LMConfig(vocab_size=31, d_model=16, n_layers=1, n_heads=2, mixer="kda",
                                                   chunk_size=8)))(ids)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
