"""The GatedDeltaNet2 and DeltaProduct mixers and ``LMConfig(mixer="gdn2" | "deltaproduct")``:
prefill by chunks equals the recurrent form, decoding through the fused one-token step equals
prefill with a constant-size state (float64), packed rows equal each row alone, and the LM
(hybrids included) trains, decodes and compiles without a graph break."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from fastweights import ops
from fastweights.layers import MIXERS, DeltaProduct, GatedDeltaNet2
from fastweights.models import LM, LMConfig

from helpers import in_chunk_place, assert_close, assert_decode_matches_forward

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {
    "gdn2": (GatedDeltaNet2, {}, "fastweights.layers.gdn2", "chunk_gdn2", ops.recurrent_gdn2),
    "gdn2-neg": (GatedDeltaNet2, dict(allow_neg_eigval=True), "fastweights.layers.gdn2", "chunk_gdn2",
                 ops.recurrent_gdn2),
    "deltaproduct-2": (DeltaProduct, dict(num_householder=2, allow_neg_eigval=True), "fastweights.layers.delta_product",
                       "chunk_gated_delta_product", ops.recurrent_gated_delta_product),
    "deltaproduct-3": (DeltaProduct, dict(num_householder=3), "fastweights.layers.delta_product",
                       "chunk_gated_delta_product", ops.recurrent_gated_delta_product),
}


def layer(cls, **kw):
    torch.manual_seed(0)
    return cls(d_model=24, n_heads=2, chunk_size=8, **kw).double()


@pytest.mark.parametrize("case", list(CASES))
def test_chunk_prefill_equals_the_recurrent_form_and_decoding_continues_it(case, monkeypatch):
    cls, kw, module, chunk_name, recurrent = CASES[case]
    mixer = layer(cls, **kw)
    x = torch.randn(2, 21, 24, dtype=torch.float64)
    y, state = mixer(x)
    with monkeypatch.context() as patch:  # the same layer on the recurrent op
        patch.setattr(f"{module}.{chunk_name}", in_chunk_place(recurrent))
        y_ref, state_ref = mixer(x)
    assert_close(f"{case} layer chunk vs recurrent", y, y_ref, 1e-12)
    assert_close(f"{case} layer state", state.memory, state_ref.memory, 1e-12)
    _, s = mixer(x[:, :16])
    outs = []
    for t in range(16, 21):
        y_t, s = mixer(x[:, t:t + 1], s)  # the fused decoding step
        outs.append(y_t)
        assert s.memory.shape == (2, 2, 12, 12)  # constant, whatever the context
    assert_close(f"{case} decode steps vs prefill", torch.cat(outs, 1), y[:, 16:], 1e-12)


@pytest.mark.parametrize("case", ["gdn2", "deltaproduct-2"])
def test_packed_rows_equal_each_row_alone(case):
    cls, kw, *_ = CASES[case]
    mixer = layer(cls, **kw)
    x = torch.randn(1, 30, 24, dtype=torch.float64)
    y, state = mixer(x, cu_seqlens=torch.tensor([0, 7, 30]))
    for i, (a, b) in enumerate([(0, 7), (7, 30)]):
        y_i, s_i = mixer(x[:, a:b])
        assert_close(f"packed row {i}", y[:, a:b], y_i, 1e-12)
        assert_close(f"packed state {i}", state.memory[i:i + 1], s_i.memory, 1e-12)


def test_gdn2_grouped_value_heads():
    mixer = layer(GatedDeltaNet2, num_v_heads=4, expand_v=0.5)
    x = torch.randn(2, 13, 24, dtype=torch.float64)
    y, state = mixer(x)
    _, s = mixer(x[:, :9])
    outs = []
    for t in range(9, 13):  # the general (unfused) decoding path: the recurrent op
        y_t, s = mixer(x[:, t:t + 1], s)
        outs.append(y_t)
    assert_close("GDN-2 grouped heads decode vs prefill", torch.cat(outs, 1), y[:, 9:], 1e-12)


def test_bad_layer_options():
    with pytest.raises(ValueError, match="DeltaProduct: `num_householder` must be an int >= 1, got 0"):
        DeltaProduct(24, 2, num_householder=0)
    with pytest.raises(ValueError, match=r"DeltaProduct: `num_v_heads` must equal `n_heads` \(2\), got 4"):
        DeltaProduct(24, 2, num_v_heads=4)


@pytest.mark.parametrize("mixer", [["gdn2", "softmax"], ["deltaproduct", "gated_deltanet"]], ids=["gdn2", "deltaproduct"])
def test_lm_trains_decodes_and_compiles(mixer):
    assert all(m in MIXERS for m in mixer)
    config = LMConfig(vocab_size=31, d_model=16, n_layers=2, n_heads=2, mixer=mixer, chunk_size=8)
    torch.manual_seed(0)
    model = LM(config)
    ids = torch.randint(0, 31, (2, 19))
    logits, _ = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    grads = [p.grad for n, p in model.named_parameters() if "blocks.0.mixer" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    model64 = LM(config).double().eval()
    assert_decode_matches_forward(model64, ids, 12, 19)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(LM(LMConfig(vocab_size=31, d_model=16, n_layers=1, n_heads=2, mixer=mixer[0],
                                                   chunk_size=8)))(ids)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]


def test_lm_config_sets_the_householder_steps():
    """``LMConfig.num_householder`` reaches every DeltaProduct layer, survives a JSON round trip, and a
    bad value is refused naming it."""
    from fastweights.models import LM, LMConfig

    config = LMConfig(vocab_size=8, d_model=16, n_layers=2, n_heads=2, mixer=["deltaproduct", "deltanet"],
                      num_householder=3, allow_neg_eigval=True)
    model = LM(config)
    assert model.blocks[0].mixer.num_householder == 3
    assert LMConfig.from_dict(config.to_dict()).num_householder == 3
    assert LMConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2).num_householder == 2
    with pytest.raises(ValueError, match="`num_householder`"):
        LMConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, num_householder=0)
