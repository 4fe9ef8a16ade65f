"""Verify windows and rollback (fastweights.models.window), and greedy speculative decoding.

"The same forms": a rolled-back cache must be bitwise the cache of a window of the
accepted tokens only (``model(accepted, cache, keep_window=True)``: the forms a window
runs), and match the float64 recurrence (one-token steps from the start) to 1e-12.
"""

from __future__ import annotations

import re

import pytest
import torch

from fastweights.layers import AttentionState, FastWeightState
from fastweights.models import LM, LMCache, LMConfig
from fastweights.models.speculative import lookup_proposals, speculative_generate
from fastweights.ops import KVCache

MIXERS = {
    "deltanet": ("deltanet", {}),
    "gated_deltanet": ("gated_deltanet", {}),
    "linear": ("linear", {}),
    "kda": ("kda", {}),
    "gdn2": ("gdn2", {}),
    "deltaproduct": ("deltaproduct", {}),
    "rwkv7": (["rwkv7", "rwkv7"], {}),
    "softmax": ("softmax", {}),
    "softmax_conv": ("softmax", {"softmax_short_conv": True}),
    "hybrid": (["deltanet", "softmax", "gated_deltanet", "linear"], {"softmax_short_conv": True}),
}
K = 6  # tokens per verify window


def tiny(name: str, dtype=torch.float32, seed: int = 0, **extra) -> LM:
    mixer, kw = MIXERS[name]
    torch.manual_seed(seed)
    n_layers = len(mixer) if isinstance(mixer, list) else 2
    config = LMConfig(vocab_size=40, d_model=32, n_layers=n_layers, n_heads=2, mixer=mixer, **{**kw, **extra})
    return LM(config).to(dtype).eval()


def tensors(cache: LMCache):
    """Every tensor of the cache's states, in order."""
    out = []
    for s in cache.states:
        if isinstance(s, FastWeightState):
            out += [s.memory] + ([s.conv] if s.conv is not None else [])
        elif isinstance(s, AttentionState):
            out += [s.kv.keys, s.kv.values, s.kv.lengths, s.conv]
        else:
            out += [s.keys, s.values, s.lengths]
    return out


def snapshot(cache: LMCache):
    return [t.clone() for t in tensors(cache)], cache.length, cache.window_tokens, len(cache.window)


def same(cache: LMCache, snap) -> bool:
    now = tensors(cache)
    return (len(now) == len(snap[0]) and all(torch.equal(a, b) for a, b in zip(now, snap[0]))
            and (cache.length, cache.window_tokens, len(cache.window)) == snap[1:])


