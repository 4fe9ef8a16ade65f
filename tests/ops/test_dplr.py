"""The diagonal-plus-low-rank (DPLR) delta rule of RWKV-7: every form against the float64
recurrence, forward and every gradient, on awkward shapes and strong decays; the recurrence
against a plain loop, KDA as a special case and fla's naive reference; fla's and RWKV-7's
call forms; bad inputs; fp32/bf16 against the recurrence's own error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastweights import ops

from helpers import assert_all_close, chunk_option, forward_backward, assert_close, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
NAMES = ("q", "k", "v", "a", "b", "gk")


def dplr_inputs(B, T, H, K, V, *, seed=0, dtype=F64, strong=False, initial_state=True):
    """RWKV-7-shaped inputs: a = −κ̂, b = κ̂ ⊙ (a learning rate in (0, 1)) with unit κ̂, gk in
    (−0.61, 0) as RWKV-7's, or down to −6.9 (α = 1e-3 per token and channel) when ``strong``."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    kappa = F.normalize(rand(B, T, H, K), dim=-1)
    low = 6.9 if strong else 0.6065
    x = dict(q=rand(B, T, H, K), k=rand(B, T, H, K) * 0.5, v=rand(B, T, H, V), a=-kappa,
             b=kappa * torch.sigmoid(rand(B, T, H, K)), gk=-low * torch.rand(B, T, H, K, generator=gen, dtype=F64))
    x = {n: t.to(dtype) for n, t in x.items()}
    if initial_state:
        x["initial_state"] = rand(B, H, K, V) * 0.5
    return x


def loop_dplr(q, k, v, a, b, gk, initial_state=None):
    """h ← (diag(e^gk) + b aᵀ) h + k vᵀ, o = K^−0.5 hᵀ q, one token and head at a time (float64)."""
    B, T, H, K = q.shape
    h = torch.zeros(B, H, K, v.shape[-1], dtype=F64) if initial_state is None else initial_state.double().clone()
    o = torch.zeros(B, T, H, v.shape[-1], dtype=F64)
    for t in range(T):
        for n in range(B):
            for i in range(H):
                transition = torch.diag(torch.exp(gk[n, t, i])) + torch.outer(b[n, t, i], a[n, t, i])
                h[n, i] = transition.double() @ h[n, i] + torch.outer(k[n, t, i], v[n, t, i]).double()
                o[n, t, i] = K ** -0.5 * h[n, i].T @ q[n, t, i].double()
    return o, h


run = forward_backward  # (o, h_T, grads) of (o·do).sum() + (h_T·dh).sum()




def test_recurrence_equals_the_plain_loop_and_kda_as_a_special_case():
    x = dplr_inputs(2, 9, 2, 5, 3)
    o, h = ops.recurrent_dplr_delta_rule(**x, output_final_state=True)
    o_ref, h_ref = loop_dplr(**x)
    assert_close("recurrence o vs loop", o, o_ref, 1e-13)
    assert_close("recurrence h_T vs loop", h, h_ref, 1e-13)
    # KDA: a = −β e^{gk} ⊙ k, b = k, v → β v
    k, beta = F.normalize(x["k"], dim=-1), torch.rand(2, 9, 2, dtype=F64)
    o, h = ops.recurrent_dplr_delta_rule(x["q"], k, beta[..., None] * x["v"], -beta[..., None] * x["gk"].exp() * k, k,
                                         x["gk"], initial_state=x["initial_state"], output_final_state=True)
    o_kda, h_kda = ops.recurrent_kda(x["q"], k, x["v"], x["gk"], beta, initial_state=x["initial_state"],
                                     output_final_state=True)
    assert_close("DPLR as KDA o", o, o_kda, 1e-13)
    assert_close("DPLR as KDA h_T", h, h_kda, 1e-13)


