"""Positions, padding, packing and gradient checkpointing of the layers and the LM.

- RoPE: permuting earlier tokens changes a softmax layer's last output (NoPE: it does
  not); prefill + decoding equals the full pass with RoPE; scores depend on t − τ only.
- ``attention_mask``: a left-padded batch gives every row exactly what that row gives
  alone, for every mixer and a hybrid, in the forward pass and in decoding after it.
- ``cu_seqlens`` on the LM: packed sequences equal separate ones (logits, gradients,
  the cache they leave).
- ``gradient_checkpointing``: the same loss and gradients as without.
All in float64, so "equal" means ~1e-12.
"""

from __future__ import annotations

import pytest
import torch

from fastweights.layers import DeltaNet, GatedDeltaNet, LinearAttention, SoftmaxAttention
from fastweights.layers.common import rotary_embedding
from fastweights.models import LM, LMConfig

TOL = 1e-10
D_MODEL, HEADS, VOCAB = 40, 2, 37

LAYERS = {
    "softmax-rope": lambda: SoftmaxAttention(D_MODEL, HEADS),
    "softmax-nope": lambda: SoftmaxAttention(D_MODEL, HEADS, rope_theta=None),
    "softmax-rope-conv": lambda: SoftmaxAttention(D_MODEL, HEADS, use_short_conv=True, conv_size=3),
    "linear-conv": lambda: LinearAttention(D_MODEL, HEADS, use_short_conv=True, chunk_size=8),
    "deltanet": lambda: DeltaNet(D_MODEL, HEADS, chunk_size=8),
    "deltanet-noconv": lambda: DeltaNet(D_MODEL, HEADS, use_short_conv=False, chunk_size=8),
    "gated_deltanet": lambda: GatedDeltaNet(D_MODEL, HEADS, conv_size=3, chunk_size=8),
}
MODELS = {
    "softmax": "softmax",
    "linear": "linear",
    "deltanet": "deltanet",
    "gated_deltanet": "gated_deltanet",
    "hybrid": ["deltanet", "softmax", "gated_deltanet", "linear"],
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def _err(a, b):
    return (a - b).abs().max().item()


def _model(mixer, **kw):
    n_layers = len(mixer) if isinstance(mixer, list) else 2
    config = LMConfig(vocab_size=VOCAB, d_model=D_MODEL, n_layers=n_layers, n_heads=HEADS, mixer=mixer,
                      chunk_size=8, max_seq_len=256, **kw)
    return LM(config).double()


def _left_padded(lengths, width, dim=None):
    """Random rows of the given lengths, left-padded to ``width`` with junk (not zeros, so
    a leak would show); returns (batch, mask, the rows alone)."""
    rows = [torch.randn(1, n, dim, dtype=torch.float64) if dim else torch.randint(0, VOCAB, (1, n)) for n in lengths]
    junk = torch.randn(len(lengths), width, dim, dtype=torch.float64) * 5 if dim else torch.randint(0, VOCAB, (len(lengths), width))
    batch, mask = junk.clone(), torch.zeros(len(lengths), width, dtype=torch.long)
    for b, (n, row) in enumerate(zip(lengths, rows)):
        batch[b, width - n:] = row[0]
        mask[b, width - n:] = 1
    return batch, mask, rows


# -- RoPE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_theta", [10000.0, None], ids=["rope", "nope"])
def test_permuting_earlier_tokens_changes_the_last_output_only_with_rope(rope_theta):
    layer = SoftmaxAttention(D_MODEL, HEADS, rope_theta=rope_theta).double()
    x = torch.randn(2, 12, D_MODEL, dtype=torch.float64)
    perm = torch.randperm(11)
    y, _ = layer(x)
    y_perm, _ = layer(torch.cat([x[:, perm], x[:, 11:]], 1))
    change = _err(y[:, -1], y_perm[:, -1])
    print(f"rope_theta={rope_theta}: last output change after permuting the 11 earlier tokens {change:.2e}")
    if rope_theta is None:
        assert change <= TOL  # NoPE: the last query sees a set of rows
    else:
        assert change > 1e-3


def test_permuting_earlier_tokens_changes_the_lm_output():
    model = _model(["deltanet", "softmax"], use_short_conv=False)  # no conv: only RoPE gives order
    ids = torch.randint(0, VOCAB, (1, 16))
    perm = torch.randperm(15)
    last = model(ids)[0][:, -1]
    permuted = model(torch.cat([ids[:, perm], ids[:, 15:]], 1))[0][:, -1]
    print(f"hybrid LM without short conv: last logits change {_err(last, permuted):.2e}")
    assert _err(last, permuted) > 1e-6


def test_rope_scores_depend_on_relative_position_only():
    q, k = torch.randn(2, 1, 3, 16, dtype=torch.float64), torch.randn(2, 1, 3, 16, dtype=torch.float64)

    def score(t, tau):
        qt = rotary_embedding(q, torch.full((2, 1), t), 500.0)
        kt = rotary_embedding(k, torch.full((2, 1), tau), 500.0)
        return (qt * kt).sum(-1)

    err = _err(score(7, 3), score(107, 103))
    print(f"q_7·k_3 vs q_107·k_103 after RoPE: {err:.2e}; vs unrotated {_err(score(7, 3), score(0, 0)):.2e}")
    assert err <= 1e-12 and _err(score(7, 3), score(0, 0)) > 1e-3
    assert _err(rotary_embedding(q, torch.zeros(2, 1), 500.0), q) == 0  # position 0: identity


@pytest.mark.parametrize("rope_theta", [10000.0, 50.0, None], ids=["rope", "rope-theta50", "nope"])
def test_rope_prefill_plus_decoding_equals_full_forward(rope_theta):
    model = _model(["softmax", "deltanet", "softmax"], rope_theta=rope_theta)
    ids = torch.randint(0, VOCAB, (2, 30))
    full, _ = model(ids)
    logits, cache = model(ids[:, :13])
    outs = [logits]
    for t in range(13, 30):
        logits, cache = model(ids[:, t:t + 1], cache)
        outs.append(logits)
    err = _err(torch.cat(outs, 1), full)
    print(f"rope_theta={rope_theta}: prefill(13) + 17 steps vs full, max abs logit error {err:.2e}")
    assert err <= TOL


def test_rope_config_checks():
    with pytest.raises(ValueError, match=r"`rope_theta` must be a positive number, or None .*got 0"):
        LMConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, mixer="softmax", rope_theta=0)
    with pytest.raises(ValueError, match=r"head size must be even; got head size 5"):
        LMConfig(vocab_size=8, d_model=10, n_layers=1, n_heads=2, mixer="softmax")
    LMConfig(vocab_size=8, d_model=10, n_layers=1, n_heads=2, mixer="softmax", rope_theta=None)  # NoPE: any size
    LMConfig(vocab_size=8, d_model=10, n_layers=1, n_heads=2, mixer="deltanet")  # no softmax layer: not used