def continue_decoding(model, cache, tokens):
    """Logits of reading ``tokens [B, n]`` one step at a time after ``cache``."""
    out = []
    for t in range(tokens.shape[1]):
        logits, cache = model(tokens[:, t: t + 1], cache)
        out.append(logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("name", list(MIXERS))
def test_rollback_is_bitwise_the_window_of_the_accepted_tokens(name, one_thread):
    model = tiny(name)
    prompt, window, after = torch.randint(0, 40, (2, 9)), torch.randint(0, 40, (2, K)), torch.randint(0, 40, (2, 3))
    with torch.no_grad():
        for accepted in (0, 1, 3, K - 1, K):
            _, cache = model(prompt)
            _, cache = model(window, cache)  # a verify window (T > 1 from a cache)
            assert cache.window_tokens == K
            cache.rollback(K - accepted)
            assert cache.length == 9 + accepted and cache.window_tokens == accepted
            _, ref = model(prompt)
            if accepted:
                _, ref = model(window[:, :accepted], ref, keep_window=True)
            states_equal = all(torch.equal(a, b) for a, b in zip(tensors(cache), tensors(ref)))
            got, want = continue_decoding(model, cache, after), continue_decoding(model, ref, after)
            print(f"{name} accepted={accepted}: states equal {states_equal}, max |logit diff| {(got - want).abs().max().item():.1e}")
            assert states_equal and torch.equal(got, want)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_both_window_forms_roll_back_bitwise(name, form, one_thread):
    """The memory of a window runs the chunk form (padded rows as no-ops) or the recurrent form."""
    model = tiny(name)
    model.window_chunk_from = 1 if form == "chunk" else 10 ** 9
    prompt, window, after = torch.randint(0, 40, (1, 5)), torch.randint(0, 40, (1, K)), torch.randint(0, 40, (1, 2))
    with torch.no_grad():
        _, cache = model(prompt)
        _, cache = model(window, cache)
        cache.rollback(2)
        _, ref = model(window[:, :K - 2], model(prompt)[1], keep_window=True)
        assert torch.equal(continue_decoding(model, cache, after), continue_decoding(model, ref, after))


@pytest.mark.parametrize("form", ["default", "chunk"])
@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "linear", "kda", "rwkv7", "hybrid"])
def test_rollback_matches_the_float64_recurrence(name, form, one_thread):
    """In float64, decoding after a rollback agrees to 1e-12 with a cache built one token at a
    time from the start (the recurrent form all along), and a window's logits with steps'."""
    model = tiny(name, torch.float64)
    if form == "chunk":
        model.window_chunk_from = 1  # the chunk form with padded rows as no-ops (linear: recurrent anyway)
    prompt, window, after = torch.randint(0, 40, (1, 7)), torch.randint(0, 40, (1, K)), torch.randint(0, 40, (1, 3))
    with torch.no_grad():
        _, cache = model(prompt)
        win_logits, cache = model(window, cache)
        cache.rollback(K - 2)
        got = continue_decoding(model, cache, after)
        seq = torch.cat([prompt, window[:, :2]], 1)
        step_logits, ref = model(seq[:, :1])
        steps = [step_logits]
        for t in range(1, seq.shape[1]):
            step_logits, ref = model(seq[:, t: t + 1], ref)
            steps.append(step_logits)
        want = continue_decoding(model, ref, after)
        ref_window = torch.cat(steps, 1)[:, 7:]
    err = ((got - want).abs().max() / want.abs().max()).item()
    err_window = ((win_logits[:, :2] - ref_window).abs().max() / ref_window.abs().max()).item()
    print(f"{name}: rollback vs float64 recurrence {err:.1e}; window logits vs steps {err_window:.1e}")
    assert err < 1e-12 and err_window < 1e-12


def test_window_memory_is_bounded_and_freed_on_commit(one_thread):
    """A committed cache has the size of one that never had a window; the window adds the
    fast-weight state before it and k·(K + V + 2 logits + 3·H·K conv inputs) per layer."""
    model = tiny("hybrid")
    prompt = torch.randint(0, 40, (1, 9))
    with torch.no_grad():
        _, c0 = model(prompt)
        base = c0.nbytes
        _, cache = model(torch.randint(0, 40, (1, K)), c0)
        states_bytes = sum(s.nbytes for s in cache.states)
        d, elem = 32, 4
        conv = 3 * d * (model.config.conv_size - 1) * elem
        expected = 0
        for mixer, before in zip(model.config.mixers, c0.states):
            heads = 2
            if mixer == "softmax":
                expected += conv + K * 3 * d * elem
            else:
                extra = {"deltanet": heads, "gated_deltanet": 2 * heads, "linear": 0}[mixer]
                expected += before.nbytes + K * (2 * d + extra + 3 * d) * elem
        print(f"committed {base} B; window adds {cache.window_nbytes} B (expected {expected}); states {states_bytes} B")
        assert cache.window_nbytes == expected
        assert cache.nbytes == states_bytes + expected
        cache.commit()
        assert cache.window_nbytes == 0 and cache.nbytes == states_bytes
        fast = [i for i, m in enumerate(model.config.mixers) if m != "softmax"]
        assert all(cache.states[i].nbytes == c0.states[i].nbytes for i in fast)  # constant size outside a window
        _, nxt = model(torch.randint(0, 40, (1, K)), cache)
        _, nxt2 = model(torch.randint(0, 40, (1, 1)), nxt)  # reading it commits `nxt`
        assert nxt.window_nbytes == 0 and nxt2.window_nbytes == 0


