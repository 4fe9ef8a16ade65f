"""transformers' gated-delta and KDA models on our ops (``fastweights.hf.use_fastweights_kernels``).

Tiny random configs (built here, no network) of Kimi Linear (KDA), Qwen3.5, Qwen3.5-MoE and
OLMo-hybrid (β ∈ [0, 2] with ``linear_allow_neg_eigval``). Each model runs once on
transformers' own pure-torch fallbacks (the delta-rule kernels and the causal convolution)
and once routed to our ops; prefill logits agree to rel ≤ 1e-4 in fp32 and cached greedy
decoding gives the same tokens. ``enable=False`` puts every original back.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastweights.hf as fh  # noqa: E402

from helpers import rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def kimi_linear():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        layer_types=["linear_attention", "full_attention"], linear_head_dim=12, linear_num_heads=3,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return KimiLinearForCausalLM(cfg)


def qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, layer_types=["linear_attention", "full_attention"], max_position_embeddings=128,
    )
    return Qwen3_5ForCausalLM(cfg)


def qwen3_5_moe():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], max_position_embeddings=128,
    )
    return Qwen3_5MoeForCausalLM(cfg)


def olmo_hybrid():
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    cfg = OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=12,
        layer_types=["linear_attention", "full_attention"], linear_allow_neg_eigval=True,
        max_position_embeddings=128, pad_token_id=0, eos_token_id=2,
    )
    return OlmoHybridForCausalLM(cfg)


MODELS = {"kimi_linear": kimi_linear, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe, "olmo_hybrid": olmo_hybrid}
KERNEL_NAMES = {  # the module's decorated fallbacks: (attribute, kernel name)
    "kimi_linear": [("chunk_kimi_delta_attention", "chunk_kda"), ("recurrent_kimi_delta_attention", "fused_recurrent_kda")],
}
DELTA = [("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"),
         ("torch_recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule")]
CONV = [("causal_conv1d_fn", "causal_conv1d_fn"), ("causal_conv1d_update", "causal_conv1d_update")]


@pytest.mark.parametrize("name", list(MODELS))
def test_model_on_our_ops_equals_its_torch_path(name):
    import importlib

    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    attrs = [a for a, _ in KERNEL_NAMES.get(name, DELTA) + CONV]
    decorated = {a: getattr(module, a) for a in attrs}
    ids = torch.randint(3, VOCAB, (2, 21), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    try:
        # the reference: transformers' own pure-torch fallbacks
        with fh.kernels.torch_fallbacks(module, attrs), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_logits, ref = model(ids).logits, model.generate(ids, **kw)
        changed = fh.use_fastweights_kernels()
        assert {f"{module.__name__}.{a}" for a in attrs} <= set(changed), changed
        assert all(getattr(module, a).fastweights_kernel for a in attrs)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits, ours = model(ids).logits, model.generate(ids, **kw)
        ours_warned = [str(w.message) for w in caught if "fastweights" in str(w.filename)]
        assert not ours_warned, ours_warned
    finally:
        restored = fh.use_fastweights_kernels(False)
        for a in attrs:
            setattr(module, a, decorated[a])
    prefill = rel_err(logits, ref_logits)
    decode = max(rel_err(a, b) for a, b in zip(ours.logits, ref.logits))
    print(f"{name}, our ops vs transformers' torch path: prefill logits rel {prefill:.1e}, cached decode rel {decode:.1e}")
    assert torch.equal(ours.sequences, ref.sequences)
    assert prefill <= 1e-4 and decode <= 1e-4
    assert {f"{module.__name__}.{a}" for a in attrs} <= set(restored)


def test_enable_false_restores_every_original():
    import transformers.models.kimi_linear.modeling_kimi_linear as kimi
    import transformers.models.olmo_hybrid.modeling_olmo_hybrid as olmo

    attrs = [(kimi, a) for a, _ in KERNEL_NAMES["kimi_linear"] + CONV] + [(olmo, a) for a, _ in DELTA + CONV]
    before = {(m.__name__, a): getattr(m, a) for m, a in attrs}
    fh.use_fastweights_kernels()
    assert all(getattr(getattr(m, a), "fastweights_kernel", None) for m, a in attrs)
    fh.use_fastweights_kernels(False)
    assert all(getattr(m, a) is before[(m.__name__, a)] for m, a in attrs)


def test_conv_functions_match_transformers_fallbacks_and_refuse_what_they_cannot_do():
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen

    gen = torch.Generator().manual_seed(4)
    x, w, bias = torch.randn(2, 6, 9, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    for act in (None, "silu"):
        want = qwen.causal_conv1d_fn.__wrapped__(x, w, bias, act)
        assert rel_err(fh.causal_conv1d_fn(x, w, bias, act), want) < 1e-6
        state_ref, state = torch.randn(2, 6, 4, generator=gen), None
        state = state_ref.clone()
        step = x[:, :, :1]
        want = qwen.causal_conv1d_update.__wrapped__(step, state_ref, w, bias, act)
        assert rel_err(fh.causal_conv1d_update(step, state, w, bias, act), want) < 1e-6
        assert torch.equal(state, state_ref)
    with pytest.raises(ValueError, match="`activation` 'gelu'"):
        fh.causal_conv1d_fn(x, w, activation="gelu")
    with pytest.raises(ValueError, match="`seq_idx` is not supported"):
        fh.causal_conv1d_fn(x, w, seq_idx=torch.zeros(2, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least W − 1 = 3 inputs, got 2"):
        fh.causal_conv1d_update(x[:, :, :1], torch.zeros(2, 6, 2), w)


def test_olmo_beta_range_is_widened_only_for_olmo():
    """β = 2·sigmoid reaches our op with ``allow_neg_eigval=True`` from OLMo-hybrid; the op's own
    default still refuses β > 1."""
    from fastweights import ops

    q = k = torch.nn.functional.normalize(torch.randn(1, 4, 1, 4), dim=-1)
    v, g, beta = torch.randn(1, 4, 1, 3), -torch.rand(1, 4, 1), torch.full((1, 4, 1), 1.5)
    with pytest.raises(ValueError, match=r"`beta` must lie in \[0, 1\]"):
        ops.chunk_gated_delta_rule(q, k, v, g, beta)
    ops.chunk_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True)
    assert fh.kernels.MODEL_OPTIONS[("modeling_olmo_hybrid", "chunk_gated_delta_rule")] == {"allow_neg_eigval": True}
