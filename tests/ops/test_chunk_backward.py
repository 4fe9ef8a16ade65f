"""The chunk forms' hand-written backward passes (``ChunkDeltaRuleFunction``,
``ChunkLinearAttnFunction``) against autograd through the recurrent form.

Loss ``(o·do).sum() + (h_T·dh).sum()``, so the final state's cotangent is
exercised; dq, dk, dv, dβ, dg and dh0 must agree to 1e-10 relative in float64 on
awkward shapes (T ∈ {1, 63, 100}, K = 60 ≠ V, C ∈ {16, 32, 64}, B > 1, varlen
with uneven lengths, initial state given). ``gradcheck`` checks each Function
against finite differences. The memory test counts what autograd keeps.
"""

import functools

import pytest
import torch

from helpers import RULES, assert_close, call, make_inputs, saved_by_function
from fastweights import ops
from fastweights.ops.delta_rule.chunk import delta_rule_chunk
from fastweights.ops.delta_rule.api import textbook_chunk_delta_rule
from fastweights.ops.linear_attn.chunk import linear_attn_chunk


class ChunkDeltaRuleFunction:
    """``apply(q, k, v, beta, g, h0, scale, chunk_size, keep)``: the delta rule's chunk solver
    (head-first, hand-written backward), under the name of the ``autograd.Function`` it replaced."""

    apply = staticmethod(delta_rule_chunk)


class ChunkLinearAttnFunction:
    """``apply(q, k, v, g, h0, scale, chunk_size)``: linear attention's chunk solver (head-first,
    hand-written backward), under the name of the ``autograd.Function`` it replaced."""

    @staticmethod
    def apply(q, k, v, g, h0, scale, chunk_size):
        return linear_attn_chunk(q, k, v, None, g, h0, scale, chunk_size)

TOL = 1e-10
CHUNK_RULES = ["delta", "gated_delta", "linear", "linear_decay"]