@pytest.mark.parametrize("name", ["deltanet", "hybrid"])
def test_bad_rollbacks_raise_and_leave_the_cache_unchanged(name, one_thread):
    model = tiny(name)
    with torch.no_grad():
        _, cache = model(torch.randint(0, 40, (1, 5)))
        _, cache = model(torch.randint(0, 40, (1, K)), cache)
        cache.rollback(1)  # a valid one first: the window is then K - 1 tokens
        snap = snapshot(cache)
        for bad, err, match in [(-1, ValueError, r"`n` must be an int >= 0.*got -1"),
                                (K, ValueError, rf"`n`={K} is more than the {K - 1} token\(s\) of the open window"),
                                (1.5, TypeError, r"`n` must be an int.*1\.5"), (True, TypeError, r"`n` must be an int")]:
            with pytest.raises(err, match=match):
                cache.rollback(bad)
            assert same(cache, snap), f"rollback({bad!r}) changed the cache"
        nxt, later = model(torch.randint(0, 40, (1, 1)), cache)  # the next forward commits `cache`
        snap = snapshot(cache)
        with pytest.raises(ValueError, match=r"cannot remove `n`=1 token\(s\): the cache has no open window"):
            cache.rollback(1)
        assert same(cache, snap)
        with pytest.raises(ValueError, match="no open window"):  # a one-token step keeps no window
            later.rollback(1)
        cache.rollback(0)  # nothing to remove: always allowed
        assert same(cache, snap)


def test_recording_keeps_one_window_across_forwards(one_thread):
    """``recording``: a window and then one-token steps form one window; a rollback crosses them."""
    model = tiny("hybrid")
    prompt, window, steps = torch.randint(0, 40, (1, 5)), torch.randint(0, 40, (1, 3)), torch.randint(0, 40, (1, 2))
    with torch.no_grad():
        _, cache = model(prompt)
        cache.recording = True
        _, cache = model(window, cache)
        for t in range(2):
            _, cache = model(steps[:, t: t + 1], cache)
        assert cache.window_tokens == 5 and len(cache.window) == 3
        cache.rollback(4)  # both steps and two of the window's tokens
        _, ref = model(window[:, :1], model(prompt)[1], keep_window=True)
        assert all(torch.equal(a, b) for a, b in zip(tensors(cache), tensors(ref)))
        cache.rollback(1)  # and further, to the prompt
        assert all(torch.equal(a, b) for a, b in zip(tensors(cache), tensors(model(prompt)[1])))


def test_softmax_only_cache_rows_can_be_cut_without_a_window(one_thread):
    model = tiny("softmax")
    ids, nxt = torch.randint(0, 40, (2, 6)), torch.randint(0, 40, (2, 1))
    with torch.no_grad():
        _, cache = model(ids)
        cache.rollback(2)
        got = model(nxt, cache)[0]
        want = model(nxt, model(ids[:, :4])[1])[0]
    assert isinstance(cache.states[0], KVCache) and cache.length == 4
    assert (got - want).abs().max().item() < 1e-6


def test_lookup_proposals():
    assert lookup_proposals([1, 2, 3, 9, 1, 2, 3, 7, 1, 2], 3) == [3, 7, 1]  # the most recent "1 2"
    assert lookup_proposals([5, 6, 7], 2) == []
    assert lookup_proposals([4, 4], 5) == [4]