@pytest.mark.slow  # importing fla costs ~10 s
def test_recurrence_equals_fla_naive_reference():
    """fla's ``dplr_recurrence`` is head-first and computes in float32."""
    naive = pytest.importorskip("fla.ops.generalized_delta_rule.dplr.naive")
    x = dplr_inputs(2, 30, 2, 8, 6, seed=2)
    o, h = ops.recurrent_dplr_delta_rule(**x, output_final_state=True)
    head_first = [x[n].transpose(1, 2).float() for n in ("q", "k", "v", "a", "b", "gk")]
    o_fla, h_fla = naive.dplr_recurrence(*head_first, initial_state=x["initial_state"].float())
    assert_close("recurrent vs fla dplr_recurrence o", o, o_fla.transpose(1, 2).double(), 1e-5)
    assert_close("recurrent vs fla dplr_recurrence h_T", h, h_fla.double(), 1e-5)


FORMS = {
    "parallel": (ops.parallel_dplr_delta_rule, {}),
    "chunk16": (ops.chunk_dplr_delta_rule, dict(chunk_size=16)),
    "chunk64": (ops.chunk_dplr_delta_rule, dict(chunk_size=64)),
}
SHAPES = {"T1": (2, 1, 2, 8, 4), "T63_K60": (1, 63, 2, 60, 20), "T100_KneV": (2, 100, 2, 12, 10)}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("form", list(FORMS), ids=list(FORMS))
def test_form_equals_recurrence_forward_and_gradients(form, shape):
    fn, options = FORMS[form]
    x = dplr_inputs(*SHAPES[shape], seed=3)
    assert_all_close(f"{form} {shape}", run(fn, x, options), run(ops.recurrent_dplr_delta_rule, x), 1e-12, 1e-11)


def test_chunk_form_at_T_1000():
    x = dplr_inputs(1, 1000, 1, 16, 12, seed=4)
    assert_all_close("chunk T=1000", run(ops.chunk_dplr_delta_rule, x, dict(chunk_size=64)),
                     run(ops.recurrent_dplr_delta_rule, x), 1e-12, 1e-11)


def test_strong_decays_fp64_equal_and_fp32_within_2x():
    x = dplr_inputs(1, 200, 2, 16, 8, seed=5, strong=True)
    truth = run(ops.recurrent_dplr_delta_rule, x)
    assert_all_close("strong fp64", run(ops.chunk_dplr_delta_rule, x, dict(chunk_size=64)), truth, 1e-12, 1e-11)
    x32 = {n: t.float() for n, t in x.items()}
    got, base = run(ops.chunk_dplr_delta_rule, x32, dict(chunk_size=64)), run(ops.recurrent_dplr_delta_rule, x32)
    assert all(torch.isfinite(t).all() for t in (got[0], got[1], *got[2].values()))
    pairs = [("o", got[0], base[0], truth[0], 2), ("h_T", got[1], base[1], truth[1], 2)]
    pairs += [(f"d{n}", got[2][n], base[2][n], truth[2][n], 3) for n in truth[2]]
    for name, a, b, want, factor in pairs:
        err, base_err = rel_err(a, want), rel_err(b, want)
        print(f"fp32 {name}: chunk {err:.2e}, recurrent {base_err:.2e}")
        assert err <= factor * base_err, (name, err, base_err)


@pytest.mark.parametrize("form", ["parallel", "chunk16"])
def test_varlen_equals_each_sequence_alone(form):
    fn, options = FORMS[form]
    x = dplr_inputs(1, 100, 2, 12, 6, seed=7, initial_state=False)
    x["initial_state"] = torch.randn(3, 2, 12, 6, dtype=F64)
    cu = torch.tensor([0, 5, 37, 100])
    want = run(ops.recurrent_dplr_delta_rule, x, dict(cu_seqlens=cu))
    assert_all_close(f"{form} packed", run(fn, x, dict(options, cu_seqlens=cu)), want, 1e-12, 1e-11)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = {n: x[n][:, s:e] for n in NAMES}
        o_i, h_i = ops.recurrent_dplr_delta_rule(**alone, initial_state=x["initial_state"][i:i + 1], output_final_state=True)
        assert_close(f"sequence {i} alone", want[0][:, s:e], o_i, 1e-13)
        assert_close(f"sequence {i} state", want[1][i:i + 1], h_i, 1e-13)


