"""fastweights.hf: the LM as a transformers model (generate, Trainer, save/load, cache),
conversion both ways, and transformers' gated-delta-rule models routed to our ops.

Tiny random models in float64 where exact equality is asserted (greedy tokens, padded
rows, round trips); skipped cleanly without transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="transformers not installed (pip install 'fastweights[hf]')")

import fastweights.hf as fh
from transformers import AutoModelForCausalLM

MIXERS = {
    "softmax": "softmax",
    "linear": "linear",
    "deltanet": "deltanet",
    "gated_deltanet": "gated_deltanet",
    "hybrid": ["gated_deltanet", "softmax", "deltanet"],
    "rwkv7-hybrid": ["rwkv7", "softmax", "rwkv7"],
}
VOCAB = 40


def tiny(mixer, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    n_layers = len(mixer) if isinstance(mixer, list) else 2
    cfg = fh.FastWeightsConfig(vocab_size=VOCAB, d_model=16, n_layers=n_layers, n_heads=2, mixer=mixer,
                               chunk_size=4, max_seq_len=64, **{"init_std": 0.3, **kw})  # std 0.3: varied greedy tokens
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def prompts(b=2, t=5, seed=1):
    return torch.randint(1, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_generate_greedy_equals_loop_of_full_forwards(mixer):
    model = tiny(MIXERS[mixer], tie_embeddings=False)  # untied: a tiny random model does not just repeat
    ids = prompts()
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert len(set(out[:, 5:].flatten().tolist())) > 3  # varied tokens, so a wrong cache would show
    x = ids
    with torch.no_grad():
        for _ in range(6):
            x = torch.cat([x, model(x, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    print(f"{mixer}: generate {out[0, 5:].tolist()} loop {x[0, 5:].tolist()}")
    assert torch.equal(out, x)


@pytest.mark.parametrize("mixer", ["hybrid"])
def test_seeded_sampling_is_reproducible(mixer):
    model = tiny(MIXERS[mixer])
    ids = prompts()
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, max_new_tokens=12, do_sample=True, top_k=20, pad_token_id=0))
    print("seed 3:", runs[0][0, 5:].tolist(), "seed 4:", runs[2][0, 5:].tolist())
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_left_padded_batch_gives_each_row_what_it_gives_alone(mixer):
    model = tiny(MIXERS[mixer], tie_embeddings=False)
    rows = [prompts(1, 3, seed=5)[0], prompts(1, 7, seed=6)[0]]
    width = max(len(r) for r in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    with torch.no_grad():
        batch_logits = model(ids, attention_mask=mask).logits
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    worst = 0.0
    for i, r in enumerate(rows):
        with torch.no_grad():
            alone = model(r[None]).logits[0]
        worst = max(worst, (batch_logits[i, width - len(r):] - alone).abs().max().item())
        alone_out = model.generate(r[None], max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(out[i, width:], alone_out[0, len(r):]), f"row {i}"
        print(f"{mixer} row {i}: {out[i, width:].tolist()}")
    print(f"{mixer}: max |padded-batch logits - row alone| = {worst:.1e}")
    assert worst < 1e-10


def test_trainer_runs_steps_with_decreasing_loss(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = tiny(["deltanet", "softmax"], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 8, (64,), generator=g)
    data = [{"input_ids": (s + torch.arange(16)) % 8 + 1, "labels": (s + torch.arange(16)) % 8 + 1} for s in starts]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=40, per_device_train_batch_size=8, learning_rate=1e-2,
        logging_steps=5, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model.train(), args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("Trainer losses:", [round(x, 3) for x in losses])
    assert len(losses) >= 6 and losses[-1] < 0.5 * losses[0]
    trainer.save_model(str(tmp_path / "saved"))  # tied embeddings: saved once, tied again on load
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    ids = data[0]["input_ids"][None]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)
    assert loaded.model.lm_head.weight is loaded.model.embed.weight


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_save_pretrained_from_pretrained_round_trips_logits_exactly(tmp_path, tie):
    model = tiny(MIXERS["hybrid"], tie_embeddings=tie)
    model.save_pretrained(tmp_path)
    files = sorted(os.listdir(tmp_path))
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files), files
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is fh.FastWeightsForCausalLM and loaded.dtype == torch.float64
    assert (loaded.model.lm_head.weight is loaded.model.embed.weight) == tie
    ids = prompts(2, 9)
    with torch.no_grad():
        a, b = model(ids).logits, loaded(ids).logits
    print(f"tie={tie}: files {files}, max |diff| = {(a - b).abs().max().item():.1e}")
    assert torch.equal(a, b)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny(MIXERS["hybrid"]).train()
    ids = prompts(2, 11)

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames it activation_checkpointing_enable in v6
        model.gradient_checkpointing_enable()
    assert model.model.gradient_checkpointing
    ckpt = grads()
    worst = max((plain[n] - ckpt[n]).abs().max().item() for n in plain)
    print(f"gradient checkpointing: max |grad diff| = {worst:.1e} over {len(plain)} tensors")
    assert worst < 1e-12


def test_cache_reorder_for_beam_search_and_crop():
    model = tiny(MIXERS["hybrid"])
    ids = prompts(3, 6)
    nxt = prompts(3, 1, seed=9)
    perm = torch.tensor([2, 0, 1])
    with torch.no_grad():
        out = model(ids)
        step = model(nxt, cache=out.cache).logits
        out2 = model(ids)
        out2.cache.reorder_cache(perm)
        step_perm = model(nxt[perm], cache=out2.cache).logits
    assert torch.equal(step_perm, step[perm])
    beams = model.generate(ids, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0)
    assert beams.shape == (3, 10)

    soft = tiny("softmax")
    with torch.no_grad():
        full = soft(ids)
        full.cache.crop(-2)  # transformers' convention: crop(-n) removes n tokens
        assert full.cache.get_seq_length() == 4
        cropped = soft(nxt, cache=full.cache).logits
        fresh = soft(nxt, cache=soft(ids[:, :4]).cache).logits
    print(f"crop: max |cropped - recomputed| = {(cropped - fresh).abs().max().item():.1e}")
    assert (cropped - fresh).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="no open window"):  # a prefill of fast-weight layers is committed
        out.cache.crop(-1)


def test_checkpoint_conversion_both_ways_call_and_cli(tmp_path):
    from fastweights.training import load_model, save_checkpoint
    from fastweights.cli import main
    from fastweights.models import LM

    lm = tiny(MIXERS["hybrid"]).model
    save_checkpoint(tmp_path / "ckpt", lm)
    ids = prompts(2, 8)
    with torch.no_grad():
        want = lm(ids)[0]
    fh.checkpoint_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    back = fh.hf_to_checkpoint(tmp_path / "hf", tmp_path / "ckpt2")
    lm2, _ = load_model(back)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want) and torch.equal(lm2(ids)[0], want)
    assert main(["hf", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf_cli")]) == 0
    assert main(["hf", "import", str(tmp_path / "hf_cli"), str(tmp_path / "ckpt_cli")]) == 0
    lm3, _ = load_model(tmp_path / "ckpt_cli")
    with torch.no_grad():
        assert torch.equal(lm3(ids)[0], want)
    assert isinstance(fh.hf_to_lm(fh.lm_to_hf(lm)), LM)


def tiny_qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, max_position_embeddings=128,
    )
    return Qwen3NextForCausalLM(cfg).eval()


def test_use_fastweights_kernels_routes_qwen3_next_to_our_ops():
    """Qwen3-Next (grouped value heads, in-model gate and l2 norm) with our ops equals its own
    torch fallback: prefill logits and cached greedy decoding."""
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen

    model = tiny_qwen3_next()
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(2))
    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    decorated = {n: getattr(qwen, n) for n in names}
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    try:
        # the reference: transformers' own pure-torch fallback
        with fh.kernels.torch_fallbacks(qwen, names), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_logits, ref = model(ids).logits, model.generate(ids, **kw)
        changed = fh.use_fastweights_kernels()
        assert {f"{qwen.__name__}.{n}" for n in names} <= set(changed)  # (and its causal convolution)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits, ours = model(ids).logits, model.generate(ids, **kw)
        ours_warned = [str(w.message) for w in caught if "fastweights" in str(w.filename) or "ignoring" in str(w.message)]
        assert not ours_warned, ours_warned
    finally:
        restored = fh.use_fastweights_kernels(False)
        for n in names:
            setattr(qwen, n, decorated[n])
    prefill = (logits - ref_logits).abs().max().item()
    decode = max((a - b).abs().max().item() for a, b in zip(ours.logits, ref.logits))
    print(f"Qwen3-Next, our ops vs torch fallback: prefill logits {prefill:.1e}, cached decode logits {decode:.1e}")
    assert torch.equal(ours.sequences, ref.sequences)
    assert prefill < 1e-5 and decode < 1e-5
    assert {f"{qwen.__name__}.{n}" for n in names} <= set(restored)


def test_core_package_does_not_import_transformers():
    code = ("import sys, fastweights, fastweights.layers, fastweights.models, fastweights.cli, fastweights.ops; "
            "print('transformers' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_cache_reorder_and_crop_with_a_convolved_softmax_layer():
    """``softmax_short_conv``: beam reordering moves the convolution state with the KV rows;
    crop outside a verify window is refused (the convolution state cannot forget tokens)."""
    model = tiny("softmax", softmax_short_conv=True)
    ids, nxt, perm = prompts(3, 6), prompts(3, 1, seed=9), torch.tensor([2, 0, 1])
    with torch.no_grad():
        step = model(nxt, cache=model(ids).cache).logits
        out = model(ids)
        out.cache.reorder_cache(perm)
        step_perm = model(nxt[perm], cache=out.cache).logits
    print(f"reordered vs permuted logits: {(step_perm - step[perm]).abs().max().item():.1e}")
    assert torch.equal(step_perm, step[perm])
    with pytest.raises(ValueError, match="no open window"):
        out.cache.crop(-1)