#: Mixers whose speculative-generation run is in the slow suite only (their windows run the
#: recurrent step like KDA's; the bitwise rollback test above covers them by default).
SLOW_SPECULATIVE = ("gdn2", "deltaproduct", "rwkv7")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SPECULATIVE else n for n in MIXERS])
def test_speculative_generate_gives_greedy_tokens(name, one_thread):
    """Prompt lookup and a draft model (itself: all accepted; another: rejections, so rollbacks)."""
    model = tiny(name, init_std=0.5)
    other = tiny("deltanet", seed=3, init_std=0.5)
    block = torch.randint(0, 40, (1, 8))
    prompt = torch.cat([block, block, block[:, :3]], 1)
    plain = model.generate(prompt, 16, temperature=0)
    for kw in ({"prompt_lookup": 3}, {"draft": model}, {"draft": other}):
        ids, cache, stats = speculative_generate(model, prompt, 16, **kw)
        print(f"{name} {list(kw)[0]}: acceptance {stats.acceptance:.2f} over {stats.rounds} rounds")
        assert torch.equal(ids, plain) and cache.window_tokens == 0 and cache.length == prompt.shape[1] + 15
        if "draft" in kw and kw["draft"] is model:
            assert stats.acceptance == 1.0
        assert stats.rounds > 0
    assert torch.equal(model.generate(prompt[0], 16, temperature=0, prompt_lookup=2), plain[0])


def test_speculative_generate_bad_input(one_thread):
    model = tiny("deltanet")
    prompt = torch.randint(0, 40, (1, 4))
    with pytest.raises(ValueError, match="greedy; pass `temperature`=0"):
        model.generate(prompt, 4, prompt_lookup=2)
    with pytest.raises(ValueError, match=r"`prompt_lookup` must be an int >= 1.*got 0"):
        model.generate(prompt, 4, temperature=0, prompt_lookup=0)
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(torch.randint(0, 40, (2, 4)), 4, temperature=0, prompt_lookup=2)
    big = LM(LMConfig(vocab_size=41, d_model=32, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match=r"`draft` model's vocab_size \(41\)"):
        model.generate(prompt, 4, temperature=0, draft=big)
    with pytest.raises(ValueError, match="`keep_window`=True needs a cache"):
        model(prompt, keep_window=True)


@pytest.fixture(scope="module")
def recall_run(tmp_path_factory):
    """A DeltaNet trained for a few steps by ``fastweights train`` on the recall task."""
    from fastweights.cli import main

    out = tmp_path_factory.mktemp("spec") / "run"
    main(["train", "--out", str(out), "--mixer", "deltanet", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
          "--steps", "3", "--batch-size", "4", "--threads", "1", "--progress", "off", "--eval-every", "100"])
    return out


def test_small_prompt_lookup_benchmark(recall_run, one_thread):
    """The benchmark's honest small version: a model trained by ``fastweights train``, greedy
    against prompt lookup: identical tokens, some proposals accepted."""
    from benchmarks import speculative as bench

    result = bench.lookup(str(recall_run), k=3, prompts=2, max_new_tokens=16, repeats=1)
    assert result["identical"] and result["acceptance"] > 0


def test_cli_generate_prompt_lookup_and_draft(recall_run, capsys):
    from fastweights.cli import main

    args = ["generate", str(recall_run), "--prompt", "a 1 b 2 a 1 b 2 ? a", "--max-new-tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    plain = capsys.readouterr().out.splitlines()[0]
    assert main(args + ["--prompt-lookup", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == plain
    assert main(args + ["--draft", str(recall_run)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == plain
    for extra, match in [(["--prompt-lookup", "0"], r"`--prompt-lookup` must be an int >= 1.*got 0"),
                         (["--prompt-lookup", "2", "--draft", str(recall_run)], "not both"),
                         (["--prompt-lookup", "2", "--temperature", "1"], r"pass `--temperature 0`, got 1")]:
        with pytest.raises(SystemExit):  # the CLI reports a bad value as a usage error
            main(args[:-2] + extra)
        err = capsys.readouterr().err
        assert re.search(match, err), err
