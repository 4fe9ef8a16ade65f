"""transformers' assisted generation on fastweights models: prompt lookup and a draft model.

transformers 5.24 needs the model's cache to be croppable (``is_croppable``, ``crop(-n)``)
and to record its past for the assistant (``activate_past_recording``); both are
:class:`~fastweights.hf.FastWeightsCache`'s, for every mixer. Greedy tokens must be those
of plain greedy generation.
"""

from __future__ import annotations

import pytest
import torch

import fastweights.hf  # noqa: F401  (registers the model type)
from fastweights.hf import FastWeightsCache, FastWeightsConfig
from transformers import AutoModelForCausalLM

# name -> (LMConfig.mixer, extra config): every mixer alone, and a hybrid with a convolved softmax layer
MIXERS = {name: (name, {}) for name in ("deltanet", "gated_deltanet", "linear", "kda", "softmax")}
MIXERS["hybrid"] = (["deltanet", "softmax", "gated_deltanet"], {"softmax_short_conv": True})


def tiny(name: str, seed: int = 0, **extra):
    mixer, kw = MIXERS[name]
    torch.manual_seed(seed)
    kw = {"n_layers": len(mixer) if isinstance(mixer, list) else 2, **kw, **extra}
    config = FastWeightsConfig(vocab_size=40, d_model=32, n_heads=2, mixer=mixer, init_std=0.5, **kw)
    return AutoModelForCausalLM.from_config(config).eval()


def repeating_prompt(seed: int = 0):
    torch.manual_seed(seed)
    block = torch.randint(1, 40, (1, 7))
    return torch.cat([block, block, block[:, :2]], 1)


def count_crops(monkeypatch):
    calls = []
    original = FastWeightsCache.crop

    def crop(self, n):
        calls.append((n, 0 if self.lm_cache is None else self.lm_cache.window_tokens))
        return original(self, n)

    monkeypatch.setattr(FastWeightsCache, "crop", crop)
    return calls


@pytest.mark.parametrize("name", list(MIXERS))
def test_prompt_lookup_and_assistant_give_greedy_tokens(name, monkeypatch, one_thread):
    model = tiny(name)
    prompt = repeating_prompt()
    greedy = dict(do_sample=False, max_new_tokens=14)
    with torch.no_grad():
        plain = model.generate(prompt, **greedy)
        calls = count_crops(monkeypatch)
        lookup = model.generate(prompt, prompt_lookup_num_tokens=3, **greedy)
        removed_by_lookup = sum(-n for n, _ in calls)
        assistant = model.generate(prompt, assistant_model=tiny("deltanet", seed=5, n_layers=1), **greedy)
        itself = model.generate(prompt, assistant_model=model, **greedy)  # every proposal accepted
    removed = sum(-n for n, _ in calls)
    print(f"{name}: {len(calls)} crops removing {removed} tokens ({removed_by_lookup} by prompt lookup)")
    assert torch.equal(lookup, plain) and torch.equal(assistant, plain) and torch.equal(itself, plain)
    assert removed > 0  # rollbacks happened, and tokens still equal greedy's
    assert all(n <= 0 and -n <= window for n, window in calls)


def test_left_padded_prompts(one_thread):
    """transformers itself refuses assisted generation for a batch (B > 1); a left-padded
    single prompt works and gives plain greedy's tokens."""
    model = tiny("hybrid")
    prompt = repeating_prompt()
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], 1)
    greedy = dict(do_sample=False, max_new_tokens=12, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(padded, attention_mask=mask, **greedy)
        lookup = model.generate(padded, attention_mask=mask, prompt_lookup_num_tokens=3, **greedy)
        unpadded = model.generate(prompt, **greedy)
        assert torch.equal(lookup, plain) and torch.equal(plain[:, 3:], unpadded)
        batch = torch.cat([padded, torch.cat([prompt[:, :3], prompt], 1)])
        with pytest.raises(ValueError, match="only supported for batch_size = 1"):
            model.generate(batch, attention_mask=torch.cat([mask, torch.ones_like(mask)]), prompt_lookup_num_tokens=3, **greedy)


def test_crop_rolls_back_exactly_and_refuses_bad_values(one_thread):
    """crop(-n) equals a window of the kept tokens bitwise; positive values, n beyond the window
    and a committed cache are refused, naming `tokens_to_remove`, with the cache unchanged."""
    model = tiny("hybrid")
    prompt, window, nxt = repeating_prompt(), torch.randint(1, 40, (1, 5)), torch.randint(1, 40, (1, 1))
    with torch.no_grad():
        out = model(prompt)
        out = model(window, cache=out.cache)
        cache = out.cache
        assert cache.is_croppable and cache.lm_cache.window_tokens == 5
        length = cache.get_seq_length()
        states = [s.memory.clone() for s in cache.lm_cache.states if hasattr(s, "memory")]
        for bad, match in [(2, r"`tokens_to_remove` must be <= 0.*got 2"), (-6, r"`n`=6 is more than the 5 token"),
                           (1.0, r"`tokens_to_remove` must be an int")]:
            with pytest.raises((ValueError, TypeError), match=match):
                cache.crop(bad)
            assert cache.get_seq_length() == length and cache.lm_cache.window_tokens == 5
            now = [s.memory for s in cache.lm_cache.states if hasattr(s, "memory")]
            assert all(torch.equal(a, b) for a, b in zip(now, states)) and len(now) == len(states) == 2
        cache.crop(-3)
        got = model(nxt, cache=cache).logits
        ref = model(window[:, :2], cache=model(prompt).cache).cache  # a window of the kept tokens
        want = model(nxt, cache=ref).logits
        assert torch.equal(got, want)
        with pytest.raises(ValueError, match=r"crop\(`tokens_to_remove`=-1\).*no open window"):
            cache.crop(-1)  # crop committed the window (and the forward read it)
        cache.crop(0)  # commits: always allowed
