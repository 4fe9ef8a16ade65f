"""Speculative decoding on transformers' own linear-attention hybrids routed onto our ops.

With ``use_fastweights_kernels()``, ``generate(prompt_lookup_num_tokens=3)`` and
``generate(assistant_model=...)`` run on Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Kimi Linear,
OLMo-hybrid and Qwen4-exp (tiny random configs) and give exactly plain greedy's tokens; the
recurrent states roll back by replaying the accepted tokens (``fastweights/hf/rollback.py``)
and after every verify the cache is back to its constant size. Without routing transformers
still refuses, as before. Qwen4-exp also gets the parity check the other routed models have:
routed prefill and cached decoding against transformers' own torch path.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastweights.hf as fh  # noqa: E402
from fastweights.hf import rollback  # noqa: E402

from helpers import rel_err  # noqa: E402
from test_hf import tiny_qwen3_next  # noqa: E402
from test_hf_models_kda import CONV, DELTA, MODELS as KDA_MODELS, VOCAB  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def qwen4_exp():
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    cfg = Qwen4ExpTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], max_position_embeddings=128,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=64, indexer_compress_ratio=4,
    )
    return Qwen4ExpForCausalLM(cfg)


MODELS = {"qwen3_next": tiny_qwen3_next, **KDA_MODELS, "qwen4_exp": qwen4_exp}


def _repeating_prompt():
    block = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    return torch.cat([block, block, block[:, :2]], 1)


@pytest.fixture
def routed():
    fh.use_fastweights_kernels()
    yield
    fh.use_fastweights_kernels(False)


@pytest.mark.parametrize("name", list(MODELS))
def test_prompt_lookup_and_assistant_give_greedy_tokens(name, routed, monkeypatch):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    prompt = _repeating_prompt()
    greedy = dict(do_sample=False, max_new_tokens=14, pad_token_id=0)
    crops = []
    patched = transformers.cache_utils.LinearAttentionCacheLayerMixin.crop
    assert getattr(patched, "fastweights_rollback", False)

    def crop(self, n):
        out = patched(self, n)
        sizes = [self.conv_states[i].shape[-1] == self.conv_kernel_size[i] for i in self.conv_states
                 if self.is_conv_states_initialized[i]]
        crops.append((n, all(sizes), not self.__dict__.get("_fw_windows")))
        return out

    monkeypatch.setattr(transformers.cache_utils.LinearAttentionCacheLayerMixin, "crop", crop)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = model.generate(prompt, **greedy)
        lookup = model.generate(prompt, prompt_lookup_num_tokens=3, **greedy)
        by_lookup = sum(-n for n, _, _ in crops)
        itself = model.generate(prompt, assistant_model=model, **greedy)
    print(f"{name}: {len(crops)} crops of linear-attention layers removing {sum(-n for n, _, _ in crops)} tokens "
          f"({by_lookup} by prompt lookup)")
    assert torch.equal(lookup, plain) and torch.equal(itself, plain)
    assert by_lookup > 0  # rejected proposals were rolled back, and the tokens are still greedy's
    assert all(constant and closed for _, constant, closed in crops)  # back to constant size after each verify


def test_without_routing_transformers_still_refuses():
    torch.manual_seed(0)
    model = tiny_qwen3_next()
    with pytest.raises(ValueError, match="assisted generation is not supported with stateful models"):
        model.generate(_repeating_prompt(), prompt_lookup_num_tokens=3, max_new_tokens=4, do_sample=False)
    assert not rollback._saved


def test_qwen4_exp_on_our_ops_equals_its_torch_path():
    module = importlib.import_module("transformers.models.qwen4_exp.modeling_qwen4_exp")
    torch.manual_seed(0)
    model = qwen4_exp().eval()
    attrs = [a for a, _ in DELTA + CONV if hasattr(module, a)]
    decorated = {a: getattr(module, a) for a in attrs}
    ids = torch.randint(3, VOCAB, (2, 21), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    try:
        with fh.kernels.torch_fallbacks(module, attrs), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_logits, ref = model(ids).logits, model.generate(ids, **kw)
        changed = fh.use_fastweights_kernels()
        assert {f"{module.__name__}.{a}" for a in attrs} <= set(changed), changed
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits, ours = model(ids).logits, model.generate(ids, **kw)
    finally:
        fh.use_fastweights_kernels(False)
        for a in attrs:
            setattr(module, a, decorated[a])
    prefill = rel_err(logits, ref_logits)
    decode = max(rel_err(a, b) for a, b in zip(ours.logits, ref.logits))
    print(f"qwen4_exp, our ops vs transformers' torch path: prefill logits rel {prefill:.1e}, cached decode rel {decode:.1e}")
    assert torch.equal(ours.sequences, ref.sequences)
    assert prefill <= 1e-4 and decode <= 1e-4


def test_crop_replays_the_accepted_tokens(routed):
    """A recorded window of 5 tokens cropped by 3 continues as the prompt + the 2 kept tokens read plainly
    (Qwen3-Next, float32: the replay is the same op on the kept prefix, so rounding-level only)."""
    torch.manual_seed(0)
    model = tiny_qwen3_next()
    gen = torch.Generator().manual_seed(4)
    prompt, window, nxt = (torch.randint(3, 64, (1, n), generator=gen) for n in (11, 5, 1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = model(prompt, use_cache=True).past_key_values
        cache.activate_past_recording()
        cache = model(window, cache=cache, use_cache=True).past_key_values
        assert cache.is_croppable
        cache.crop(-3)
        got = model(nxt, cache=cache, use_cache=True).logits
        ref_cache = model(torch.cat([prompt, window[:, :2]], 1), use_cache=True).past_key_values
        want = model(nxt, cache=ref_cache, use_cache=True).logits
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)
