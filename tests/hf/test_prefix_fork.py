"""The HF model's prefix reuse: ``generate(prompt + turn, cache=prefix_cache.fork())`` reads only the
turn and gives exactly what generating from the whole text gives (float64 tiny model)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import fastweights.hf as fh
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mixer", ["gated_deltanet", "kda"])
def test_generate_from_a_forked_prefix(mixer):
    torch.manual_seed(0)
    cfg = fh.FastWeightsConfig(mixer=mixer, vocab_size=50, d_model=32, n_layers=2, n_heads=2)
    model = AutoModelForCausalLM.from_config(cfg).double().eval()
    gen = torch.Generator().manual_seed(1)
    prompt, turn = torch.randint(0, 50, (1, 20), generator=gen), torch.randint(0, 50, (1, 7), generator=gen)
    full = torch.cat([prompt, turn], dim=1)
    with torch.no_grad():
        prefix = model(prompt).cache
        length = prefix.get_seq_length()
        warm = model.generate(full, cache=prefix.fork(), max_new_tokens=6, do_sample=False)
        cold = model.generate(full, max_new_tokens=6, do_sample=False)
        assert torch.equal(warm, cold)
        assert prefix.get_seq_length() == length  # the stored prefix is not advanced by its sessions
        logits = model(turn, cache=prefix.fork()).logits
        assert (logits - model(full).logits[:, prompt.shape[1]:]).abs().max().item() <= 1e-12
        two = prefix.fork(2)
        assert two.lm_cache.batch_size == 2
        small = prefix.fork(dtype=torch.bfloat16)
        assert all(s.memory.dtype == torch.float64 for s in small.lm_cache.states)  # widened back on fork
    with pytest.raises(ValueError, match=r"FastWeightsCache.fork: the cache is empty"):
        fh.FastWeightsCache(cfg.to_lm_config().mixers).fork()