def test_gradcheck_chunk_and_parallel():
    x = dplr_inputs(1, 6, 1, 3, 2, seed=9)
    names = list(x)
    for fn, options in ((ops.chunk_dplr_delta_rule, dict(chunk_size=4)), (ops.parallel_dplr_delta_rule, {})):
        def f(*tensors):
            return fn(**dict(zip(names, tensors)), output_final_state=True, **options)

        leaves = [x[n].clone().requires_grad_(True) for n in names]
        assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8)


def _block_inputs(bt, length, dk, dv, *, strong, seed):
    """One group of blocks, ``[Bt, L, ·]``, as the chunk form hands them to its block terms."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    kappa = F.normalize(rand(bt, length, dk), dim=-1)
    ab = torch.stack([-kappa, kappa * torch.sigmoid(rand(bt, length, dk))], dim=-2)
    gk = -(6.9 if strong else 0.6065) * torch.rand(bt, length, dk, generator=gen, dtype=F64)
    return rand(bt, length, dk), rand(bt, length, dk) * 0.5, rand(bt, length, dv), ab, gk


def autograd_block_terms_backward(q, k, v, ab, gk, cotangents, scale):
    """The test oracle: the adjoint of ``dplr_block_terms`` by autograd on the block's inputs, for the
    cotangents of ``(wu, scores, q_read, k_write, last)``; returns ``(dq, dk, dv, dab, dgk)``."""
    from fastweights.ops.dplr.parallel import dplr_block_terms

    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, ab, gk)]
    x = dplr_block_terms(*inputs, scale)
    return torch.autograd.grad((x.wu, x.scores, x.q_read, x.k_write, x.last), inputs, cotangents)


BLOCKS = {"L16": (3, 16, 5, 3, False), "L32_strong": (2, 32, 12, 7, True), "L24_strong": (2, 24, 6, 4, True),
          "L64_K60": (1, 64, 60, 20, False), "L1": (2, 1, 3, 2, False)}


@pytest.mark.parametrize("block", list(BLOCKS), ids=list(BLOCKS))
def test_hand_written_block_adjoint_equals_autograd(block):
    """``dplr_block_terms_backward`` against autograd through ``dplr_block_terms`` (float64, random
    cotangents of every term, the upper triangles of the scores' cotangent included: they must be
    ignored), for the terms of the parallel form (sub-block factors) and of the chunk form's
    backward (recursive halving; L = 24 is padded to 32 inside it)."""
    from fastweights.ops.dplr.chunk import _backward_terms
    from fastweights.ops.dplr.parallel import dplr_block_terms, dplr_block_terms_backward

    bt, length, dk, dv, strong = BLOCKS[block]
    q, k, v, ab, gk = _block_inputs(bt, length, dk, dv, strong=strong, seed=length + dk)
    gen = torch.Generator().manual_seed(1)
    shapes = [(bt, 2 * length, dk + dv), (bt, length, 2 * length), (bt, length, dk), (bt, 2 * length, dk), (bt, dk)]
    cotangents = [torch.randn(*shape, generator=gen, dtype=F64) for shape in shapes]
    want = autograd_block_terms_backward(q, k, v, ab, gk, cotangents, 0.37)
    for label, terms in (("parallel terms", dplr_block_terms), ("chunk terms", _backward_terms)):
        got = dplr_block_terms_backward(q, k, v, ab, terms(q, k, v, ab, gk, 0.37), *cotangents, 0.37)
        for name, g, w in zip(("q", "k", "v", "ab", "gk"), got, want):
            assert w.abs().max() > 0
            assert_close(f"{block} {label} d{name}", g, w, 1e-12)


GRAD_SHAPES = {"T1": (2, 1, 2, 8, 4, None), "T63_K60": (1, 63, 2, 60, 20, None), "T100_KneV": (2, 100, 2, 12, 10, None),
               "T1000": (1, 1000, 1, 8, 6, None), "T100_uneven_cu_seqlens": (1, 100, 2, 12, 6, [0, 5, 37, 100])}


@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("shape", list(GRAD_SHAPES), ids=list(GRAD_SHAPES))
def test_chunk_gradients_equal_the_recurrence_to_1e12(shape, chunk_size):
    """Every gradient of the chunk form (its hand-written backward, end to end) against autograd through
    the float64 recurrence, initial state included."""
    *dims, cu = GRAD_SHAPES[shape]
    x = dplr_inputs(*dims, seed=21, initial_state=cu is None)
    options = {}
    if cu is not None:
        options["cu_seqlens"] = torch.tensor(cu)
        x["initial_state"] = torch.randn(len(cu) - 1, dims[2], dims[3], dims[4], dtype=F64)
    want = run(ops.recurrent_dplr_delta_rule, x, options)
    assert_all_close(f"chunk{chunk_size} {shape}", run(ops.chunk_dplr_delta_rule, x, dict(options, chunk_size=chunk_size)),
                     want, 1e-12, 1e-12)


@pytest.mark.parametrize("group_tokens", [40, 100, 1 << 20], ids=["1_chunk_a_group", "3_chunks_a_group", "1_group"])
def test_chunk_forward_groups_equal_the_recurrence(group_tokens, monkeypatch):
    """The forward works through the chunks group by group (``GROUP_TOKENS`` token-heads each): any
    grouping, the last group and the last chunk partial, gives the recurrence's o and h_T (float64)."""
    from fastweights.ops.dplr import chunk as dplr_chunk

    monkeypatch.setattr(dplr_chunk, "GROUP_TOKENS", group_tokens)
    x = dplr_inputs(2, 75, 2, 12, 10, seed=29)
    with torch.no_grad():
        o, h = ops.chunk_dplr_delta_rule(**x, output_final_state=True, chunk_size=8)
    o_ref, h_ref = ops.recurrent_dplr_delta_rule(**x, output_final_state=True)
    assert_close(f"groups of {group_tokens} o", o, o_ref, 1e-12)
    assert_close(f"groups of {group_tokens} h_T", h, h_ref, 1e-12)