def loss_grads(form, rule, x, do, dh, **kwargs):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, h = call(form, rule, leaves, output_final_state=True, **kwargs)
    loss = (o * do).sum() + (h * dh).sum()
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def cotangents(rule, x, seed, **kwargs):
    o, h = call(rule.reference, rule, x, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(h.shape, generator=gen, dtype=h.dtype)


@functools.lru_cache(maxsize=None)
def reference_case(rule_name, T):
    """Inputs, cotangents and autograd-through-the-recurrence gradients (shared by the chunk sizes)."""
    rule = RULES[rule_name]
    x = make_inputs(rule, 2, T, 2, 60, 20, initial_state=True, seed=21)
    do, dh = cotangents(rule, x, seed=22)
    return x, do, dh, loss_grads(rule.reference, rule, x, do, dh)


@pytest.mark.parametrize("chunk_size", [16, 32, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("T", [1, 63, 100], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("rule_name", CHUNK_RULES)
def test_chunk_gradients_equal_autograd_through_the_recurrence(rule_name, T, chunk_size):
    rule = RULES[rule_name]
    x, do, dh, want = reference_case(rule_name, T)
    got = loss_grads(rule.forms[2], rule, x, do, dh, chunk_size=chunk_size)
    assert set(got) == set(want) and (rule.g == ("g" in got)) and (rule.beta == ("beta" in got))
    for name in want:
        assert_close(f"d{name}", got[name], want[name], TOL)


@pytest.mark.parametrize("chunk_size", [16, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("rule_name", CHUNK_RULES)
def test_varlen_chunk_gradients_equal_the_recurrence(rule_name, chunk_size):
    rule = RULES[rule_name]
    lengths = [37, 1, 70, 16]  # uneven, one of length 1, one exactly a chunk at C=16
    x = make_inputs(rule, 1, sum(lengths), 3, 12, 9, seed=23)
    x["initial_state"] = make_inputs(rule, len(lengths), 1, 3, 12, 9, initial_state=True, seed=24)["initial_state"]
    cu = torch.tensor([0] + lengths).cumsum(0)
    do, dh = cotangents(rule, x, seed=25, cu_seqlens=cu)
    want = loss_grads(rule.reference, rule, x, do, dh, cu_seqlens=cu)
    got = loss_grads(rule.forms[2], rule, x, do, dh, cu_seqlens=cu, chunk_size=chunk_size)
    for name in want:
        assert_close(f"d{name}", got[name], want[name], TOL)


def test_no_initial_state_and_unused_final_state():
    """Without h0 there is no dh0; without output_final_state the state's cotangent is zero."""
    rule = RULES["gated_delta"]
    x = make_inputs(rule, 2, 50, 2, 8, 6, seed=26)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, _ = ops.chunk_gated_delta_rule(**leaves, chunk_size=16)
    o.square().sum().backward()
    ref = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o_ref, _ = ops.recurrent_gated_delta_rule(**ref)
    o_ref.square().sum().backward()
    for name in x:
        assert_close(f"d{name}", leaves[name].grad, ref[name].grad, TOL)


def test_gradients_reach_only_what_requires_them():
    rule = RULES["delta"]
    x = make_inputs(rule, 1, 40, 2, 8, 8, initial_state=True, seed=27)
    x["v"] = x["v"].clone().requires_grad_(True)
    o, h = ops.chunk_delta_rule(**x, output_final_state=True, chunk_size=16)
    (o.sum() + h.sum()).backward()
    assert x["v"].grad is not None and x["q"].grad is None and x["initial_state"].grad is None


def _tiny(rule_name, seed):
    rule = RULES[rule_name]
    x = make_inputs(rule, 1, 7, 1, 3, 2, initial_state=True, seed=seed)
    head_first = {n: (t.transpose(1, 2) if n != "initial_state" else t) for n, t in x.items()}
    return {n: t.detach().clone().contiguous().requires_grad_(True) for n, t in head_first.items()}


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated_delta"])
def test_gradcheck_delta_function(gated):
    x = _tiny("gated_delta", seed=28)
    g = x["g"] if gated else None

    def fn(q, k, v, beta, g, h0):
        return ChunkDeltaRuleFunction.apply(q, k, v, beta, g, h0, 0.7, 3, True)  # T = 7: chunks of 3, 3, 1

    args = (x["q"], x["k"], x["v"], x["beta"], g, x["initial_state"])
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "linear_decay"])
def test_gradcheck_linear_function(gated):
    x = _tiny("linear_decay", seed=29)
    g = x["g"] if gated else None

    def fn(q, k, v, g, h0):
        return ChunkLinearAttnFunction.apply(q, k, v, g, h0, 0.7, 3)

    args = (x["q"], x["k"], x["v"], g, x["initial_state"])
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_double_backward_is_refused():
    """Documented: the hand-written backward is once-differentiable."""
    x = _tiny("delta", seed=30)
    o, _ = ChunkDeltaRuleFunction.apply(x["q"], x["k"], x["v"], x["beta"], None, None, 0.7, 3, True)
    (gq,) = torch.autograd.grad(o.sum(), x["q"], create_graph=True)
    with pytest.raises(RuntimeError):
        gq.sum().backward()


def saved_bytes(fn):
    """Bytes of the distinct storages autograd keeps for the backward while ``fn`` runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("rule_name", ["delta", "gated_delta", "linear_decay"])
def test_backward_saves_only_inputs_states_and_ut_terms(rule_name):
    """Memory: O(T·(2K + V)) inputs + (T/C)·K·V chunk-entry states per head (+ the delta
    rules' [W | U'], T·(K + V), and diagonal-block inverses, T·C/4), no loop graph."""
    rule = RULES[rule_name]
    B, T, H, K, V, C = 1, 512, 2, 32, 24, 64
    x = make_inputs(rule, B, T, H, K, V, dtype=torch.float32, initial_state=True)
    x = {n: t.float().requires_grad_(True) for n, t in x.items()}
    saved = saved_bytes(lambda: call(rule.forms[2], rule, x, output_final_state=True, chunk_size=C))
    per_token = 2 * K + V + int(rule.beta) + int(rule.g) + (K + V + C // 4 if rule.beta else 0)
    bound = 4 * B * H * (T * per_token + (T // C) * K * V) + 4096  # + the front end's scalars
    print(f"{rule_name}: autograd keeps {saved / 2**20:.2f} MiB; bound inputs + states (+ W, U', X_j) = {bound / 2**20:.2f} MiB")
    assert saved <= bound
    if rule_name == "delta":
        textbook = saved_bytes(lambda: textbook_chunk_delta_rule(**x, output_final_state=True, chunk_size=C))
        print(f"textbook autograd path keeps {textbook / 2**20:.2f} MiB ({textbook / saved:.0f}x)")
        assert textbook > 8 * saved


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("rule_name", ["delta", "gated_delta"])
def test_inference_keeps_nothing_for_a_backward(rule_name, mode, monkeypatch):
    """Inputs that require grad, run under no_grad / inference_mode: the chunk Function keeps nothing."""
    rule = RULES[rule_name]
    x = make_inputs(rule, 1, 130, 2, 16, 8, dtype=torch.float32, initial_state=True)
    x = {n: t.float().requires_grad_(True) for n, t in x.items()}
    run = lambda: call(rule.forms[2], rule, x, output_final_state=True, backend="torch")
    with getattr(torch, mode)():
        kept = saved_by_function(monkeypatch, run)
    trained = saved_by_function(monkeypatch, run)
    print(f"{rule_name} {mode}: kept {kept} B (with grad: {trained} B)")
    assert trained > 0 and kept == 0


def test_textbook_baseline_equals_the_recurrence():
    """The benchmark's baseline is correct, forward and backward (float64)."""
    for rule_name in ["delta", "gated_delta"]:
        rule = RULES[rule_name]
        x = make_inputs(rule, 2, 100, 2, 12, 10, initial_state=True, seed=31)
        do, dh = cotangents(rule, x, seed=32)
        want = loss_grads(rule.reference, rule, x, do, dh)
        got = loss_grads(textbook_chunk_delta_rule, rule, x, do, dh, chunk_size=32)
        for name in want:
            assert_close(f"{rule_name} d{name}", got[name], want[name], TOL)


def test_bench_command_runs_on_tiny_shapes(tmp_path):
    """``fastweights bench`` end to end on tiny shapes (its numbers mean nothing here)."""
    import json

    from fastweights.cli import main

    out = tmp_path / "bench.json"
    args = ["bench", "--T", "40", "--heads", "1", "--head-dim", "8", "--chunk-size", "16", "--repeats", "1",
            "--threads", "1", "--recurrent-max-t", "40", "--no-memory", "--json", str(out),
            "--roofline-T", "32", "--roofline-heads", "1", "--roofline-head-dim", "8", "--decode-batch", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)  # the command sets the thread count for the whole process
    result = json.loads(out.read_text())
    impls = {(r["impl"], r["mode"]) for r in result["rows"]}
    assert impls == {(i, m) for i in ("recurrent", "textbook", "fast") for m in ("fwd", "fwd+bwd")}
    assert all(r["ms_min"] > 0 and r["gflops"] > 0 for r in result["rows"])
    assert result["meta"]["threads"] == 1 and result["matmul_gflops"]["square_1024"] > 0
    assert result["roofline"]["shape"]["K"] == 8 and all(r["rate"] > 0 for r in result["roofline"]["rows"])


@pytest.mark.parametrize("rule_name", ["delta", "gated_delta"])
def test_grouped_backward_equals_the_recurrence(rule_name, monkeypatch):
    """Long inputs run the forward and backward in groups of chunks (bounded transients); force small groups."""
    import fastweights.ops.delta_rule.chunk as chunk_module

    monkeypatch.setattr(chunk_module, "BACKWARD_GROUP", 3)  # 2 heads: one chunk-pair per group
    monkeypatch.setattr(chunk_module, "FORWARD_GROUP", 5)  # the forward in groups too (two chunks each)
    rule = RULES[rule_name]
    x, do, dh, want = reference_case(rule_name, 100)
    got = loss_grads(rule.forms[2], rule, x, do, dh, chunk_size=16)
    for name in want:
        assert_close(f"d{name}", got[name], want[name], TOL)


@pytest.mark.parametrize("length", [1, 2, 17, 60, 63, 64, 100])
def test_block_substitution_solves_the_ut_system_and_its_transpose(length):
    """``wy.block_substitution``: the UT solve (I + diag(β) S)⁻¹ diag(β) R and (I + A)⁻ᵀ R, float64."""
    from fastweights.ops.delta_rule.wy import block_substitution, diagonal_block_inverses, ut_solve

    gen = torch.Generator().manual_seed(length)
    s = torch.randn(3, length, length, generator=gen, dtype=torch.float64).tril(-1) * 0.4
    beta = torch.rand(3, length, generator=gen, dtype=torch.float64) * 2
    rhs = torch.randn(3, length, 5, generator=gen, dtype=torch.float64)
    lower = torch.eye(length, dtype=torch.float64) + beta.unsqueeze(-1) * s
    x = diagonal_block_inverses(s, beta)
    nb, bs = x.shape[0], x.shape[-1]
    assert nb * bs == length and nb <= 4
    y = ut_solve(s, beta, x, rhs)
    assert_close("UT solve", y, torch.linalg.solve(lower, beta.unsqueeze(-1) * rhs), 1e-12)
    yt = block_substitution(beta.unsqueeze(-1) * s, x, rhs, transpose=True)
    assert_close("transposed solve", yt, torch.linalg.solve(lower.transpose(-1, -2), rhs), 1e-12)
    inplace = rhs.clone()
    ut_solve(s, beta, x, inplace, out=inplace)
    assert_close("in place", inplace, y, 1e-15)
