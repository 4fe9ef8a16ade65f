"""Prefix reuse: a cache forked from a stored prompt continues exactly as the whole text.

float64 tiny models (every mixer and a hybrid): forking a prefix's cache and reading each
session's turn equals reading the prefix's own cache (bitwise: the same states and kernels)
and prefilling prompt + turn in one call (≤ 1e-12). bf16 storage: bitwise the continuation
from the state rounded to bf16 once; its distance from the fp32 path is reported, bounded.
"""

from __future__ import annotations

import pytest
import torch

from fastweights.models import LM, LMConfig, fork_cache, store_prefix

VOCAB = 41
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(mixer, dtype=torch.float64):
    n_layers = len(mixer) if isinstance(mixer, list) else 2
    config = LMConfig(vocab_size=VOCAB, d_model=32, n_layers=n_layers, n_heads=2, mixer=mixer, chunk_size=8,
                      max_seq_len=256)
    torch.manual_seed(0)
    return LM(config).to(dtype).eval()


@pytest.mark.parametrize("mixer", ["deltanet", "gated_deltanet", "kda", "linear", ["deltanet", "softmax"]])
def test_forked_prefix_equals_the_whole_text(mixer):
    model = _model(mixer)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, 21), generator=gen)  # not a multiple of the chunk size
    turns = torch.randint(0, VOCAB, (3, 13), generator=gen)
    with torch.no_grad():
        _, prefix = model(prompt)
        stored = store_prefix(prefix)
        logits, cache = model(turns, fork_cache(stored, 3))
        same, _ = model(turns, fork_cache(prefix, 3))
        whole, whole_cache = model(torch.cat([prompt.expand(3, -1), turns], dim=1))
        assert torch.equal(logits, same)  # the same states and kernels: bitwise
        assert (logits - whole[:, prompt.shape[1]:]).abs().max().item() <= 1e-12
        # decoding on: one token each, from the forked sessions and from the whole text's cache
        nxt = logits[:, -1:].argmax(-1)
        step, _ = model(nxt, cache)
        step_whole, _ = model(nxt, whole_cache)
        assert (step - step_whole).abs().max().item() <= 1e-12
        # the prefix was not touched by its sessions: forking it again gives the same logits
        again, _ = model(turns, fork_cache(stored, 3))
        assert torch.equal(again, logits)


def test_bf16_stored_prefix_rounding_contract():
    model = _model("gated_deltanet", torch.float32)
    gen = torch.Generator().manual_seed(2)
    prompt, turn = torch.randint(0, VOCAB, (1, 40), generator=gen), torch.randint(0, VOCAB, (2, 9), generator=gen)
    with torch.no_grad():
        _, prefix = model(prompt)
        stored = store_prefix(prefix, torch.bfloat16)
        assert all(s.memory.dtype == torch.bfloat16 for s in stored.states)
        assert stored.nbytes < prefix.nbytes
        warm, _ = model(turn, fork_cache(stored, 2))
        rounded = fork_cache(prefix, 2)
        for s in rounded.states:
            s.memory.copy_(s.memory.to(torch.bfloat16).float())
        by_hand, _ = model(turn, rounded)
        assert torch.equal(warm, by_hand)  # one rounding of the state, then the fp32 path
        cold, _ = model(turn, fork_cache(prefix, 2))
        rel = ((warm - cold).abs().max() / cold.abs().max()).item()
        assert 0 < rel < 1e-2, rel


def test_fork_refuses_clearly():
    model = _model("deltanet")
    with torch.no_grad():
        _, cache = model(torch.randint(0, VOCAB, (2, 5)))
    with pytest.raises(ValueError, match=r"fork_cache: `prefix` holds 2 sequences; expected 1"):
        fork_cache(cache, 3)
    with pytest.raises(ValueError, match=r"store_prefix: `dtype` must be None, torch.bfloat16 or torch.float16"):
        store_prefix(cache, torch.float32)
    with pytest.raises(TypeError, match=r"fork_cache: `cache` must be an LMCache"):
        fork_cache(object())