def test_chunk_gradients_over_several_backward_groups(monkeypatch):
    """The backward (KDA's driver) works through the chunks in groups of ``GROUP`` chunk-heads, last group
    first; with 4 chunk-heads a group (1 chunk at B 2, H 2) every group boundary carries dh."""
    from fastweights.ops.kda import chunk as kda_chunk

    monkeypatch.setattr(kda_chunk, "GROUP", 4)
    x = dplr_inputs(2, 75, 2, 12, 10, seed=31)
    assert_all_close("chunk8 backward groups", run(ops.chunk_dplr_delta_rule, x, dict(chunk_size=8)),
                     run(ops.recurrent_dplr_delta_rule, x), 1e-12, 1e-12)


def test_chunk_gradients_fp32_within_3x_of_the_recurrence():
    x = dplr_inputs(2, 100, 2, 24, 16, seed=23)
    truth = run(ops.recurrent_dplr_delta_rule, x)
    x32 = {n: t.float() for n, t in x.items()}
    got, base = run(ops.chunk_dplr_delta_rule, x32, dict(chunk_size=32)), run(ops.recurrent_dplr_delta_rule, x32)
    for name in truth[2]:
        err, base_err = rel_err(got[2][name], truth[2][name]), rel_err(base[2][name], truth[2][name])
        print(f"fp32 d{name}: chunk {err:.2e}, recurrent {base_err:.2e}")
        assert err <= 3 * base_err, (name, err, base_err)