# -- attention_mask ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYERS))
def test_left_padded_layer_rows_equal_each_row_alone(name):
    layer = LAYERS[name]().double()
    lengths = [13, 5, 1, 20]
    x, mask, rows = _left_padded(lengths, 20, D_MODEL)
    y, state = layer(x, attention_mask=mask)
    errs = [_err(y[b, 20 - n:], layer(row)[0][0]) for b, (n, row) in enumerate(zip(lengths, rows))]
    pads = max(y[b, :20 - n].abs().max().item() if n < 20 else 0.0 for b, n in enumerate(lengths))
    # decoding continues each row as its own state would
    steps = torch.randn(4, 3, D_MODEL, dtype=torch.float64)
    decode_errs = []
    states = [layer(row)[1] for row in rows]
    for t in range(3):
        y_step, state = layer(steps[:, t:t + 1], state)
        for b in range(4):
            y_own, states[b] = layer(steps[b:b + 1, t:t + 1], states[b])
            decode_errs.append(_err(y_step[b], y_own[0]))
    print(f"{name}: padded vs alone {max(errs):.2e}, outputs at pads {pads:.1e}, 3 decode steps {max(decode_errs):.2e}")
    assert max(errs) <= TOL and pads == 0 and max(decode_errs) <= TOL


@pytest.mark.parametrize("case", list(MODELS))
def test_left_padded_lm_rows_equal_each_row_alone(case):
    model = _model(MODELS[case])
    lengths = [9, 17, 2]
    ids, mask, rows = _left_padded(lengths, 17)
    logits, cache = model(ids, attention_mask=mask)
    err = max(_err(logits[b, 17 - n:], model(row)[0][0]) for b, (n, row) in enumerate(zip(lengths, rows)))
    # greedy generation from left-padded prompts continues each row as it would alone
    out = model.generate(ids, 6, temperature=0, attention_mask=mask)
    same = all(torch.equal(out[b, 17:], model.generate(row, 6, temperature=0)[0, n:]) for b, (n, row) in enumerate(zip(lengths, rows)))
    # and a decoding step after it (mask in transformers' [B, L + T] form) gives each row's logits
    nxt = torch.randint(0, VOCAB, (3, 1))
    step, _ = model(nxt, cache, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1))
    step_err = max(_err(step[b], model(nxt[b:b + 1], model(row)[1])[0][0]) for b, row in enumerate(rows))
    print(f"{case}: padded vs alone logits {err:.2e}, one decode step {step_err:.2e}, greedy continuations equal: {same}")
    assert err <= TOL and step_err <= TOL and same


