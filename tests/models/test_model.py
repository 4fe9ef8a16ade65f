"""The LM: prefill + step decoding equals a full forward pass (float64); the cache of
fast-weight mixers has one size at any context length while softmax's grows;
generation; the config; bad input."""

from __future__ import annotations

import json

import pytest
import torch

from fastweights.models import LM, LMCache, LMConfig

MIXER_CASES = {
    "softmax": "softmax",
    "linear": "linear",
    "deltanet": "deltanet",
    "gated_deltanet": "gated_deltanet",
    "hybrid": ["deltanet", "softmax", "gated_deltanet", "linear"],
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def small_config(mixer, **kw):
    n_layers = len(mixer) if isinstance(mixer, list) else 2
    return LMConfig(vocab_size=37, d_model=40, n_layers=n_layers, n_heads=2, mixer=mixer, chunk_size=8,
                    max_seq_len=512, **kw)


@pytest.mark.parametrize("case", list(MIXER_CASES))
def test_prefill_plus_decoding_equals_full_forward(case):
    model = LM(small_config(MIXER_CASES[case])).double()
    ids = torch.randint(0, 37, (3, 45))
    full, _ = model(ids)
    logits, cache = model(ids[:, :21])  # prefill: chunk ops
    steps = [logits]
    for t in range(21, 45):  # decoding: recurrent ops, one token at a time
        logits, cache = model(ids[:, t:t + 1], cache)
        steps.append(logits)
    err = (torch.cat(steps, 1) - full).abs().max().item()
    print(f"{case}: prefill(21) + 24 decode steps vs full forward, max abs logit error {err:.2e}")
    assert err <= 1e-10
    assert cache.length == 45


@pytest.mark.parametrize("case", list(MIXER_CASES))
def test_cache_size_constant_for_fast_weights_growing_for_softmax(case):
    model = LM(small_config(MIXER_CASES[case]))
    sizes = {}
    for length in (16, 400):
        _, cache = model(torch.randint(0, 37, (1, length)))
        sizes[length] = cache.nbytes
    # and after decoding further, one token at a time
    for _ in range(3):
        _, cache = model(torch.randint(0, 37, (1, 1)), cache)
    print(f"{case}: cache.nbytes at 16 / 400 / 403 tokens: {sizes[16]} / {sizes[400]} / {cache.nbytes}")
    n_softmax = model.config.mixers.count("softmax")
    per_token = n_softmax * 2 * 40 * 4  # keys + values of each softmax layer, fp32
    assert sizes[400] - sizes[16] == 384 * per_token
    assert cache.nbytes - sizes[400] == 3 * per_token
    if n_softmax == 0:
        assert sizes[16] == sizes[400] == cache.nbytes


def test_generate_matches_greedy_recomputation():
    torch.manual_seed(1)
    model = LM(small_config("gated_deltanet")).double()
    prompt = torch.randint(0, 37, (2, 9))
    out = model.generate(prompt, 12, temperature=0)
    ids = prompt
    for _ in range(12):  # no cache: the whole sequence again for every token
        logits, _ = model(ids, return_cache=False)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


def test_generate_sampling_is_reproducible_and_1d_prompts_work():
    model = LM(small_config("deltanet"))
    prompt = torch.randint(0, 37, (7,))
    a = model.generate(prompt, 10, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 10, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(3))
    assert a.shape == (17,) and torch.equal(a, b) and torch.equal(a[:7], prompt)


def test_generate_memory_is_constant_for_deltanet():
    model = LM(small_config("deltanet"))
    prompt = torch.randint(0, 37, (1, 5))
    _, short = model.generate(prompt, 3, return_cache=True)
    _, long = model.generate(prompt, 60, return_cache=True)
    assert long.length > short.length and long.nbytes == short.nbytes


def test_tied_and_untied_embeddings():
    tied, untied = LM(small_config("linear")), LM(small_config("linear", tie_embeddings=False))
    assert tied.lm_head.weight is tied.embed.weight
    assert untied.lm_head.weight is not untied.embed.weight
    assert untied.num_parameters() - tied.num_parameters() == 37 * 40


def test_blocks_are_pre_norm_swiglu():
    model = LM(small_config("deltanet", mlp_hidden=24))
    block = model.blocks[0]
    assert block.mlp.gate.weight.shape == (24, 40) and block.mlp.down.weight.shape == (40, 24)
    assert LMConfig(vocab_size=5, d_model=48, n_layers=1, n_heads=2).mlp_width == 128  # 8/3·48


def test_config_json_round_trip(tmp_path):
    config = small_config(["deltanet", "softmax"])
    path = tmp_path / "config.json"
    config.to_json(path)
    assert LMConfig.from_json(path) == config
    assert LMConfig.from_json(config.to_json()) == config


# -- bad input -------------------------------------------------------------------------------


def test_unknown_mixer():
    with pytest.raises(ValueError, match=r"unknown `mixer` 'mamba'; expected one of softmax, linear, deltanet, gated_deltanet"):
        LMConfig(vocab_size=10, d_model=32, n_layers=2, n_heads=2, mixer="mamba")
    with pytest.raises(ValueError, match="unknown `mixer` 'rwkv' at layer 1"):
        LMConfig(vocab_size=10, d_model=32, n_layers=2, n_heads=2, mixer=["deltanet", "rwkv"])


def test_mixer_list_must_match_layers():
    with pytest.raises(ValueError, match=r"`mixer` lists 3 mixers but `n_layers`=2"):
        LMConfig(vocab_size=10, d_model=32, n_layers=2, n_heads=2, mixer=["deltanet"] * 3)


def test_mismatched_dimensions():
    with pytest.raises(ValueError, match=r"`d_model`=30 must be divisible by `n_heads`=4"):
        LMConfig(vocab_size=10, d_model=30, n_layers=2, n_heads=4)
    with pytest.raises(ValueError, match="`vocab_size` must be a positive int"):
        LMConfig(vocab_size=0, d_model=32, n_layers=2, n_heads=2)


def test_unknown_config_keys(tmp_path):
    data = {"vocab_size": 10, "d_model": 32, "n_layers": 1, "n_heads": 2, "n_head": 4}
    with pytest.raises(ValueError, match=r"unknown config key\(s\).*'n_head' \(did you mean 'n_heads'\?\)"):
        LMConfig.from_dict(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown config key"):
        LMConfig.from_json(path)


def test_prompt_longer_than_the_model_allows():
    """``max_seq_len`` caps models with a softmax layer (a hybrid included)..."""
    model = LM(LMConfig(vocab_size=10, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, mixer=["deltanet", "softmax"]))
    with pytest.raises(ValueError, match=r"the prompt has 17 tokens, more than the model allows \(`max_seq_len`=16\)"):
        model.generate(torch.zeros(1, 17, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="more than `max_seq_len`=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("mixer", ["linear", "deltanet", "gated_deltanet"])
def test_max_seq_len_does_not_cap_fast_weight_models(mixer):
    """...but not a model whose every layer has a fixed-size state."""
    model = LM(LMConfig(vocab_size=10, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, mixer=mixer))
    logits, cache = model(torch.zeros(1, 40, dtype=torch.long))
    out = model.generate(torch.zeros(1, 40, dtype=torch.long), 3)
    assert logits.shape == (1, 40, 10) and cache.length == 40 and out.shape == (1, 43)


def test_token_ids_outside_the_vocabulary():
    model = LM(LMConfig(vocab_size=10, d_model=32, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\)"):
        model(torch.tensor([[1, 10]]))
    with pytest.raises(TypeError, match="int64 tensor"):
        model(torch.zeros(1, 3))


def test_cache_from_another_batch_or_model():
    model = LM(small_config("deltanet"))
    _, cache = model(torch.randint(0, 37, (2, 5)))
    with pytest.raises(ValueError, match="`cache` holds 2 sequences but `input_ids` has batch size 3"):
        model(torch.randint(0, 37, (3, 1)), cache)
    other = LM(small_config("softmax"))
    with pytest.raises(ValueError, match="mixers"):
        other(torch.randint(0, 37, (2, 1)), cache)
    with pytest.raises(TypeError, match="LMCache"):
        model(torch.randint(0, 37, (2, 1)), cache.states)
    assert isinstance(cache, LMCache)


def test_mlp_hidden_zero_builds_mixer_only_blocks():
    """``mlp_hidden=0``: no MLP (Zoology's MQAR models); the model trains, decodes and rejects negatives."""
    model = LM(small_config("deltanet", mlp_hidden=0))
    assert all(block.mlp is None and block.mlp_norm is None for block in model.blocks)
    with_mlp = LM(small_config("deltanet"))
    assert model.num_parameters() < with_mlp.num_parameters()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    logits, _ = model(ids, return_cache=False)
    logits.sum().backward()
    assert logits.shape == (2, 9, model.config.vocab_size)
    with pytest.raises(ValueError, match="mlp_hidden"):
        small_config("deltanet", mlp_hidden=-1)


def test_the_mlp_width_is_mlp_width_and_its_old_name_warns():
    """``LMConfig.hidden_size`` was the MLP width (transformers' ``hidden_size`` is d_model): it is
    ``mlp_width`` now, and the old name still answers the same number, with a DeprecationWarning."""
    config = LMConfig(vocab_size=5, d_model=48, n_layers=1, n_heads=2, mlp_hidden=40)
    assert config.mlp_width == 40
    with pytest.warns(DeprecationWarning, match="mlp_width"):
        assert config.hidden_size == 40
    assert LMConfig(vocab_size=5, d_model=48, n_layers=1, n_heads=2, mlp_hidden=0).mlp_width == 0