def test_gradcheck_chunk_with_a_chunk_not_a_power_of_two():
    """C = 3: the halving products and their adjoint pad each block to 4 tokens."""
    x = dplr_inputs(1, 7, 2, 3, 2, seed=25)
    names = list(x)

    def f(*tensors):
        return ops.chunk_dplr_delta_rule(**dict(zip(names, tensors)), output_final_state=True, chunk_size=3)

    assert torch.autograd.gradcheck(f, [x[n].clone().requires_grad_(True) for n in names], eps=1e-6, atol=1e-8)


def test_forward_and_backward_are_registered_custom_ops():
    """The backward is a custom op of its own (``fastweights::chunk_dplr_bwd``) registered as the forward's
    autograd formula; opcheck: schema and fake tensors (shapes, dtypes, strides) of both."""
    x = dplr_inputs(1, 20, 2, 6, 5, seed=27)
    q, k, v, a, b, gk = (x[n].transpose(1, 2).contiguous() for n in NAMES)
    ab = torch.stack([a, b], dim=-2)
    h0 = x["initial_state"]
    fwd, bwd = torch.ops.fastweights.chunk_dplr_fwd, torch.ops.fastweights.chunk_dplr_bwd
    o, h_final, states = fwd(q, k, v, ab, gk, h0, 0.4, 8, True)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(fwd, (q, k, v, ab, gk, h0, 0.4, 8, True), test_utils=checks)
    torch.library.opcheck(bwd, (q, k, v, ab, gk, states, torch.randn_like(o), torch.randn_like(h_final), 0.4, 8, True),
                          test_utils=checks)


def test_inference_op_is_a_registered_custom_op_equal_to_the_forward_op():
    """Without a gradient the chunk form runs ``fastweights::chunk_dplr_infer`` (a and b as they come, no
    chunk states): opcheck (schema, fake tensors), and the same o and h_T as the forward op, bit for bit."""
    x = dplr_inputs(1, 20, 2, 6, 5, seed=33)
    q, k, v, a, b, gk = (x[n].transpose(1, 2).contiguous() for n in NAMES)
    h0 = x["initial_state"]
    infer = torch.ops.fastweights.chunk_dplr_infer
    torch.library.opcheck(infer, (q, k, v, a, b, gk, h0, 0.4, 8), test_utils=("test_schema", "test_faketensor"))
    o, h_final = infer(q, k, v, a, b, gk, h0, 0.4, 8)
    o_ref, h_ref, _ = torch.ops.fastweights.chunk_dplr_fwd(q, k, v, torch.stack([a, b], dim=-2), gk, h0, 0.4, 8, True)
    assert torch.equal(o, o_ref) and torch.equal(h_final, h_ref)


def test_step_equals_the_recurrence():
    x = dplr_inputs(2, 7, 2, 5, 4, seed=10)
    o_ref, h_ref = ops.recurrent_dplr_delta_rule(**x, output_final_state=True)
    h = x["initial_state"]
    for t in range(7):
        o_t, h = ops.dplr_step(*(x[n][:, t] for n in NAMES), h, 5 ** -0.5)
        assert_close(f"step {t}", o_t, o_ref[:, t], 1e-14)
    assert_close("step h_T", h, h_ref, 1e-14)