def test_padding_anywhere_is_skipped():
    """Not only left padding: a mask with holes runs each row's real tokens as one sequence."""
    model = _model(MODELS["hybrid"])
    ids = torch.randint(0, VOCAB, (2, 10))
    mask = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]])
    logits, _ = model(ids, attention_mask=mask)
    errs = [_err(logits[b][mask[b].bool()], model(ids[b][mask[b].bool()][None])[0][0]) for b in range(2)]
    print(f"mask with holes vs the real tokens alone: {max(errs):.2e}")
    assert max(errs) <= TOL


def test_padded_continuation_after_a_padded_prefill():
    """A second multi-token call with its own pads continues each row from the cache as
    that row's own tokens would (pads dropped in both calls)."""
    model = _model(MODELS["hybrid"])
    first, mask1, rows1 = _left_padded([7, 3], 7)
    second = torch.randint(0, VOCAB, (2, 4))
    mask2 = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    _, cache = model(first, attention_mask=mask1)
    logits, _ = model(second, cache, attention_mask=torch.cat([mask1, mask2], 1))
    errs = []
    for b, row in enumerate(rows1):
        real = second[b][mask2[b].bool()][None]
        alone, _ = model(torch.cat([row, real], 1))
        errs.append(_err(logits[b][mask2[b].bool()], alone[0, row.shape[1]:]))
    print(f"padded continuation vs each row alone: {max(errs):.2e}")
    assert max(errs) <= TOL


def test_all_ones_mask_is_the_plain_forward():
    model = _model(MODELS["hybrid"])
    ids = torch.randint(0, VOCAB, (2, 10))
    assert torch.equal(model(ids, attention_mask=torch.ones(2, 10, dtype=torch.bool))[0], model(ids)[0])


def test_bad_attention_masks():
    model = _model("deltanet")
    layer = DeltaNet(D_MODEL, HEADS)
    ids = torch.randint(0, VOCAB, (2, 6))
    with pytest.raises(ValueError, match=r"`attention_mask` must have shape \[B, T\] = \[2, 6\], got \[2, 5\]"):
        model(ids, attention_mask=torch.ones(2, 5))
    _, cache = model(ids)
    with pytest.raises(ValueError, match=r"`attention_mask` must have shape \[B, T\] = \[2, 1\] or \[B, L \+ T\] = \[2, 7\], got \[2, 3\]"):
        model(ids[:, :1], cache, attention_mask=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"`attention_mask` must be a bool or integer tensor of 0/1, got dtype torch.float32"):
        model(ids, attention_mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"`attention_mask` row\(s\) \[1\] hold no real token"):
        model(ids, attention_mask=torch.tensor([[1] * 6, [0] * 6]))
    with pytest.raises(ValueError, match=r"DeltaNet: `attention_mask` must have shape \[B, T\] = \[2, 6\], got \[6\]"):
        layer(torch.randn(2, 6, D_MODEL), attention_mask=torch.ones(6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"give `cu_seqlens` \(packed rows\) or `attention_mask` \(padded rows\), not both"):
        model(ids[:1], attention_mask=torch.ones(1, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 6]))


# -- packed sequences (cu_seqlens) on the LM ------------------------------------------------


@pytest.mark.parametrize("case", list(MODELS))
def test_packed_lm_equals_separate_sequences(case):
    model = _model(MODELS[case])
    lengths = [11, 2, 20]
    rows = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    cu = torch.tensor([0, 11, 13, 33])
    targets = [torch.randint(0, VOCAB, (1, n)) for n in lengths]

    def loss(logits, t):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), t.reshape(-1), reduction="sum")

    packed, cache = model(torch.cat(rows, 1), cu_seqlens=cu)
    loss(packed, torch.cat(targets, 1)).backward()
    grads_packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    separate = [model(row) for row in rows]
    sum(loss(lg, t) for (lg, _), t in zip(separate, targets)).backward()
    err = max(_err(packed[:, a:b], lg) for a, b, (lg, _) in zip(cu[:-1].tolist(), cu[1:].tolist(), separate))
    grad_err = max(_err(g, p.grad) for g, p in zip(grads_packed, model.parameters()))
    # the packed cache holds 3 sequences and decodes each as its own cache would
    nxt = torch.randint(0, VOCAB, (3, 1))
    step, _ = model(nxt, cache)
    step_err = max(_err(step[b], model(nxt[b:b + 1], c)[0][0]) for b, (_, c) in enumerate(separate))
    print(f"{case}: packed vs separate logits {err:.2e}, gradients {grad_err:.2e}, next step {step_err:.2e}")
    assert err <= TOL and grad_err <= TOL and step_err <= TOL
    assert cache.batch_size == 3


def test_bad_packed_input():
    model = _model("deltanet")
    with pytest.raises(ValueError, match=r"LM: `cu_seqlens` must end at the sequence length T=6, got 5"):
        model(torch.randint(0, VOCAB, (1, 6)), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match=r"LM: `cu_seqlens` requires batch size 1"):
        model(torch.randint(0, VOCAB, (2, 6)), cu_seqlens=torch.tensor([0, 2, 6]))
    _, cache = model(torch.randint(0, VOCAB, (1, 6)), cu_seqlens=torch.tensor([0, 2, 6]))
    with pytest.raises(ValueError, match=r"`cache` holds 2 sequences but `input_ids` has 3 packed sequences"):
        model(torch.randint(0, VOCAB, (1, 3)), cache, cu_seqlens=torch.tensor([0, 1, 2, 3]))


# -- gradient checkpointing ---------------------------------------------------------------------


@pytest.mark.parametrize("case", list(MODELS))
def test_gradient_checkpointing_gives_the_same_gradients(case):
    model = _model(MODELS[case])
    ids = torch.randint(0, VOCAB, (2, 21))
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, :6] = 0  # a padded row too: checkpointing recomputes the packed path
    results = {}
    for flag in (False, True):
        model.gradient_checkpointing = flag
        model.zero_grad()
        logits, _ = model(ids, attention_mask=mask, return_cache=False)
        logits.square().mean().backward()
        results[flag] = (logits.detach(), [p.grad.clone() for p in model.parameters()])
    err = _err(results[False][0], results[True][0])
    grad_err = max(_err(a, b) for a, b in zip(results[False][1], results[True][1]))
    print(f"{case}: checkpointed vs plain logits {err:.2e}, gradients {grad_err:.2e}")
    assert err == 0 and grad_err <= 1e-12


def test_gradient_checkpointing_is_a_config_field_and_skipped_in_eval():
    model = _model("deltanet", gradient_checkpointing=True)
    assert model.gradient_checkpointing
    calls = []
    import torch.utils.checkpoint as cp

    original = cp.checkpoint
    try:
        cp.checkpoint = lambda *a, **k: calls.append(1) or original(*a, **k)
        model(torch.randint(0, VOCAB, (1, 5)))
        n_train = len(calls)
        model.eval()
        model(torch.randint(0, VOCAB, (1, 5)))
        with torch.no_grad():
            model.train()
            model(torch.randint(0, VOCAB, (1, 5)))
    finally:
        cp.checkpoint = original
    assert n_train == 2 and len(calls) == 2  # once per block in training; never in eval or no_grad


def test_checkpoints_saved_before_rope_load_as_nope(tmp_path, monkeypatch):
    """A config saved without ``rope_theta`` came from a NoPE model: it must load as one."""
    from fastweights.training import load_model, save_checkpoint

    model = LM(LMConfig(vocab_size=VOCAB, d_model=D_MODEL, n_layers=1, n_heads=HEADS, mixer="softmax", rope_theta=None))
    as_dict = LMConfig.to_dict
    monkeypatch.setattr(LMConfig, "to_dict", lambda self: {k: v for k, v in as_dict(self).items()
                                                          if k not in ("rope_theta", "gradient_checkpointing")})
    save_checkpoint(tmp_path / "old", model)
    monkeypatch.undo()
    assert "rope_theta" not in (tmp_path / "old" / "config.json").read_text()
    loaded, _ = load_model(tmp_path / "old")
    ids = torch.randint(0, VOCAB, (1, 9))
    assert loaded.config.rope_theta is None and torch.equal(loaded(ids)[0], model.eval()(ids)[0])