def test_fla_and_rwkv7_aliases_in_fla_positional_order():
    x = dplr_inputs(1, 20, 2, 6, 5, seed=11)
    q, k, v, a, b, gk, h0 = (x[n] for n in NAMES + ("initial_state",))
    o_ref, h_ref = loop_dplr(q * 6 ** 0.5, k, v, a, b, gk, h0)  # scale 1.0: chunk_rwkv7's default
    o, h = ops.chunk_rwkv7(q, gk, k, v, a, b, 1.0, h0, True, None, None, False, 8)
    assert_close("chunk_rwkv7 o", o, o_ref, 1e-12)
    assert_close("chunk_rwkv7 h_T", h, h_ref, 1e-12)
    o, h = ops.fused_recurrent_rwkv7(q, gk, k, v, a, b, 1.0, h0)  # output_final_state=True by default, as fla
    assert_close("fused_recurrent_rwkv7 o", o, o_ref, 1e-12)
    assert_close("fused_recurrent_rwkv7 h_T", h, h_ref, 1e-12)
    o, h = ops.fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, None, h0, True)
    assert_close("fused_recurrent_dplr_delta_rule o", o, loop_dplr(q, k, v, a, b, gk, h0)[0], 1e-12)
    with pytest.raises(ValueError, match="fused_recurrent_dplr_delta_rule: `reverse`=True is not supported"):
        ops.fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, reverse=True)


DPLR_FORMS = [ops.recurrent_dplr_delta_rule, ops.parallel_dplr_delta_rule, ops.chunk_dplr_delta_rule]


@pytest.mark.parametrize("fn", DPLR_FORMS, ids=lambda f: f.__name__)
def test_bad_inputs_are_refused_naming_the_argument(fn):
    x = dplr_inputs(1, 6, 2, 4, 3, initial_state=False)
    name = fn.__name__
    with pytest.raises(ValueError, match=rf"{name}: `a` must have the shape of `q` \[1, 6, 2, 4\] .*got \[1, 6, 2, 3\]"):
        fn(**{**x, "a": x["a"][..., :3]})
    with pytest.raises(TypeError, match=rf"{name}: `b` is required"):
        fn(**{n: t for n, t in x.items() if n != "b"})
    with pytest.raises(TypeError, match=rf"{name}: `b` must have the dtype of `q`"):
        fn(**{**x, "b": x["b"].float()})
    with pytest.raises(ValueError, match=rf"{name}: `gk` \(a per-key-channel log decay\) must be <= 0, got values up to 0.5"):
        fn(**{**x, "gk": x["gk"].clone().index_fill_(3, torch.tensor([1]), 0.5)})
    with pytest.raises(ValueError, match=rf"{name}: `cp_context`"):
        fn(**x, cp_context=object())
    with pytest.raises(TypeError, match=rf"{name}\(\) got an unexpected keyword argument `initial_states`; did you mean"):
        fn(**x, initial_states=None)
    deep = {**x, "gk": x["gk"].clone().index_fill_(3, torch.tensor([0]), -100.0)}
    if fn is ops.recurrent_dplr_delta_rule:
        fn(**deep)  # no floor for the recurrence
    else:
        with pytest.raises(ValueError, match=rf"{name}: `gk` must be >= -80 in this form"):
            fn(**deep)


@pytest.mark.parametrize("fn", [ops.chunk_dplr_delta_rule, ops.parallel_dplr_delta_rule], ids=lambda f: f.__name__)
def test_bf16_within_2x_of_the_recurrent_form(fn):
    x = dplr_inputs(1, 80, 2, 16, 16, seed=19, initial_state=False)
    xb = {n: t.to(torch.bfloat16) for n, t in x.items()}
    truth = run(ops.recurrent_dplr_delta_rule, {n: t.double() for n, t in xb.items()})
    base = run(ops.recurrent_dplr_delta_rule, xb)
    got = run(fn, xb, chunk_option(fn, 32))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    pairs = [("o", got[0], base[0], truth[0], 2), ("h_T", got[1], base[1], truth[1], 2)]
    pairs += [(f"d{n}", got[2][n], base[2][n], truth[2][n], 3) for n in truth[2]]
    for name, a, b, want, factor in pairs:
        err, base_err = rel_err(a, want), rel_err(b, want)
        print(f"{fn.__name__} bf16 {name}: {err:.2e} (recurrent {base_err:.2e})")
        assert err <= factor * base_err, (name, err, base_err)
